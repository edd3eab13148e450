"""Celery tasks: `grpo.run_job(job_id)`, and `grpo.join_job(invitation)` for the other nodes of a job on several
(worker.nodes). Nothing comes out (results are ignored).

The task is idempotent by construction: JobRunner claims the job row first, so a duplicate or redelivered
message returns at once, and a retry after a crash resumes from the latest checkpoint instead of training
again from scratch. It never raises for a job's own failure (that is recorded on the job row); an
exception escaping here is a bug or an unreachable database, and the message is then acknowledged anyway
(acks_late acknowledges failed tasks too) — the reaper re-sends a job left queued, and re-enqueues one
whose lease expires.
"""

from __future__ import annotations

import logging
from typing import Any

# Imported here, in the Celery parent, so every forked child starts with it loaded (seconds saved between
# pickup and claim). It is torch-free: torch loads inside JobRunner.run(), in the child
# (tests/worker/test_queue_lease.py checks that importing this module never imports torch).
from sqlalchemy.orm import configure_mappers

from service.execution.runtime import end_idle_transactions_after, get_settings
from worker.celery_app import RUN_JOB_TASK, app
from worker.nodes import JOIN_JOB_TASK, Invitation, join
from worker.runner import JobRunner
from worker.spare_launcher import spare_launcher

# Mapper configuration is per process and costs a noticeable fraction of a second; done once here, it is
# inherited by every child. (No database connection is opened in the parent: connections must not cross fork.)
configure_mappers()

log = logging.getLogger(__name__)


@app.task(name=RUN_JOB_TASK, ignore_result=True, acks_late=True, reject_on_worker_lost=True)
def run_job(job_id: str) -> str:
    """Run (or resume, or ignore as a duplicate) the job; returns the outcome for the worker log."""
    # A worker frozen longer than its lease has lost the job anyway: its open transaction must not
    # keep the job row locked against the reaper (db.end_idle_transactions_after).
    settings = get_settings()
    end_idle_transactions_after(settings.lease_seconds)
    with spare_launcher(settings.worker_preload_engine) as spare:
        outcome = JobRunner(job_id).run(spare)
    log.info("grpo.run_job %s -> %s", job_id, outcome)
    return outcome


@app.task(name=JOIN_JOB_TASK, ignore_result=True, acks_late=True, reject_on_worker_lost=True)
def join_job(invitation: dict[str, Any]) -> str:
    """Run this worker's node of a job on several nodes (a stale invitation returns at once)."""
    with spare_launcher(get_settings().worker_preload_engine) as spare:
        outcome = join(Invitation.model_validate(invitation), spare=spare)
    log.info("grpo.join_job %s attempt %s -> %s", invitation["claim"]["job_id"], invitation["claim"]["attempt"], outcome)
    return outcome
