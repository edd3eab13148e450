"""The primitive training API's state: sessions, training clients (a LoRA adapter on a resident base model),
sampling sessions, saved weights and the requests whose results are futures.

A request row is the future: the API writes it `pending`, the primitives worker that holds its target runs the
targets' requests in `seq_id` order and writes `result` (the response body, JSON or protobuf as `media`) or
`error`. Any API process answers `retrieve_future` from the row, so futures survive an API restart.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, Integer, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.kit.db import Base, UTCDateTime, utcnow


class PrimitiveSession(Base):
    """A client's session: its heartbeats keep its training clients resident; `closed_at` once finished or
    once its heartbeats stopped (the worker then frees the clients' adapters)."""

    __tablename__ = "primitive_sessions"
    __table_args__ = (Index("ix_primitive_sessions_tenant_id_id", "tenant_id", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    sdk_version: Mapped[str] = mapped_column(String(64))
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class TrainingClient(Base):
    """One LoRA adapter (and its AdamW state) on a base model held by one primitives worker (`worker`, set when
    the worker creates it). `last_seq_id` is the last call accepted: calls must come in increasing order."""

    __tablename__ = "training_clients"
    __table_args__ = (Index("ix_training_clients_tenant_id_id", "tenant_id", "id"),)

    id: Mapped[str] = mapped_column(String(80), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    session_id: Mapped[str] = mapped_column(ForeignKey("primitive_sessions.id", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    lora: Mapped[dict[str, Any]] = mapped_column(JSON)
    worker: Mapped[str | None] = mapped_column(String(128), nullable=True)
    last_seq_id: Mapped[int] = mapped_column(Integer, default=-1)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class SamplingSession(Base):
    """A sampler over a base model, or over saved sampler weights (`weights_id`)."""

    __tablename__ = "sampling_sessions"
    __table_args__ = (Index("ix_sampling_sessions_tenant_id_id", "tenant_id", "id"),)

    id: Mapped[str] = mapped_column(String(80), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    session_id: Mapped[str] = mapped_column(ForeignKey("primitive_sessions.id", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    weights_id: Mapped[str | None] = mapped_column(ForeignKey("primitive_weights.id"), nullable=True)
    worker: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class PrimitiveWeights(Base):
    """Weights a training client saved: `kind` "state" (adapter and optimizer, for load_weights) or "sampler"
    (adapter only). Addressed as tinker://<training client>/<weights|sampler_weights>/<name>; the files are in
    storage under `storage_path`."""

    __tablename__ = "primitive_weights"
    __table_args__ = (
        UniqueConstraint("training_client_id", "kind", "name"),
        Index("ix_primitive_weights_tenant_id_id", "tenant_id", "id"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    training_client_id: Mapped[str] = mapped_column(ForeignKey("training_clients.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(256))
    base_model: Mapped[str] = mapped_column(String(512))
    lora: Mapped[dict[str, Any]] = mapped_column(JSON)
    storage_path: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class PrimitiveRequest(Base):
    """One call and its future. `target_id` is the training client or sampling session that runs it;
    `status` pending -> running -> done | failed. `body` is the request as received (JSON or protobuf bytes);
    `result` the response body in `media` ("json" or "protobuf"); `error` {"error", "category"} as the SDK reads."""

    __tablename__ = "primitive_requests"
    __table_args__ = (
        # One request per call: a resent seq_id finds the first (the SDK retries).
        UniqueConstraint("target_id", "seq_id"),
        Index("ix_primitive_requests_target_id_status", "target_id", "status"),
        Index("ix_primitive_requests_tenant_id_id", "tenant_id", "id"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    target_id: Mapped[str] = mapped_column(String(80))
    operation: Mapped[str] = mapped_column(String(32))
    seq_id: Mapped[int] = mapped_column(Integer)
    body: Mapped[bytes] = mapped_column(LargeBinary)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    media: Mapped[str] = mapped_column(String(16), default="json")
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    worker: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class PrimitiveWorker(Base):
    """A live primitives worker: the base models it serves, with what clients need to know of each
    ({"tokenizer_id", "arch", "max_context_length", "vocab_size"}), and when it last said so. One silent past
    the stale limit is gone: its requests fail as retryable and its clients go to another worker
    (service.execution.primitives)."""

    __tablename__ = "primitive_workers"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    models: Mapped[dict[str, dict[str, Any]]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
