"""use_vllm on a worker without vLLM fails the job at once with a code and a message naming the field; the
primitives worker's vLLM sampler without vLLM, or with a LoRA rank vLLM does not take, is refused at start naming
its setting."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from contract.spec import JobSpec
from service.jobs import service as jobs_service
from service.jobs.models import Job
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope
from service.storage import get_storage
from tests.service.factories import TenantHeaders
from tests.worker.conftest import RecordingQueue, insert_dataset, tiny_spec
from worker.grpo.vllm_rollout import VLLMUnavailable
from worker.primitives_worker import PrimitivesWorker
from worker.runner import JobRunner


def test_use_vllm_without_vllm_fails_naming_the_field(
    settings: Settings, make_tenant: Callable[[str], TenantHeaders], monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = make_tenant("acme")
    with session_scope() as session:
        spec = tiny_spec(insert_dataset(session, tenant.tenant_id), use_vllm=True)
        job_id = jobs_service.create_job(session, tenant.tenant_id, JobSpec.model_validate(spec), RecordingQueue()).id
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an interpreter without the package reports

    assert JobRunner(job_id, worker_id="w1").run() == "failed"

    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        assert job.error_code == "vllm_unavailable"
        assert job.error_message is not None and "hyperparameters.use_vllm" in job.error_message


def test_the_vllm_sampler_without_vllm_stops_the_primitives_worker_naming_the_setting(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv("GRPO_PRIMITIVES_BASE_MODELS", json.dumps(["builtin:tiny"]))
    monkeypatch.setenv("GRPO_PRIMITIVES_SAMPLER", "vllm")
    get_settings.cache_clear()
    with pytest.raises(VLLMUnavailable, match="GRPO_PRIMITIVES_SAMPLER: vLLM is not installed.*set it to native"):
        PrimitivesWorker(get_settings(), get_storage(), cache_dir=tmp_path / "models", device="cpu")


@pytest.mark.parametrize("rank", ["24", "0", "1024"])
def test_a_lora_rank_vllm_does_not_take_is_refused_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, rank: str
) -> None:
    monkeypatch.setenv("GRPO_PRIMITIVES_VLLM_MAX_LORA_RANK", rank)
    with pytest.raises(ValidationError, match="primitives_vllm_max_lora_rank: must be one of"):
        Settings()
