"""A base model the engine cannot load fails its job as `model_load_failed`, naming the reason's class (unknown
architecture, corrupt safetensors, GGUF without the gguf package) and nothing of the loader's text: no worker
path, no traceback. The tenant's other job, its metrics, events, samples and checkpoints stay as they were.

Real jobs through JobRunner on SQLite and PostgreSQL; the models are real files (the tiny preset, then broken).
"A worker without the gguf package" is what an interpreter without it reports: `sys.modules["gguf"] = None`.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from contract.spec import JobSpec
from service.checkpoints.models import Checkpoint
from service.jobs import service as jobs_service
from service.jobs.models import Job, JobEvent, JobMetric, JobSample
from service.kit.config import Settings
from service.kit.db import session_scope
from tests.service.factories import TenantHeaders
from tests.worker.conftest import RecordingQueue, insert_dataset, tiny_spec
from worker.grpo.tiny import build_tiny_model
from worker.runner import JobRunner


def _submit(tenant_id: str, base_model: str, **hyper: Any) -> str:
    with session_scope() as session:
        spec = tiny_spec(insert_dataset(session, tenant_id), **hyper)
        spec["base_model"] = base_model
        return jobs_service.create_job(session, tenant_id, JobSpec.model_validate(spec), RecordingQueue()).id


def _snapshot(job_id: str) -> dict[str, Any]:
    """Everything recorded about one job."""
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        counts = {
            model.__name__: session.scalar(select(func.count()).select_from(model).where(model.job_id == job_id))
            for model in (JobEvent, JobMetric, JobSample, Checkpoint)
        }
        return {
            "status": job.status, "error": (job.error_code, job.error_message), "step": job.current_step,
            "metrics": job.latest_metrics, **counts,
        }


@pytest.fixture
def finished_job(settings: Settings, make_tenant: Callable[[str], TenantHeaders]) -> tuple[str, str]:
    """A tenant with one job that already trained (metrics, events, samples, a checkpoint): (tenant, job)."""
    tenant = make_tenant("acme").tenant_id
    job_id = _submit(tenant, "builtin:tiny", max_steps=1)
    assert JobRunner(job_id, worker_id="w1").run() == "succeeded"
    return tenant, job_id


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return build_tiny_model("tiny", tmp_path / "models" / "tiny")


def _fails_with(tenant: str, other_job: str, base_model: str, reason: str) -> None:
    other_before = _snapshot(other_job)
    job_id = _submit(tenant, base_model)

    assert JobRunner(job_id, worker_id="w1").run() == "failed"

    after = _snapshot(job_id)
    assert after["error"] == ("model_load_failed", f"base_model: {base_model!r} could not be loaded: {reason}")
    assert after["JobMetric"] == after["JobSample"] == after["Checkpoint"] == 0 and after["step"] == 0
    assert _snapshot(other_job) == other_before


class TestUnloadableBaseModel:
    def test_unknown_architecture(self, finished_job: tuple[str, str], tiny_dir: Path, tmp_path: Path) -> None:
        model = Path(shutil.copytree(tiny_dir, tmp_path / "models" / "foo"))
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "model_type": "foo", "architectures": ["FooForCausalLM"]}))

        _fails_with(*finished_job, str(model), "unknown architecture 'FooForCausalLM'")

    def test_corrupt_safetensors(self, finished_job: tuple[str, str], tiny_dir: Path, tmp_path: Path) -> None:
        model = Path(shutil.copytree(tiny_dir, tmp_path / "models" / "corrupt"))
        weights = (model / "model.safetensors").read_bytes()
        (model / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # a download cut short

        _fails_with(*finished_job, str(model), "corrupt safetensors file")

    def test_gguf_without_the_gguf_package(
        self, finished_job: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "gguf", None)  # what an interpreter without the package reports
        gguf_file = tmp_path / "models" / "model.Q4_0.gguf"
        gguf_file.parent.mkdir(parents=True, exist_ok=True)
        gguf_file.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))  # the header of GGUF v3
        folder = tmp_path / "models" / "gguf-folder"  # a directory holding only a GGUF file
        folder.mkdir()
        shutil.copy(gguf_file, folder / "model.gguf")

        for base_model in (str(gguf_file), str(folder)):
            _fails_with(*finished_job, base_model, "GGUF needs the gguf package on the worker")
        # The builtin real model is converted from a GGUF file on the worker: the same reason.
        _fails_with(*finished_job, "builtin:smollm2-135m-instruct", "GGUF needs the gguf package on the worker")

    def test_other_failures_stay_generic(self, finished_job: tuple[str, str], tmp_path: Path) -> None:
        empty = tmp_path / "models" / "empty"
        empty.mkdir(parents=True)
        other_job = finished_job[1]
        before = _snapshot(other_job)
        job_id = _submit(finished_job[0], str(empty))
        assert JobRunner(job_id, worker_id="w1").run() == "failed"
        assert _snapshot(job_id)["error"] == ("model_load_failed", f"base_model: {str(empty)!r} could not be loaded")
        assert _snapshot(other_job) == before
