"""Weights saved through the Tinker API are checkpoints of their tenant, on SQLite and PostgreSQL, through real
components: a primitives worker (resident `builtin:tiny`, its CallRunner, storage) saves them from requests as the
door queues them; the REST routes read and download them (sizes and sha256 as listed), and another tenant gets
404; a job and an evaluation naming `checkpoint:<id>` run through JobRunner from the adapter merged onto its base
model; retention and deleting the job that used it leave the checkpoint and its files alone."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from peft import PeftModel
from safetensors.torch import load
from sqlalchemy import select
from transformers import AutoModelForCausalLM

from contract.evaluation import EvaluationSpec
from contract.spec import JobSpec
from service.checkpoints.models import Checkpoint
from service.evaluations import service as evaluations_service
from service.execution.inputs import JobInputs, ModelSourceKind, ModelSourcePolicy
from service.jobs import service as jobs_service
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope
from service.primitives import service as primitives
from service.storage import get_storage
from tests.service.factories import TenantHeaders
from tests.worker.conftest import RecordingQueue, insert_dataset, tiny_spec
from worker.grpo.model_paths import resolve_model_path
from worker.grpo.resident import AdamSettings, Datum
from worker.job_inputs import InputFetcher, RankInputs
from worker.model_sources import ModelUnavailable, adapter_only_base, check_checkpoint_adapter_base
from worker.primitives_worker import PrimitivesWorker
from worker.runner import JobRunner

BASE = "builtin:tiny"
LORA = {"rank": 4, "seed": 1, "train_mlp": True, "train_attn": True, "train_unembed": True}


@pytest.fixture
def worker(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[PrimitivesWorker]:
    monkeypatch.setenv("GRPO_PRIMITIVES_BASE_MODELS", json.dumps([BASE]))
    get_settings.cache_clear()
    configured = get_settings()
    yield PrimitivesWorker(configured, get_storage(), cache_dir=Path(configured.data_dir) / "models")


class Tinker:
    """One training client of a tenant, driven as the door would queue its calls."""

    def __init__(self, worker: PrimitivesWorker, tenant_id: str) -> None:
        self.worker, self.tenant_id, self.seq_id = worker, tenant_id, 0
        with session_scope() as session:
            session_id = primitives.start_session(session, tenant_id, "test", [], {})
            self.client_id, request_id = primitives.create_training_client(session, tenant_id, session_id, 0, BASE, LORA)
        self._finish(request_id)

    def train(self, steps: int = 3) -> None:
        """A few cross-entropy steps on the resident adapter, so that it no longer computes the base exactly."""
        resident = self.worker.residents[BASE]
        tokens = list(resident.tokenizer("Say yes: yes", add_special_tokens=False)["input_ids"])
        datum = Datum(tokens[:-1], {"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)})
        for _ in range(steps):
            resident.forward_backward(self.client_id, [datum], "cross_entropy")
            resident.optim_step(self.client_id, AdamSettings(learning_rate=5e-2))

    def call(self, operation: str, **fields: Any) -> dict[str, Any]:
        self.seq_id += 1
        body = json.dumps({"model_id": self.client_id, "seq_id": self.seq_id, **fields}).encode()
        with session_scope() as session:
            request_id = primitives.submit(session, self.tenant_id, self.client_id, operation, self.seq_id, body)
        return self._finish(request_id)

    def _finish(self, request_id: str) -> dict[str, Any]:
        for _ in range(10):
            self.worker.step()
            with session_scope() as session:
                future = primitives.future(session, self.tenant_id, request_id)
            if future.status in ("done", "failed"):
                break
        assert future.status == "done", future.error
        return dict(json.loads(future.result or b"{}"))


def _files(client: TestClient, tenant: TenantHeaders, checkpoint: dict[str, Any]) -> dict[str, bytes]:
    """Every listed file through the download route, checked against its size and sha256."""
    files = {}
    for entry in checkpoint["files"]:
        response = client.get(f"/v1/checkpoints/{checkpoint['id']}/files/{entry['path']}", headers=tenant)
        assert response.status_code == 200, response.text
        assert len(response.content) == entry["size"], entry
        assert hashlib.sha256(response.content).hexdigest() == entry["sha256"] == response.headers["etag"].strip('"')
        files[entry["path"]] = response.content
    return files


class TestSavedWeightsAreCheckpoints:
    def test_readable_downloadable_and_the_tenants_own(
        self, worker: PrimitivesWorker, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        tinker = Tinker(worker, tenant_a.tenant_id)
        tinker.train()
        saved = tinker.call("save_weights", path="first")
        path = f"tinker://{tinker.client_id}/weights/first"
        assert saved["path"] == path and saved["checkpoint_id"].startswith("ckpt_")

        response = client.get(f"/v1/checkpoints/{saved['checkpoint_id']}", headers=tenant_a)
        assert response.status_code == 200, response.text
        checkpoint = response.json()
        assert (checkpoint["job_id"], checkpoint["tinker_path"], checkpoint["step"], checkpoint["metrics"]) == (
            None, path, 0, {}
        )
        files = _files(client, tenant_a, checkpoint)
        assert set(files) == {
            "adapter_config.json", "adapter_model.safetensors", "lora_spec.json", "optimizer.pt", "manifest.json"
        }
        assert checkpoint["total_bytes"] == sum(len(content) for content in files.values())
        # The adapter names its base as the service does, not by where the worker built it.
        assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == BASE
        listed = {e["path"]: {"size": e["size"], "sha256": e["sha256"]} for e in checkpoint["files"]}
        assert json.loads(files["manifest.json"])["files"] == {k: v for k, v in listed.items() if k != "manifest.json"}
        archive = client.get(f"/v1/checkpoints/{saved['checkpoint_id']}/archive", headers=tenant_a)
        assert archive.status_code == 200 and len(archive.content) > checkpoint["total_bytes"]

        # Another tenant: exactly as an unknown id or path.
        assert client.get(f"/v1/checkpoints/{saved['checkpoint_id']}", headers=tenant_b).status_code == 404
        not_theirs = client.get(f"/v1/checkpoints/{saved['checkpoint_id']}/files/lora_spec.json", headers=tenant_b)
        assert not_theirs.status_code == 404
        assert client.get("/v1/checkpoints", params={"tinker_path": path}, headers=tenant_b).json()["data"] == []

        # Saving under the same name again is another checkpoint; the path lists both, the newest last.
        again = tinker.call("save_weights", path="first")
        listing = client.get("/v1/checkpoints", params={"tinker_path": path}, headers=tenant_a).json()["data"]
        assert [c["id"] for c in listing] == [saved["checkpoint_id"], again["checkpoint_id"]]
        assert _files(client, tenant_a, listing[0]) == files  # the first save's files are still its own

        sampler = tinker.call("save_weights_for_sampler", path="first")
        sampler_checkpoint = client.get(f"/v1/checkpoints/{sampler['checkpoint_id']}", headers=tenant_a).json()
        assert sampler_checkpoint["tinker_path"] == f"tinker://{tinker.client_id}/sampler_weights/first"
        assert "optimizer.pt" not in {f["path"] for f in sampler_checkpoint["files"]}
        # The saved state still loads back where it was saved (manifest.json and the named base changed nothing).
        assert tinker.call("load_weights", path=path, optimizer=True)["path"] == path


def _merged_by_peft(adapter: dict[str, bytes], base_dir: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The adapter merged onto its base by peft's own merge_and_unload: what the job must have started from."""
    directory = tmp_path / "adapter"
    directory.mkdir()
    for name, content in adapter.items():
        (directory / name).write_bytes(content)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), directory)
    return {name: tensor.detach() for name, tensor in model.merge_and_unload().state_dict().items()}


def _job_weights(job_id: str) -> dict[str, torch.Tensor]:
    """The model weights of the job's newest checkpoint, from storage."""
    with session_scope() as session:
        row = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc())).first()
        assert row is not None
        with get_storage().open(f"{row.storage_path}/model.safetensors") as handle:
            return load(handle.read())


class TestCheckpointAsModel:
    def test_a_job_and_an_evaluation_start_from_the_merged_adapter(
        self, worker: PrimitivesWorker, client: TestClient, tenant_a: TenantHeaders, tmp_path: Path
    ) -> None:
        tinker = Tinker(worker, tenant_a.tenant_id)
        tinker.train()
        saved = tinker.call("save_weights_for_sampler", path="policy")
        checkpoint = client.get(f"/v1/checkpoints/{saved['checkpoint_id']}", headers=tenant_a).json()
        adapter = _files(client, tenant_a, checkpoint)

        # A learning rate so small that the job's checkpoints hold the weights it started from; retention keeps
        # one of the job's two checkpoints.
        with session_scope() as session:
            dataset = insert_dataset(session, tenant_a.tenant_id)
            spec = tiny_spec(dataset, max_steps=2, checkpoint_every=1, learning_rate=1e-12, save_total_limit=1)
            spec["base_model"] = f"checkpoint:{saved['checkpoint_id']}"
            job_id = jobs_service.create_job(session, tenant_a.tenant_id, JobSpec.model_validate(spec),
                                             RecordingQueue()).id
        assert JobRunner(job_id, worker_id="w1").run() == "succeeded"

        base_dir = resolve_model_path(BASE, Path(get_settings().data_dir) / "models")
        expected, trained = _merged_by_peft(adapter, base_dir, tmp_path), _job_weights(job_id)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
        assert trained.keys() == expected.keys()
        for name, tensor in trained.items():
            assert torch.allclose(tensor, expected[name], atol=1e-6), name
        assert any(not torch.allclose(base[n], expected[n], atol=1e-4) for n in expected)  # the adapter did count

        with session_scope() as session:
            evaluation = evaluations_service.create_evaluation(session, tenant_a.tenant_id, EvaluationSpec(
                model=f"checkpoint:{saved['checkpoint_id']}", dataset=dataset,
                rewards=[{"type": "builtin", "name": "exact_match"}], max_tokens=4, max_items=2,
            ), RecordingQueue()).job.id
        assert JobRunner(evaluation, worker_id="w1").run() == "succeeded"
        summary = client.get(f"/v1/evaluations/{evaluation}", headers=tenant_a).json()
        assert summary["status"] == "succeeded" and summary["model"] == f"checkpoint:{saved['checkpoint_id']}", summary

        # Retention pruned the job's own step-1 checkpoint only; deleting the job leaves the weights' checkpoint.
        with session_scope() as session:
            steps = session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)).all()
        assert steps == [2]
        assert client.delete(f"/v1/jobs/{job_id}", headers=tenant_a).status_code == 204
        assert client.get(f"/v1/jobs/{job_id}", headers=tenant_a).status_code == 404
        assert _files(client, tenant_a, client.get(f"/v1/checkpoints/{saved['checkpoint_id']}", headers=tenant_a).json()) == adapter


class TestOtherNodes:
    def test_another_node_merges_its_own_copy(
        self, worker: PrimitivesWorker, settings: Settings, tenant_a: TenantHeaders, tmp_path: Path
    ) -> None:
        """A multi-node job: rank 0 merges the adapter where it downloaded it; another node, told only what rank 0
        fetched, downloads and merges its own copy at the same place under its working directory."""
        tinker = Tinker(worker, tenant_a.tenant_id)
        tinker.train()
        checkpoint_id = tinker.call("save_weights", path="nodes")["checkpoint_id"]
        spec = JobSpec.model_validate({**tiny_spec("ds_x"), "base_model": f"checkpoint:{checkpoint_id}"})
        job = JobInputs("job_x", tenant_a.tenant_id, "cpu", spec, "datasets/x", None, None, {})
        rank0, here = tmp_path / "node0", tmp_path / "node1"
        fetcher = InputFetcher("job_x", get_settings(), get_storage())
        base_model = fetcher.resolve_model(job, "base_model", spec.base_model, rank0 / "base")
        assert base_model == str(rank0 / "base" / f"{checkpoint_id}-merged")
        assert [f.adapter_base for f in fetcher.fetched] == [BASE]

        sent = RankInputs(spec, "cpu", [], None, None, base_model, None, {}, {}, rank0 / "checkpoints", rank0, 0,
                          tuple(fetcher.fetched))
        received = RankInputs.from_shared(sent.shared(), spec, ([], None, None), {})
        received.fetch_onto(here, get_storage())
        local = received.on_node(here)
        assert local.base_model == str(here / "base" / f"{checkpoint_id}-merged")
        weights = [(Path(p) / "model.safetensors").read_bytes() for p in (base_model, local.base_model)]
        assert weights[0] == weights[1]


class TestAdapterBase:
    """What an adapter-only checkpoint names as its base passes the model-source policy (worker.model_sources)."""

    def adapter(self, directory: Path, base: object) -> Path:
        directory.mkdir(parents=True)
        (directory / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "r": 4}))
        return directory

    def test_only_adapter_only_checkpoints_name_a_base(self, tmp_path: Path) -> None:
        adapter = self.adapter(tmp_path / "a", BASE)
        assert adapter_only_base(adapter) == BASE
        (adapter / "merged").mkdir()  # a LoRA job's checkpoint: its merged copy is the whole model
        assert adapter_only_base(adapter) is None
        assert adapter_only_base(self.adapter(tmp_path / "b", "org/x").parent / "missing") is None
        (tmp_path / "b" / "config.json").write_text("{}")
        assert adapter_only_base(tmp_path / "b") is None

    @pytest.mark.parametrize("base", ["checkpoint:ckpt_a", "", None, 3, "other/model", "/etc"])
    def test_refused_bases_name_only_the_checkpoint(self, tmp_path: Path, base: object) -> None:
        strict = ModelSourcePolicy((), (tmp_path / "data",), ("org/*",))
        with pytest.raises(ModelUnavailable) as info:
            check_checkpoint_adapter_base("base_model", "checkpoint:ckpt_x", base, strict)
        assert info.value.code == "model_source_refused"
        assert info.value.message == (
            "base_model: 'checkpoint:ckpt_x' is an adapter whose base model is not accepted here"
        )

    def test_builtin_and_allowed_hub_bases_pass(self, tmp_path: Path) -> None:
        strict = ModelSourcePolicy((), (tmp_path / "data",), ("org/*",))
        assert check_checkpoint_adapter_base("m", "checkpoint:c", BASE, strict).kind is ModelSourceKind.builtin
        assert check_checkpoint_adapter_base("m", "checkpoint:c", "org/x", strict).value == "org/x"
