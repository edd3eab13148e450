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
