"""The primitives worker's loop in process, on a real database: it takes a new training client, runs its calls
(forward_backward as protobuf, optim_step), moves an idle client to disk and brings it back exactly, and frees
the client when its session ends."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from contract.gen.tinker_public import tinker_public_pb2 as pb
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope
from service.primitives import service as primitives
from service.storage import get_storage
from tests.service.factories import create_tenant
from worker.grpo.resident import LoraSpec
from worker.primitives_worker import PrimitivesWorker

MODEL = "builtin:tiny"
TOKENS = [1, 5, 9, 13, 17, 21, 25, 29]


def _forward(model_id: str, seq_id: int, *, forward_only: bool) -> bytes:
    targets = np.asarray(TOKENS[1:], dtype="<i8")
    datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(
        tokens=np.asarray(TOKENS[:-1], dtype="<i4").tobytes()))])
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=targets.tobytes(), dtype=pb.DTYPE_INT64, shape=[len(targets)]))
    datum.loss_fn_inputs["weights"].CopyFrom(
        pb.Tensor(dense=np.ones(len(targets), "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[len(targets)]))
    request = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, data=[datum], loss_fn="cross_entropy",
                                        forward_only=forward_only)
    return request.SerializeToString()


def _logprobs(result: bytes) -> list[float]:
    output = pb.ForwardBackwardOutput.FromString(result)
    field = output.loss_fn_outputs[0].fields["logprobs"]
    return np.frombuffer(field.data, dtype="<f4").tolist()


@pytest.fixture
def worker(settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> PrimitivesWorker:
    monkeypatch.setenv("GRPO_PRIMITIVES_BASE_MODELS", json.dumps([MODEL]))
    get_settings.cache_clear()
    return PrimitivesWorker(get_settings(), get_storage(), cache_dir=tmp_path / "models", device="cpu")


def _run(worker: PrimitivesWorker, tenant_id: str, request_id: str) -> primitives.Future:
    for _ in range(20):
        worker.step()
        with session_scope() as session:
            future = primitives.future(session, tenant_id, request_id)
        if future.status in ("done", "failed"):
            return future
    raise AssertionError(f"{request_id} did not finish")


def test_the_loop_trains_offloads_and_frees_a_client(worker: PrimitivesWorker) -> None:
    """Two clients with one seed take the same calls; one of them is moved to disk and back in between. Their
    next optimizer step (AdamW's moments included) and log-probs stay identical."""
    with session_scope() as session:
        tenant, _ = create_tenant(session, "loop")
        session_id = primitives.start_session(session, tenant.id, "test", [], {})
        created = [primitives.create_training_client(session, tenant.id, session_id, n, MODEL, {"rank": 4, "seed": 3})
                   for n in (0, 1)]
    (moved, moved_creation), (stays, stays_creation) = created
    assert json.loads(_run(worker, tenant.id, moved_creation).result or b"") == {"model_id": moved,
                                                                                "type": "create_model"}
    _run(worker, tenant.id, stays_creation)

    def call(client_id: str, operation: str, seq_id: int, body: bytes) -> primitives.Future:
        with session_scope() as session:
            request_id = primitives.submit(session, tenant.id, client_id, operation, seq_id, body)
        future = _run(worker, tenant.id, request_id)
        assert future.status == "done", future.error
        return future

    def train_step(client_id: str, seq_id: int) -> list[float]:
        call(client_id, "forward_backward", seq_id, _forward(client_id, seq_id, forward_only=False))
        call(client_id, "optim_step", seq_id + 1, json.dumps({
            "model_id": client_id, "seq_id": seq_id + 1, "adam_params": {"learning_rate": 0.01}}).encode())
        forward = call(client_id, "forward", seq_id + 2, _forward(client_id, seq_id + 2, forward_only=True))
        return _logprobs(forward.result or b"")

    assert train_step(moved, 1) == train_step(stays, 1)
    patient = worker.settings
    worker.settings = patient.model_copy(update={"primitives_idle_offload_seconds": 1e-9})
    worker.last_used[stays] = time.monotonic() + 3600  # this one is not idle
    worker.step()
    worker.settings = patient
    assert list(worker.offloaded) == [moved] and worker.offloaded[moved].is_dir()
    resident = worker.residents[MODEL]
    with pytest.raises(LookupError):
        resident.client_spec(moved)  # out of memory
    assert train_step(moved, 4) == train_step(stays, 4)  # back, exactly: adapter and AdamW state
    assert moved not in worker.offloaded

    with session_scope() as session:
        primitives.finish_session(session, tenant.id, session_id)
    worker.step()
    assert not worker.held and not worker.offloaded


def test_the_vllm_sampler_serves_snapshots_and_the_base(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """GRPO_PRIMITIVES_SAMPLER=vllm: a snapshot taken by save_weights_for_sampler samples through vLLM what its
    client samples natively, a base-model sampler samples the base, and a closed session takes the snapshot's
    adapter out of the engine."""
    monkeypatch.setenv("GRPO_PRIMITIVES_BASE_MODELS", json.dumps([MODEL]))
    monkeypatch.setenv("GRPO_PRIMITIVES_SAMPLER", "vllm")
    monkeypatch.setenv("GRPO_PRIMITIVES_VLLM_MAX_LORA_RANK", "8")
    get_settings.cache_clear()
    worker = PrimitivesWorker(get_settings(), get_storage(), cache_dir=tmp_path / "models", device="cpu")
    resident = worker.residents[MODEL]
    engine = resident._vllm
    assert engine is not None
    try:
        with session_scope() as session:
            tenant, _ = create_tenant(session, "vllm-sampler")
            session_id = primitives.start_session(session, tenant.id, "test", [], {})
            client, creation = primitives.create_training_client(session, tenant.id, session_id, 0, MODEL,
                                                                 {"rank": 4, "seed": 3})
        _run(worker, tenant.id, creation)

        def call(target: str, operation: str, seq_id: int, body: bytes) -> bytes:
            with session_scope() as session:
                if operation == "sample":
                    request_id = primitives.submit_sample(session, tenant.id, target, seq_id, body)
                else:
                    request_id = primitives.submit(session, tenant.id, target, operation, seq_id, body)
            future = _run(worker, tenant.id, request_id)
            assert future.status == "done", future.error
            return future.result or b""

        call(client, "forward_backward", 1, _forward(client, 1, forward_only=False))
        call(client, "optim_step", 2, json.dumps({"model_id": client, "seq_id": 2,
                                                  "adam_params": {"learning_rate": 0.05}}).encode())
        snapshot = json.loads(call(client, "save_weights_for_sampler", 3, json.dumps({
            "model_id": client, "seq_id": 3, "sampling_session_seq_id": 0,
            "sampler_id": f"{session_id}:sample:0"}).encode()))["sampling_session_id"]
        assert engine.has_adapter(snapshot)

        def sample(sampler_id: str) -> list[list[int]]:
            body = {"sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 2,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]},
                    "sampling_params": {"max_tokens": 6, "temperature": 0.0, "stop": []}}
            response = pb.SampleResponse.FromString(call(sampler_id, "sample", 0, json.dumps(body).encode()))
            return [np.frombuffer(sequence.tokens, dtype="<i4").tolist() for sequence in response.sequences]

        native = resident.sample(client, TOKENS, num_samples=2, max_tokens=6, temperature=0.0, stop=[])
        assert sample(snapshot) == [s.tokens for s in native]
        with session_scope() as session:
            base_sampler = primitives.create_sampling_session(session, tenant.id, session_id, 1, base_model=MODEL,
                                                              model_path=None)
        resident.add_client("fresh", LoraSpec(rank=2, seed=0))  # B = 0: it samples the base, natively
        assert sample(base_sampler) == [resident.sample("fresh", TOKENS, max_tokens=6, temperature=0.0,
                                                        stop=[])[0].tokens] * 2
        resident.remove_client("fresh")

        with session_scope() as session:
            primitives.finish_session(session, tenant.id, session_id)
        worker.step()
        assert not worker.held and not engine.has_adapter(snapshot)
    finally:
        worker.close()
