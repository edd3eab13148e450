"""Worker test fixtures and helpers.

- The service fixtures (`db_url` over SQLite and PostgreSQL, `settings`, `make_tenant`...) are reused from
  tests/service/conftest.py.
- `RecordingQueue`: a JobQueue stub recording sends (for lease/reaper tests that run no broker).
- `insert_job`: a tenant's dataset (uploaded to storage) and a queued job through the real jobs service.
- Process helpers for the end-to-end tests live in tests/worker/procs.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy.orm import Session

from contract.spec import JobSpec
from service.datasets.models import Dataset
from service.jobs import service as jobs_service
from service.jobs.models import Job
from service.kit.ids import new_id
from service.storage import dataset_key, get_storage
from tests.service.conftest import (  # noqa: F401  (fixtures re-exported for tests/worker)
    _postgres_database,
    _sqlite_template,
    app,
    client,
    db_url,
    make_tenant,
    settings,
    tenant_a,
    tenant_b,
)

PROMPTS = [
    {"prompt": f"Say {word}:", "answer": word} for word in ("yes", "no", "up", "down", "left", "right")
]


@dataclass
class RecordingQueue:
    """A JobQueue that records what would have been sent."""

    sent: list[tuple[str, str]] = field(default_factory=list)

    def send_job(self, job_id: str, *, queue: str) -> None:
        self.sent.append((job_id, queue))


def tiny_spec(dataset_id: str, **hyper: Any) -> dict[str, Any]:
    """A job spec small enough to train in seconds on one CPU core."""
    hyperparameters: dict[str, Any] = {
        "num_generations": 2,
        "prompts_per_step": 2,
        "max_steps": 4,
        "max_completion_length": 8,
        "learning_rate": 1e-3,
        "checkpoint_every": 1,
        "log_completions_every": 1,
        "log_completions_count": 2,
        "seed": 0,
    }
    hyperparameters.update(hyper)
    return {
        "base_model": "builtin:tiny",
        "train_dataset": dataset_id,
        "rewards": [{"type": "builtin", "name": "exact_match", "weight": 1.0}],
        "hyperparameters": hyperparameters,
    }


def insert_dataset(session: Session, tenant_id: str, rows: list[dict[str, Any]] | None = None) -> str:
    data = "".join(json.dumps(row) + "\n" for row in (rows or PROMPTS)).encode()
    dataset_id = new_id("ds")
    key = dataset_key(dataset_id)
    get_storage().put_stream(key, [data])
    session.add(
        Dataset(
            id=dataset_id,
            tenant_id=tenant_id,
            name="prompts",
            num_rows=len(rows or PROMPTS),
            bytes=len(data),
            sha256="0" * 64,
            columns=["prompt", "answer"],
            storage_key=key,
        )
    )
    session.flush()
    return dataset_id


def insert_job(session: Session, tenant_id: str, queue: RecordingQueue | None = None, **hyper: Any) -> Job:
    dataset_id = insert_dataset(session, tenant_id)
    spec = JobSpec.model_validate(tiny_spec(dataset_id, **hyper))
    return jobs_service.create_job(session, tenant_id, spec, queue or RecordingQueue())


@pytest.fixture
def recording_queue() -> RecordingQueue:
    return RecordingQueue()
