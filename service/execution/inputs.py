"""What an attempt reads once, after its claim: the job's spec and placement, the storage keys of its datasets,
its reward endpoints and environment with their secrets, and the checkpoints it starts from (its own, or a tenant's checkpoint
named as a model). Returned as plain values, detached from any session, so the worker never holds an ORM row.

A dataset, reward function or environment deleted since submission ends the attempt with `InputMissing` (the job fails with
its code); the model-source rules the worker applies again before loading are the service's own
(service.jobs.model_sources).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from contract.evaluation import EvaluationSpec
from contract.spec import JobSpec, Resources, reward_function_refs
from service.checkpoints import repository as checkpoints_repository
from service.checkpoints.models import Checkpoint
from service.checkpoints.retention import delete_unrecorded
from service.environments import repository as environments_repository
from service.environments.models import Environment
from service.evaluations import repository as evaluations_repository
from service.evaluations.service import EVALUATION
from service.execution.lease import Claim, LeaseLost, rewind_to
from service.jobs import repository as jobs_repository
from service.jobs.model_sources import (
    ModelSource,
    ModelSourceKind,
    ModelSourcePolicy,
    ModelSourceRefused,
    classify,
)
from service.jobs.models import Job
from service.kit.db import session_scope, utcnow
from service.rewards.models import RewardFunction
from service.rewards.service import previous_secret_in_overlap
from service.storage import Storage

__all__ = [
    "InputMissing",
    "JobInputs",
    "ModelSource",
    "ModelSourceKind",
    "ModelSourcePolicy",
    "ModelSourceRefused",
    "StoredCheckpoint",
    "classify",
    "delete_unrecorded_checkpoints",
    "job_placement",
    "load_inputs",
    "rewind_past",
    "resume_checkpoint",
    "tenant_checkpoint",
]


class InputMissing(Exception):
    """Something the job's spec names no longer exists. `code` is the job's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class StoredCheckpoint:
    """A recorded checkpoint: where its files are and the manifest they verify against."""

    id: str
    step: int
    storage_path: str
    manifest: list[dict[str, Any]]

    @classmethod
    def of(cls, row: Checkpoint | None) -> StoredCheckpoint | None:
        if row is None:
            return None
        return cls(row.id, row.step, row.storage_path, [dict(entry) for entry in row.manifest])


@dataclass(frozen=True)
class JobInputs:
    """The job as its attempt trains it. `reward_endpoints` holds, by id, the fields of every registered reward
    function the spec names as a `RemoteRewardConfig` takes them, with its signing secrets (the replaced one too
    while a rotation's overlap lasts); the worker adds its own URL policy (`allow_private`) and validates them."""

    job_id: str
    tenant_id: str
    queue: str
    spec: JobSpec
    dataset_key: str
    eval_dataset_key: str | None
    retain_dataset_key: str | None
    reward_endpoints: dict[str, dict[str, Any]]
    # A multi-turn job's environment, as `outbound.openenv_session.EnvironmentConfig` takes it (the worker adds
    # its URL policy), with `max_sessions`: the job's cap within the environment's own.
    environment: dict[str, Any] | None = None
    # Set when the job runs an evaluation (its spec is then the job view of it: EvaluationSpec.as_job_spec).
    evaluation: EvaluationSpec | None = None


def job_placement(job_id: str) -> tuple[Resources, str] | None:
    """The job's resources and queue; None when it is gone or its spec no longer validates (the attempt then
    fails when it loads its inputs)."""
    with session_scope() as session:
        job = jobs_repository.get_job_any_tenant(session, job_id)
        if job is None:
            return None
        spec, queue = job.spec, str(job.queue)
    try:
        return JobSpec.model_validate(spec).resources, queue
    except ValidationError:
        return None


def load_inputs(claim: Claim) -> JobInputs:
    """The claimed job's inputs; `LeaseLost` if the job was deleted (only a finished job can be), `InputMissing`
    if a dataset or reward function it names was deleted."""
    with session_scope() as session:
        job = jobs_repository.get_job_any_tenant(session, claim.job_id)
        if job is None:
            raise LeaseLost(claim.job_id, claim.attempt)
        spec = JobSpec.model_validate(job.spec)
        datasets = jobs_repository.live_dataset_keys(session, job.tenant_id, [
            spec.train_dataset, spec.eval_dataset or spec.train_dataset, spec.retain_dataset or spec.train_dataset
        ])
        remote_ids = [rf_id for _, rf_id in reward_function_refs(spec.rewards)]
        functions = jobs_repository.live_reward_functions(session, job.tenant_id, remote_ids)
        job_id, tenant_id, queue = job.id, job.tenant_id, str(job.queue)
        evaluation = _evaluation_spec(session, job)
        endpoints = {rf_id: _endpoint_fields(row, job_id) for rf_id, row in functions.items()}
        environment = None
        if spec.environment is not None:
            row = environments_repository.get(session, job.tenant_id, spec.environment.environment_id)
            if row is None:
                raise InputMissing("environment_missing",
                                   f"environment {spec.environment.environment_id!r} no longer exists")
            environment = _environment_fields(row, spec.environment.max_sessions)
    for field in ("train_dataset", "eval_dataset", "retain_dataset"):
        dataset_id = getattr(spec, field)
        if dataset_id is not None and dataset_id not in datasets:
            raise InputMissing("dataset_missing", f"{field} {dataset_id!r} no longer exists")
    missing = sorted(set(remote_ids) - set(endpoints))
    if missing:
        raise InputMissing("reward_function_missing", f"reward function {missing[0]!r} no longer exists")
    return JobInputs(
        job_id=job_id, tenant_id=tenant_id, queue=queue, spec=spec,
        dataset_key=datasets[spec.train_dataset],
        eval_dataset_key=datasets[spec.eval_dataset] if spec.eval_dataset else None,
        retain_dataset_key=datasets[spec.retain_dataset] if spec.retain_dataset else None,
        reward_endpoints=endpoints,
        environment=environment,
        evaluation=evaluation,
    )


def _evaluation_spec(session: Session, job: Job) -> EvaluationSpec | None:
    if job.kind != EVALUATION:
        return None
    evaluation = evaluations_repository.get_any_tenant(session, job.id)
    if evaluation is None:  # cannot happen: the evaluation is deleted with its job
        raise LeaseLost(job.id, job.attempt)
    return EvaluationSpec.model_validate(evaluation.spec)


def _environment_fields(row: Environment, max_sessions: int | None) -> dict[str, Any]:
    return {
        "environment_id": row.id, "url": row.url, "secret": row.signing_secret,
        "previous_secret": previous_secret_in_overlap(
            row.previous_signing_secret, row.previous_secret_expires_at, utcnow()
        ),
        "previous_secret_until": row.previous_secret_expires_at,
        "headers": {str(k): str(v) for k, v in row.headers.items()},
        "step_timeout_s": row.step_timeout_s, "episode_timeout_s": row.episode_timeout_s,
        "max_attempts": row.max_attempts, "backoff_s": row.backoff_s,
        "max_sessions": min(row.max_concurrency, max_sessions or row.max_concurrency),
    }


def _endpoint_fields(row: RewardFunction, job_id: str) -> dict[str, Any]:
    return {
        "reward_function_id": row.id, "url": row.url, "secret": row.signing_secret,
        # Signs with the replaced secret too while a rotation's overlap lasts (outbound.signing).
        "previous_secret": previous_secret_in_overlap(
            row.previous_signing_secret, row.previous_secret_expires_at, utcnow()
        ),
        "previous_secret_until": row.previous_secret_expires_at,
        "job_id": job_id, "timeout_s": row.timeout_s, "max_batch_size": row.max_batch_size,
        "max_concurrency": row.max_concurrency, "headers": {str(k): str(v) for k, v in row.headers.items()},
        "max_attempts": row.max_attempts, "backoff_base_s": row.backoff_s,
        "breaker_threshold": row.breaker_threshold, "step_deadline_s": row.step_deadline_s,
        "max_abstain_fraction": row.max_abstain_fraction,
    }


def tenant_checkpoint(tenant_id: str, checkpoint_id: str) -> StoredCheckpoint | None:
    """A checkpoint of `tenant_id` named as a model source; None when it does not exist for that tenant."""
    with session_scope() as session:
        return StoredCheckpoint.of(checkpoints_repository.get(session, tenant_id, checkpoint_id))


def resume_checkpoint(job_id: str, *, before_step: int) -> StoredCheckpoint | None:
    """The job's newest checkpoint of a step before `before_step`."""
    with session_scope() as session:
        return StoredCheckpoint.of(checkpoints_repository.latest_checkpoint(session, job_id, before_step=before_step))


def rewind_past(claim: Claim, step: int) -> StoredCheckpoint | None:
    """The checkpoint of `step` is unusable: resume from the newest one before it (or from scratch), forgetting
    what earlier attempts recorded after that (service.execution.lease.rewind_to). Fenced."""
    with session_scope() as session:
        row = checkpoints_repository.latest_checkpoint(session, claim.job_id, before_step=step)
        rewind_to(session, claim, row)
        return StoredCheckpoint.of(row)


def delete_unrecorded_checkpoints(storage: Storage, job_id: str) -> list[str]:
    """Files of checkpoints an earlier attempt uploaded but no row records (service.checkpoints.retention)."""
    with session_scope() as session:
        return delete_unrecorded(session, storage, job_id)
