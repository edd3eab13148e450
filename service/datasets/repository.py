"""All SQL of the datasets domain. Soft-deleted rows are invisible here."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.datasets.models import Dataset


def get(session: Session, tenant_id: str, dataset_id: str, *, for_update: bool = False) -> Dataset | None:
    stmt = select(Dataset).where(
        Dataset.id == dataset_id, Dataset.tenant_id == tenant_id, Dataset.deleted_at.is_(None)
    )
    if for_update:
        stmt = stmt.with_for_update()
    return session.scalars(stmt).one_or_none()


def live(session: Session, tenant_id: str, ids: Sequence[str]) -> dict[str, Dataset]:
    """{id: row} of those of `ids` that are the tenant's."""
    if not ids:
        return {}
    stmt = select(Dataset).where(Dataset.tenant_id == tenant_id, Dataset.id.in_(ids), Dataset.deleted_at.is_(None))
    return {row.id: row for row in session.scalars(stmt)}


def list_page(session: Session, tenant_id: str, *, limit: int, after: str | None) -> Sequence[Dataset]:
    """Newest first; `after` is the last id of the previous page. Returns up to `limit` rows."""
    stmt = select(Dataset).where(Dataset.tenant_id == tenant_id, Dataset.deleted_at.is_(None))
    if after is not None:
        stmt = stmt.where(Dataset.id < after)
    return session.scalars(stmt.order_by(Dataset.id.desc()).limit(limit)).all()


def add(session: Session, dataset: Dataset) -> None:
    session.add(dataset)
    session.flush()


def stored_bytes(session: Session, tenant_id: str) -> int:
    """Bytes of the tenant's datasets that are not deleted: what the max_dataset_storage_bytes quota counts."""
    stored = session.scalar(
        select(func.coalesce(func.sum(Dataset.bytes), 0)).where(
            Dataset.tenant_id == tenant_id, Dataset.deleted_at.is_(None)
        )
    )
    return int(stored or 0)
