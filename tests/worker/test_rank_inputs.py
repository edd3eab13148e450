"""RankInputs across nodes: a rank on another node than rank 0's downloads its own copies of the checkpoints rank 0
fetched (real local storage), and its paths point into its own working directory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from contract.spec import JobSpec
from service.storage import Storage
from tests.worker.conftest import tiny_spec
from worker.grpo.checkpoint import CheckpointCorrupt
from worker.job_inputs import FetchedCheckpoint, RankInputs

SPEC = JobSpec.model_validate(tiny_spec("ds_x"))


def stored_checkpoint(storage: Storage, prefix: str, payload: bytes) -> list[dict[str, object]]:
    """A checkpoint of one file in storage, as a checkpoint row's manifest lists it."""
    files = {"model.safetensors": {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}}
    manifest = json.dumps({"files": files}).encode()
    storage.put_stream(f"{prefix}/model.safetensors", iter([payload]))
    storage.put_stream(f"{prefix}/manifest.json", iter([manifest]))
    return [{"path": "model.safetensors", **files["model.safetensors"]}, {"path": "manifest.json"}]


def inputs(rank0: Path, fetched: tuple[FetchedCheckpoint, ...]) -> RankInputs:
    return RankInputs(
        SPEC, "cpu-2", [], None, None, str(rank0 / "base" / "ck_base"), rank0 / "resume" / "checkpoint-4",
        {}, {"judge": str(rank0 / "reward-models" / "ck_judge"), "hub": "org/model"}, rank0 / "checkpoints",
        rank0, 0, fetched,
    )


def test_another_node_gets_its_own_copies_and_paths(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "storage"))
    rank0, here = tmp_path / "node0" / "attempt-1", tmp_path / "node1" / "attempt-1-node-x"
    fetched = (
        FetchedCheckpoint(rank0 / "resume" / "checkpoint-4", "jobs/j/checkpoints/c4",
                          stored_checkpoint(storage, "jobs/j/checkpoints/c4", b"resume")),
        FetchedCheckpoint(rank0 / "base" / "ck_base", "jobs/k/checkpoints/cb",
                          stored_checkpoint(storage, "jobs/k/checkpoints/cb", b"base")),
    )
    sent = inputs(rank0, fetched)
    sent.fetch_onto(here, storage)
    assert (here / "resume" / "checkpoint-4" / "model.safetensors").read_bytes() == b"resume"
    assert (here / "base" / "ck_base" / "model.safetensors").read_bytes() == b"base"
    local = sent.on_node(here)
    assert local.base_model == str(here / "base" / "ck_base")
    assert local.resume_from == here / "resume" / "checkpoint-4"
    assert local.model_paths == {"judge": str(here / "reward-models" / "ck_judge"), "hub": "org/model"}
    assert local.output_dir == here / "checkpoints" and local.workdir == here
    assert inputs(rank0, ()).on_node(here).base_model == str(here / "base" / "ck_base")
    assert RankInputs(**{**sent.__dict__, "base_model": "builtin:tiny"}).on_node(here).base_model == "builtin:tiny"


def test_a_copy_that_does_not_verify_is_refused(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "storage"))
    rank0 = tmp_path / "node0"
    manifest = stored_checkpoint(storage, "jobs/j/checkpoints/c4", b"resume")
    storage.put_stream("jobs/j/checkpoints/c4/model.safetensors", iter([b"tampered"]))
    sent = inputs(rank0, (FetchedCheckpoint(rank0 / "resume" / "checkpoint-4", "jobs/j/checkpoints/c4", manifest),))
    with pytest.raises(CheckpointCorrupt):
        sent.fetch_onto(tmp_path / "node1", storage)


def test_what_goes_through_the_collectives_holds_no_secret_and_no_rows(tmp_path: Path) -> None:
    import base64

    from outbound.rewards import RemoteRewardConfig
    from worker.grpo.data import PromptRow
    from worker.grpo.wire import dumps, loads

    secret = base64.b64encode(b"TOPSECRET-KEY-BYTES-0123456789ab").decode()
    config = RemoteRewardConfig.model_validate({
        "reward_function_id": "rf_1", "url": "http://127.0.0.1:9/score", "secret": f"whsec_{secret}",
        "job_id": "job_1", "headers": {"Authorization": "Bearer HEADERSECRET"}, "allow_private": True,
    })
    sent = replace(
        inputs(tmp_path / "node0", ()), train_rows=[PromptRow(prompt="ROWTEXT 1+1", extras={"answer": "2"})],
        remote_configs={"rf_1": config},
    )
    wire = dumps(sent.shared())
    for text in (secret.encode(), b"HEADERSECRET", b"ROWTEXT"):
        assert text not in wire
    assert loads(wire) == sent.shared()
    # The same node reads the whole inputs, secrets included, from a file only the worker's user can read.
    path = tmp_path / "node0" / "rank-inputs.json"
    sent.write(path)
    assert path.stat().st_mode & 0o077 == 0
    assert RankInputs.read(path) == sent


def test_values_from_peers_never_run_code(tmp_path: Path) -> None:
    """worker.grpo.wire reads only tensors and plain containers: a pickle that calls a function is refused."""
    import os
    import pickle

    from worker.grpo.wire import loads

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {marker}",)

    with pytest.raises(pickle.UnpicklingError):
        loads(pickle.dumps(Payload(), protocol=2))
    assert not marker.exists()
