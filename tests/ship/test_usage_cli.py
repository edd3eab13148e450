"""The SDK's usage methods and the `grpo usage`, `grpo jobs get|estimate|set-budget` and `grpo admin set-budget`
commands against the real app under uvicorn (typer's runner in this process, GRPO_API_URL/GRPO_API_KEY)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli import app as cli_app
from client.sdk import APIError, GRPOClient
from service.kit import db as kit_db
from service.usage import service as usage
from service.usage.service import StepUsageIn
from tests.ship.test_client import (  # noqa: F401  (fixtures, used by name)
    LiveAPI,
    configured,
    job_spec,
    live_api,
    write_rows,
)


def _run(monkeypatch: pytest.MonkeyPatch, live_api: LiveAPI, *args: str) -> str:  # noqa: F811
    monkeypatch.setenv("GRPO_API_URL", live_api.url)
    monkeypatch.setenv("GRPO_API_KEY", live_api.api_key)
    result = CliRunner().invoke(cli_app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


@pytest.mark.timeout(120)
def test_sdk_and_cli_usage(
    live_api: LiveAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    with GRPOClient(live_api.url, live_api.api_key) as client:
        dataset = client.upload_dataset(write_rows(tmp_path / "rows.jsonl"))
        spec = job_spec(dataset.id)
        estimate = client.estimate_job(spec)
        assert estimate.steps == 2 and estimate.calibration.source == "default"
        job = client.create_job({**spec, "budget": {"max_tokens": 100}})
        with kit_db.session_scope() as session:  # what a worker records for a step
            from service.jobs.models import Job

            row = session.get(Job, job.id)
            assert row is not None
            usage.record_step(session, row, 1, 0, StepUsageIn(
                tokens_generated=12, tokens_trained=30, reward_calls=4, device_seconds=1.5, completions=4,
                completion_capacity=64, num_iterations=1, parameters=10**6,
            ))
        assert client.get_job_usage(job.id).totals.tokens == 42
        assert client.get_usage(group_by="job").data[0].key == job.id
        assert client.set_job_budget(job.id, {"max_device_seconds": 9}).spec.budget is not None
        with pytest.raises(APIError) as bad:
            client.set_job_budget(job.id, {"max_tokens": 0})
        assert bad.value.status == 422 and bad.value.details[0]["field"] == "body.budget.max_tokens"

    shown = json.loads(_run(monkeypatch, live_api, "jobs", "get", job.id, "--json"))
    assert shown["usage"]["totals"]["tokens"] == 42
    assert shown["usage"]["budget"]["budget"] == {"max_device_seconds": 9.0, "max_tokens": None}
    assert "tokens_generated" in _run(monkeypatch, live_api, "jobs", "get", job.id)

    report = json.loads(_run(monkeypatch, live_api, "usage", "--group-by", "job", "--json"))
    assert [(g["key"], g["tokens_generated"]) for g in report["data"]] == [(job.id, 12)]
    table = _run(monkeypatch, live_api, "usage", "--group-by", "job")
    assert "device_seconds" in table and "job_" in table

    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    assert json.loads(_run(monkeypatch, live_api, "jobs", "estimate", "-f", str(spec_file), "--json"))["steps"] == 2

    changed = json.loads(_run(monkeypatch, live_api, "jobs", "set-budget", job.id, "--max-tokens", "500", "--json"))
    assert changed["spec"]["budget"] == {"max_tokens": 500, "max_device_seconds": None}
    cleared = json.loads(_run(monkeypatch, live_api, "jobs", "set-budget", job.id, "--clear", "--json"))
    assert cleared["spec"]["budget"] is None

    capped = json.loads(_run(monkeypatch, live_api, "admin", "set-budget", "client-it", "--monthly-max-tokens", "42"))
    assert capped["monthly_max_tokens"] == 42
    assert GRPOClient(live_api.url, live_api.api_key).get_job_usage(job.id).budget.exhausted == (
        "tenant.monthly_max_tokens"
    )
