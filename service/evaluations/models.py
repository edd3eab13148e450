"""An evaluation and its per-item results.

An evaluation runs as a job of kind `evaluation` (service.jobs.models.Job, same id): the job row holds its
state, attempts, lease, events and usage; this row holds what only an evaluation has, the submitted spec and
the summary written when it ends. Items are written by the worker, fenced by the attempt, a batch at a time
with that batch's progress (service.execution.reporting.record_evaluation_batch): a later attempt continues
after the last batch recorded, so no item is written twice.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.kit.db import Base, BigIntId, UTCDateTime, utcnow


class Evaluation(Base):
    __tablename__ = "evaluations"
    __table_args__ = (Index("ix_evaluations_tenant_id_id", "tenant_id", "id"),)

    id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(512))
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), index=True)
    # The submitted EvaluationSpec as validated (model_dump(mode="json")).
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The job whose checkpoint of `source_step` this evaluates (its spec's eval_checkpoints); null otherwise.
    # No foreign key: the job may be deleted before its checkpoints' evaluations.
    source_job_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    source_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # service.evaluations.stats.Summary.as_dict(), written when the evaluation succeeds.
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class EvaluationItem(Base):
    """One dataset item: its k completions, their total rewards (null where every source abstained) and each
    source's values."""

    __tablename__ = "evaluation_items"
    __table_args__ = (UniqueConstraint("evaluation_id", "item_index"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    evaluation_id: Mapped[str] = mapped_column(ForeignKey("evaluations.id", ondelete="CASCADE"))
    item_index: Mapped[int] = mapped_column(Integer)  # the row's index in the dataset (0-based)
    batch: Mapped[int] = mapped_column(Integer)  # the progress step that recorded it
    prompt: Mapped[str] = mapped_column(Text)
    completions: Mapped[list[str]] = mapped_column(JSON)
    rewards: Mapped[list[float | None]] = mapped_column(JSON)
    # [{source name: value or null}] per completion
    sources: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    score: Mapped[float | None] = mapped_column(Float, nullable=True)  # mean reward of the item's samples
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
