"""What the worker writes of an evaluation: its items, a batch at a time (in the fenced transaction that also
records the batch's progress and usage: service.execution.reporting.record_evaluation_batch)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, field_validator
from sqlalchemy import delete
from sqlalchemy.orm import Session

from contract.fields import storable_text
from service.evaluations.models import EvaluationItem
from service.kit.db import utcnow


class EvaluationItemIn(BaseModel):
    """One evaluated item as the worker reports it."""

    model_config = ConfigDict(extra="forbid")
    index: int
    prompt: str
    completions: list[str]
    rewards: list[float | None]
    sources: list[dict[str, float | None]]

    @field_validator("prompt")
    @classmethod
    def _storable(cls, value: str) -> str:
        return storable_text(value)  # PostgreSQL text holds no U+0000, which a model can generate

    @field_validator("completions")
    @classmethod
    def _storable_each(cls, values: list[str]) -> list[str]:
        return [storable_text(v) for v in values]

    @field_validator("rewards")
    @classmethod
    def _finite(cls, values: list[float | None]) -> list[float | None]:
        return [None if v is None or not math.isfinite(v) else v for v in values]

    @field_validator("sources")
    @classmethod
    def _finite_sources(cls, values: list[dict[str, float | None]]) -> list[dict[str, float | None]]:
        return [{k: None if v is None or not math.isfinite(v) else v for k, v in s.items()} for s in values]

    @property
    def score(self) -> float | None:
        scored = [v for v in self.rewards if v is not None]
        return sum(scored) / len(scored) if scored else None


def record_items(
    session: Session, evaluation_id: str, attempt: int, batch: int, items: Sequence[EvaluationItemIn]
) -> None:
    """Store a batch's items; a retried write (its commit reply lost) replaces the rows it wrote."""
    indices = [item.index for item in items]
    session.execute(
        delete(EvaluationItem).where(EvaluationItem.evaluation_id == evaluation_id,
                                     EvaluationItem.item_index.in_(indices))
    )
    now = utcnow()
    session.add_all(
        EvaluationItem(
            evaluation_id=evaluation_id, item_index=item.index, batch=batch, prompt=item.prompt,
            completions=item.completions, rewards=item.rewards, sources=item.sources, score=item.score,
            attempt=attempt, created_at=now,
        )
        for item in items
    )
    session.flush()
