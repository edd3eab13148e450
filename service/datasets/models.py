"""Uploaded JSONL datasets. The bytes live in storage at `datasets/<id>.jsonl`; the row holds metadata."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from service.kit.db import Base, UTCDateTime, utcnow


class Dataset(Base):
    """Rows are soft-deleted (`deleted_at`) so jobs that referenced a dataset keep a valid foreign key."""

    __tablename__ = "datasets"
    __table_args__ = (Index("ix_datasets_tenant_id_id", "tenant_id", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(256))
    num_rows: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    columns: Mapped[list[Any]] = mapped_column(JSON)
    storage_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
