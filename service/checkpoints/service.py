"""Checkpoints business logic: what the workers record, what a tenant may read and download.

The manifest is the allow-list for downloads: a file is served only if its exact relative path is
listed, and storage keys are built from ids plus that listed path (service.storage), never from
the request. What a checkpoint does to its job (the attempt's fence, the resume point, the events, retention)
is service.jobs.progress.record_checkpoint's; a job's list of checkpoints is service.jobs.service's.

Weights a training client of the Tinker API saves are checkpoints too (`add_tinker_checkpoint`, recorded with the
saved weights' row by service.execution.primitives): no job, step 0, no metrics, `tinker_path` naming them. Each
save is a checkpoint of its own, so a checkpoint's files never change under its id.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from service.checkpoints import repository
from service.checkpoints.models import Checkpoint
from service.kit.db import utcnow
from service.kit.errors import Conflict, NotFound, ValidationFailed
from service.kit.ids import new_id
from service.storage import InvalidStorageKey, Storage, checkpoint_prefix, validate_key

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def new_checkpoint_id() -> str:
    """The worker picks the id before uploading, so the files' storage keys can be built from it."""
    return new_id("ckpt")


# --- worker side ----------------------------------------------------------------------------------


def add_checkpoint(
    session: Session,
    storage: Storage,
    job_id: str,
    tenant_id: str,
    attempt: int,
    *,
    checkpoint_id: str,
    step: int,
    files: Mapping[str, Mapping[str, Any]],
    metrics: Mapping[str, float],
) -> Checkpoint:
    """Add the row of a checkpoint whose files the worker has uploaded under checkpoint_prefix(job, id).

    `files` is the engine manifest's `files` mapping: {relative path: {"size": int, "sha256": hex}}.
    Each path must be a safe relative key and exist in storage with the listed size (ValidationFailed), and the
    job may have one checkpoint per step (Conflict).
    """
    storage_path = checkpoint_prefix(job_id, checkpoint_id)
    manifest = _manifest(storage, storage_path, files)
    if repository.get_by_step(session, job_id, step) is not None:
        raise Conflict(f"job {job_id!r} already has a checkpoint at step {step}")
    checkpoint = Checkpoint(
        id=checkpoint_id,
        tenant_id=tenant_id,
        job_id=job_id,
        step=step,
        storage_path=storage_path,
        manifest=manifest,
        total_bytes=sum(entry["size"] for entry in manifest),
        metrics=dict(metrics),
        attempt=attempt,
        created_at=utcnow(),
    )
    session.add(checkpoint)
    return checkpoint


def add_tinker_checkpoint(
    session: Session,
    storage: Storage,
    tenant_id: str,
    *,
    tinker_path: str,
    storage_path: str,
    files: Mapping[str, Mapping[str, Any]],
) -> Checkpoint:
    """Add the checkpoint of weights a Tinker API training client saved as `tinker_path`, whose files the
    primitives worker uploaded under `storage_path`. `files` as for add_checkpoint (checked the same way)."""
    manifest = _manifest(storage, storage_path, files)
    checkpoint = Checkpoint(
        id=new_checkpoint_id(),
        tenant_id=tenant_id,
        job_id=None,
        tinker_path=tinker_path,
        step=0,
        storage_path=storage_path,
        manifest=manifest,
        total_bytes=sum(entry["size"] for entry in manifest),
        metrics={},
        attempt=0,
        created_at=utcnow(),
    )
    session.add(checkpoint)
    return checkpoint


def _manifest(storage: Storage, storage_path: str, files: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
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
        key = validate_key(f"{storage_path}/{path}")
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


def tinker_checkpoints(session: Session, tenant_id: str, tinker_path: str) -> list[Checkpoint]:
    """The tenant's checkpoints saved as `tinker_path`, oldest first: the last is what the path loads now.
    Empty for another tenant's path, as for an unknown one."""
    return list(repository.list_for_tinker_path(session, tenant_id, tinker_path))


def manifest_entry(checkpoint: Checkpoint, path: str) -> dict[str, Any]:
    """The listed file at exactly `path`. Anything else (traversal, unlisted names) is the same 404."""
    for entry in checkpoint.downloadable:
        if entry["path"] == path:
            return entry
    raise NotFound("checkpoint file", path)


def file_key(checkpoint: Checkpoint, entry: Mapping[str, Any]) -> str:
    """Storage key of a listed file: the recorded storage path plus the manifest path."""
    return validate_key(f"{checkpoint.storage_path}/{entry['path']}")
