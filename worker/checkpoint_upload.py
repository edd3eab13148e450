"""A checkpoint the trainer saved, into storage and then on record: every file is uploaded (the manifest last)
before the checkpoint's row is written, so nothing is recorded half-uploaded; a failed upload deletes what it
uploaded. The id is chosen before the upload, so the storage keys are known and a retried record is idempotent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.execution import reporting
from service.execution.lease import Claim
from service.execution.runtime import Storage, checkpoint_key, checkpoint_prefix, tensorboard_key

if TYPE_CHECKING:
    from worker.tensorboard import TensorBoardLog

MANIFEST_NAME = "manifest.json"
CHUNK = 1 << 20


def upload_checkpoint(
    storage: Storage,
    claim: Claim,
    step: int,
    path: Path,
    manifest: Mapping[str, Any],
    *,
    metrics: dict[str, float] | None,
    tensorboard: TensorBoardLog | None,
) -> str:
    """Upload and record the checkpoint of `step` saved under `path`; returns its id. The job's TensorBoard
    files follow, so what storage holds is never older than the newest checkpoint."""
    checkpoint_id = reporting.new_checkpoint_id()
    files: dict[str, dict[str, Any]] = {name: dict(meta) for name, meta in manifest["files"].items()}
    try:
        for name in files:
            upload(storage, path / name, checkpoint_key(claim.job_id, checkpoint_id, name))
        manifest_path = path / MANIFEST_NAME
        files[MANIFEST_NAME] = {"size": manifest_path.stat().st_size, "sha256": sha256(manifest_path)}
        upload(storage, manifest_path, checkpoint_key(claim.job_id, checkpoint_id, MANIFEST_NAME))
        reporting.record_checkpoint(claim, checkpoint_id=checkpoint_id, step=step, files=files, metrics=metrics)
    except BaseException:
        storage.delete(checkpoint_prefix(claim.job_id, checkpoint_id))
        raise
    if tensorboard is not None:
        for relative in tensorboard.files():
            upload(storage, tensorboard.root / relative, tensorboard_key(claim.job_id, relative.as_posix()))
    return checkpoint_id


def upload(storage: Storage, path: Path, key: str) -> None:
    with path.open("rb") as handle:
        storage.put_stream(key, iter(lambda: handle.read(CHUNK), b""))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
