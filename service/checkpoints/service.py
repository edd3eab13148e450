"""Checkpoints business logic: what the worker records, what a tenant may read and download.

The manifest is the allow-list for downloads: a file is served only if its exact relative path is
listed, and storage keys are built from ids plus that listed path (service.storage), never from
the request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.orm import Session

from service.checkpoints import repository, retention
from service.checkpoints.models import Checkpoint
from service.jobs import service as jobs_service
from service.jobs.events import CHECKPOINT_EVENT
from service.jobs.progress import append_locked_event, load_owned_job
from service.kit.db import utcnow
from service.kit.errors import Conflict, NotFound, ValidationFailed
from service.kit.ids import new_id
from service.storage import InvalidStorageKey, Storage, checkpoint_key, checkpoint_prefix, validate_key

CHECKPOINTS_PRUNED_EVENT = "checkpoints_pruned"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def new_checkpoint_id() -> str:
    """The worker picks the id before uploading, so the files' storage keys can be built from it."""
    return new_id("ckpt")


# --- worker side ----------------------------------------------------------------------------------


def record_checkpoint(
    session: Session,
    storage: Storage,
    job_id: str,
    attempt: int,
    *,
    checkpoint_id: str,
    step: int,
    files: Mapping[str, Mapping[str, Any]],
    metrics: Mapping[str, float] | None = None,
) -> Checkpoint:
    """Register a checkpoint whose files the worker has uploaded under checkpoint_prefix(job, id).

    `files` is the engine manifest's `files` mapping: {relative path: {"size": int, "sha256": hex}}.
    Each path must be a safe relative key and exist in storage with the listed size. `metrics`
    defaults to the job's recorded metrics at `step`. Fenced by `attempt` (StaleAttempt otherwise).
    Emits a "checkpoint" event and makes this the job's resume point, then applies the job's retention
    (`service.checkpoints.retention`; a "checkpoints_pruned" event names what it deleted).
    """
    job = load_owned_job(session, job_id, attempt)
    manifest = _manifest(storage, job_id, checkpoint_id, files)
    if repository.get_by_step(session, job_id, step) is not None:
        raise Conflict(f"job {job_id!r} already has a checkpoint at step {step}")
    checkpoint = Checkpoint(
        id=checkpoint_id,
        tenant_id=job.tenant_id,
        job_id=job_id,
        step=step,
        storage_path=checkpoint_prefix(job_id, checkpoint_id),
        manifest=manifest,
        total_bytes=sum(entry["size"] for entry in manifest),
        metrics=dict(metrics) if metrics is not None else repository.metrics_at_step(session, job_id, step),
        attempt=attempt,
        created_at=utcnow(),
    )
    session.add(checkpoint)
    job.resume_checkpoint_id = checkpoint_id
    append_locked_event(
        session,
        job,
        CHECKPOINT_EVENT,
        f"checkpoint at step {step}",
        {
            "checkpoint_id": checkpoint_id,
            "step": step,
            "files": len(manifest),
            "total_bytes": checkpoint.total_bytes,
        },
    )
    pruned = retention.apply_retention(session, storage, job)
    if pruned:
        append_locked_event(
            session,
            job,
            CHECKPOINTS_PRUNED_EVENT,
            f"deleted {len(pruned)} checkpoint(s) beyond save_total_limit",
            {"checkpoint_ids": [c.id for c in pruned], "steps": sorted(c.step for c in pruned)},
        )
    return checkpoint


def _manifest(
    storage: Storage, job_id: str, checkpoint_id: str, files: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    if not files:
        raise ValidationFailed("files: a checkpoint needs at least one file")
    manifest = []
    for path, meta in sorted(files.items()):
        field = f"files[{path!r}]"
        try:
            validate_key(path)
        except InvalidStorageKey as exc:
            raise ValidationFailed(f"{field}: {exc}") from exc
        size, sha256 = meta.get("size"), meta.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValidationFailed(f"{field}.size: expected a non-negative integer, got {size!r}")
        if not isinstance(sha256, str) or not _SHA256.match(sha256):
            raise ValidationFailed(f"{field}.sha256: expected 64 lowercase hex digits")
        key = checkpoint_key(job_id, checkpoint_id, path)
        if not storage.exists(key) or storage.size(key) != size:
            raise ValidationFailed(f"{field}: not in storage with {size} bytes at {key!r}; upload it first")
        manifest.append({"path": path, "size": size, "sha256": sha256})
    return manifest


# --- API side -------------------------------------------------------------------------------------


def get_checkpoint(session: Session, tenant_id: str, checkpoint_id: str) -> Checkpoint:
    checkpoint = repository.get(session, tenant_id, checkpoint_id)
    if checkpoint is None:
        raise NotFound("checkpoint", checkpoint_id)
    return checkpoint


def list_job_checkpoints(session: Session, tenant_id: str, job_id: str) -> Sequence[Checkpoint]:
    jobs_service.get_job(session, tenant_id, job_id)
    return repository.list_for_job(session, job_id)


def manifest_entry(checkpoint: Checkpoint, path: str) -> dict[str, Any]:
    """The listed file at exactly `path`. Anything else (traversal, unlisted names) is the same 404."""
    for entry in checkpoint.downloadable:
        if entry["path"] == path:
            return entry
    raise NotFound("checkpoint file", path)


def file_key(checkpoint: Checkpoint, entry: Mapping[str, Any]) -> str:
    """Storage key of a listed file: the recorded storage path plus the manifest path."""
    return validate_key(f"{checkpoint.storage_path}/{entry['path']}")
