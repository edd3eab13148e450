"""Checkpoint retention (`save_total_limit`) and download pins.

After each recorded checkpoint a job keeps its newest `save_total_limit` checkpoints plus the best one by
`metric_for_best_model` when that is set (TRL's rule). The newest is the job's resume point (what a resumed
attempt downloads), so it is always kept. Never deleted either, whatever the limit:

- a checkpoint another unfinished job names as its base model (`checkpoint:<id>`; the jobs domain answers which,
  `UsedAsBaseModel`);
- a checkpoint being downloaded: each download pins it (a `CheckpointPin` row, renewed while it streams and
  removed when it ends).

A checkpoint kept for one of these reasons is pruned by a later pass once the reason is gone. Rows are
deleted in the caller's transaction; the files only after it commits, so a rollback loses nothing (a crash in
between leaves unreferenced files under the job's prefix, removed with the job).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from functools import partial

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from contract.config import GRPOConfig
from service.checkpoints.models import Checkpoint, CheckpointPin
from service.kit.db import on_commit, session_scope, utcnow
from service.storage import Storage, job_prefix

log = logging.getLogger(__name__)

PIN_SECONDS = 300  # a download's pin; renewed every PIN_RENEW_SECONDS while it streams
PIN_RENEW_SECONDS = 60

# Those of the given checkpoint ids that an unfinished job uses as its base model
# (service.jobs.repository.base_model_uses, bound to the session).
UsedAsBaseModel = Callable[[Sequence[str]], set[str]]


def checkpoints_to_prune(
    checkpoints: Sequence[Checkpoint],
    limit: int | None,
    *,
    best_metric: str | None = None,
    greater_is_better: bool | None = None,
    protected: frozenset[str] = frozenset(),
) -> list[Checkpoint]:
    """Those of `checkpoints` (one job's) beyond the newest `limit`, the best by `best_metric` and `protected`."""
    if limit is None:
        return []
    newest = sorted(checkpoints, key=lambda c: c.step, reverse=True)
    keep = {c.id for c in newest[:limit]} | protected
    best = best_checkpoint(checkpoints, best_metric, greater_is_better)
    if best is not None:
        keep.add(best.id)
    return [c for c in newest[limit:] if c.id not in keep]


def best_checkpoint(
    checkpoints: Sequence[Checkpoint], metric: str | None, greater_is_better: bool | None
) -> Checkpoint | None:
    """The checkpoint with the best finite value of `metric` (the newest on ties); None if none has one."""
    if metric is None:
        return None
    higher = greater_is_better if greater_is_better is not None else not metric.endswith("loss")
    scored = [
        (float(value), c.step, c)
        for c in checkpoints
        if isinstance(value := c.metrics.get(metric), int | float) and math.isfinite(value)
    ]
    if not scored:
        return None
    sign = 1.0 if higher else -1.0
    return max(scored, key=lambda entry: (sign * entry[0], entry[1]))[2]


def apply_retention(
    session: Session, storage: Storage, job_id: str, hyper: GRPOConfig, used_as_base_model: UsedAsBaseModel
) -> list[Checkpoint]:
    """Delete the checkpoints of the job that retention (its `hyper`parameters) no longer keeps (files after
    commit); returns them."""
    if hyper.save_total_limit is None:
        return []
    checkpoints = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).all()
    pruned = checkpoints_to_prune(
        checkpoints,
        hyper.save_total_limit,
        best_metric=hyper.metric_for_best_model,
        greater_is_better=hyper.greater_is_better,
        protected=_in_use(session, checkpoints, used_as_base_model),
    )
    if not pruned:
        return []
    session.execute(delete(Checkpoint).where(Checkpoint.id.in_([c.id for c in pruned])))
    for checkpoint in pruned:
        on_commit(session, partial(_delete_files, storage, checkpoint.storage_path))
    return list(pruned)


def _in_use(
    session: Session, checkpoints: Sequence[Checkpoint], used_as_base_model: UsedAsBaseModel
) -> frozenset[str]:
    protected = pinned(session, [c.id for c in checkpoints])
    protected |= used_as_base_model([c.id for c in checkpoints])
    return frozenset(protected)


def _delete_files(storage: Storage, prefix: str) -> None:
    try:
        storage.delete(prefix)
    except Exception:
        log.warning("could not delete checkpoint files under %s", prefix, exc_info=True)


def delete_unrecorded(session: Session, storage: Storage, job_id: str) -> list[str]:
    """Delete the job's checkpoint directories in storage that no row records; returns their ids.

    Left by an attempt that died between upload and record, or whose checkpoints a newer attempt discarded
    on its claim (steps after the resume point). Run by the owning attempt before it uploads anything.
    """
    recorded = set(session.scalars(select(Checkpoint.id).where(Checkpoint.job_id == job_id)))
    prefix = job_prefix(job_id)
    stray = sorted(
        {key.split("/")[2] for key in storage.list(prefix) if key.split("/")[2].startswith("ckpt_")} - recorded
    )
    for checkpoint_id in stray:
        storage.delete(f"{prefix}/{checkpoint_id}")
    return stray


# --- download pins --------------------------------------------------------------------------------


def pin(checkpoint_id: str) -> int:
    """Protect a checkpoint from retention and deletion for PIN_SECONDS as a download starts; the pin's id.

    Committed at once, in its own transaction, so the pin holds before the first byte goes out.
    """
    with session_scope() as session:
        row = CheckpointPin(checkpoint_id=checkpoint_id, expires_at=utcnow() + timedelta(seconds=PIN_SECONDS))
        session.add(row)
        session.flush()
        return row.id


def pinned(session: Session, checkpoint_ids: Sequence[str]) -> set[str]:
    """Those of `checkpoint_ids` that a download in progress holds."""
    if not checkpoint_ids:
        return set()
    rows = session.scalars(
        select(CheckpointPin.checkpoint_id).where(
            CheckpointPin.checkpoint_id.in_(checkpoint_ids), CheckpointPin.expires_at > utcnow()
        )
    )
    return set(rows)


def pinned_while_streaming(pin_id: int, chunks: Iterator[bytes]) -> Iterator[bytes]:
    """`chunks`, renewing the pin every PIN_RENEW_SECONDS; the pin is removed when the stream ends or stops."""
    renewed = time.monotonic()
    try:
        for chunk in chunks:
            if time.monotonic() - renewed >= PIN_RENEW_SECONDS:
                _write_pin(pin_id, renew=True)
                renewed = time.monotonic()
            yield chunk
    finally:
        _write_pin(pin_id, renew=False)


def _write_pin(pin_id: int, *, renew: bool) -> None:
    try:
        with session_scope() as session:
            if renew:
                session.execute(
                    update(CheckpointPin)
                    .where(CheckpointPin.id == pin_id)
                    .values(expires_at=utcnow() + timedelta(seconds=PIN_SECONDS))
                )
            else:
                session.execute(delete(CheckpointPin).where(CheckpointPin.id == pin_id))
    except Exception:  # the pin then expires by itself
        log.warning("could not %s download pin %d", "renew" if renew else "remove", pin_id, exc_info=True)
