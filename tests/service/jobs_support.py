"""Helpers for the jobs/checkpoints tests: referenced rows, a recording queue, a stand-in worker."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy.orm import Session

from service.checkpoints.models import Checkpoint
from service.checkpoints.service import new_checkpoint_id
from service.datasets.models import Dataset
from service.jobs.models import Job
from service.jobs.progress import record_checkpoint
from service.jobs.repository import get_job_any_tenant
from service.jobs.states import JobStatus, transition
from service.kit.db import session_scope, utcnow
from service.kit.ids import new_id
from service.kit.queue import get_job_queue
from service.rewards.models import RewardFunction
from service.storage import Storage, checkpoint_key


class RecordingQueue:
    """The broker boundary stub: remembers what would have been sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def send_job(self, job_id: str, *, queue: str) -> None:
        with self._lock:
            self.sent.append((job_id, queue))


@pytest.fixture
def recording_queue(app: FastAPI) -> RecordingQueue:
    queue = RecordingQueue()
    app.dependency_overrides[get_job_queue] = lambda: queue
    return queue


def create_dataset(session: Session, tenant_id: str, *, deleted: bool = False) -> Dataset:
    dataset = Dataset(
        id=new_id("ds"),
        tenant_id=tenant_id,
        name="prompts",
        num_rows=3,
        bytes=30,
        sha256="0" * 64,
        columns=["prompt"],
        storage_key="datasets/x.jsonl",
        created_at=utcnow(),
        deleted_at=utcnow() if deleted else None,
    )
    session.add(dataset)
    session.flush()
    return dataset


def create_reward_function(session: Session, tenant_id: str) -> RewardFunction:
    rf = RewardFunction(
        id=new_id("rf"),
        tenant_id=tenant_id,
        name="judge",
        url="https://rewards.example.com/score",
        timeout_s=10.0,
        max_batch_size=32,
        max_concurrency=4,
        headers={},
        signing_secret="whsec_" + "A" * 32,
        created_at=utcnow(),
        updated_at=utcnow(),
    )
    session.add(rf)
    session.flush()
    return rf


def job_spec(train_dataset: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "tiny-run",
        "base_model": "builtin:tiny",
        "train_dataset": train_dataset,
        "rewards": [{"type": "builtin", "name": "exact_match", "weight": 1.0}],
        "hyperparameters": {"max_steps": 10, "num_generations": 4, "prompts_per_step": 2},
    }
    spec.update(overrides)
    return spec


def make_dataset(tenant_id: str) -> str:
    with session_scope() as session:
        return create_dataset(session, tenant_id).id


def start_job(job_id: str) -> int:
    """What the worker's claim does: queued -> running with attempt + 1. Returns the attempt."""
    with session_scope() as session:
        job = get_job_any_tenant(session, job_id, for_update=True)
        assert job is not None
        job.attempt += 1
        transition(session, job, JobStatus.running, reason="claimed by test worker")
        return job.attempt


def load_job(job_id: str) -> Job:
    with session_scope() as session:
        job = get_job_any_tenant(session, job_id)
        assert job is not None
        return job


def put_checkpoint(
    storage: Storage, job_id: str, attempt: int, step: int, files: dict[str, bytes]
) -> tuple[Checkpoint, dict[str, dict[str, Any]]]:
    """Upload files like the worker does, then record the checkpoint. Returns it and its manifest."""
    checkpoint_id = new_checkpoint_id()
    manifest = {}
    for path, content in files.items():
        storage.put_stream(checkpoint_key(job_id, checkpoint_id, path), [content])
        manifest[path] = {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    with session_scope() as session:
        checkpoint = record_checkpoint(
            session, storage, job_id, attempt, checkpoint_id=checkpoint_id, step=step, files=manifest
        )
    return checkpoint, manifest
