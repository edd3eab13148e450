"""Tenants and their API keys.

Only a sha256 hash and a short lookup prefix of each key are stored: a leaked database does not
leak usable keys, and the prefix lets authentication find the candidate row without scanning.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from service.kit.db import Base, UTCDateTime, utcnow


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # First characters of the random part: an index to find the row, never enough to authenticate.
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    key_hash: Mapped[str] = mapped_column(String(64))  # hex sha256 of the whole key
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    name: Mapped[str] = mapped_column(String(128), server_default="")
    # Space-separated (service.tenants.scopes); keys made before scopes existed have all of them.
    scopes: Mapped[str] = mapped_column(String(64), server_default="read write admin")
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Written at most once a minute per key (service.tenants.lastused), not on every request.
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
