"""The CLI's tables at 80 columns: ids whole on one line (users copy them), the other columns wrapped to fit."""

from __future__ import annotations

import io
from datetime import UTC, datetime

import pytest
from rich.console import Console

from cli import output
from cli.datasets import LIST_COLUMNS as DATASET_COLUMNS
from cli.jobs import LIST_COLUMNS as JOB_COLUMNS
from cli.jobs import SAMPLE_COLUMNS
from contract.api.datasets import DatasetOut
from contract.api.jobs import JobOut, Progress, SampleOut
from contract.spec import JobSpec

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
DATASET_ID = "ds_01J9Z3K2Q8XW5T7M4N6P8R0S2V"
JOB_ID = "job_01JDX3V8Q4M2C6T9W1R5Y7Z0AB"


@pytest.fixture
def screen(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    out = io.StringIO()
    monkeypatch.setattr(output, "console", Console(file=out, width=80))
    return out


def dataset(name: str) -> DatasetOut:
    return DatasetOut(
        id=DATASET_ID, name=name, num_rows=7473, bytes=4_194_304, sha256="ab" * 32,
        columns=["prompt", "answer"], created_at=NOW,
    )


def job(name: str) -> JobOut:
    spec = JobSpec.model_validate(
        {
            "base_model": "builtin:tiny", "train_dataset": DATASET_ID, "hyperparameters": {"max_steps": 20},
            "rewards": [{"type": "builtin", "name": "exact_match"}],
        }
    )
    return JobOut(
        id=JOB_ID, name=name, status="running", base_model="builtin:tiny", train_dataset=DATASET_ID,
        eval_dataset=None, queue="cpu", progress=Progress(step=3, total_steps=20), metrics={}, error=None,
        attempt=1, max_attempts=3, pause_requested=False, resume_checkpoint_id=None, spec=spec, metadata={},
        created_at=NOW, updated_at=NOW, started_at=NOW, finished_at=None,
    )


def lines_of(screen: io.StringIO) -> list[str]:
    lines = screen.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    return lines


@pytest.mark.parametrize("name", ["gsm8k", "a-dataset-name-much-longer-than-any-column-could-hold-at-80"])
def test_datasets_list_shows_whole_ids(screen: io.StringIO, name: str) -> None:
    output.emit([dataset(name), dataset(name)], DATASET_COLUMNS, as_json=False)
    assert sum(DATASET_ID in line for line in lines_of(screen)) == 2


@pytest.mark.parametrize("name", ["nightly", "a-job-name-much-longer-than-any-column-could-hold-at-80-columns"])
def test_jobs_list_shows_whole_ids_and_keeps_short_values_whole(screen: io.StringIO, name: str) -> None:
    output.emit([job(name)], JOB_COLUMNS, as_json=False)
    first = next(line for line in lines_of(screen) if JOB_ID in line)
    assert "running" in first and "3/20" in first


def test_samples_name_the_reward_of_each_source(screen: io.StringIO) -> None:
    sample = SampleOut(
        id=1, step=2, prompt="2+2=", completion="4", reward=1.0, rewards={"exact_match": 1.0}, created_at=NOW
    )
    output.emit([sample], SAMPLE_COLUMNS, as_json=False)
    assert "exact_match=1" in screen.getvalue()
