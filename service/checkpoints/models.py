"""Checkpoints: those a job saved, and weights a training client of the Tinker API saved (`tinker_path` set,
`job_id` None: no job, no step, no metrics). The files live in storage under `storage_path`; the manifest lists them.

Only manifest-listed paths can ever be downloaded, so the manifest is the allow-list for file access. Retention,
resume and job deletion select a job's checkpoints by `job_id`, so they never touch the Tinker API's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.kit.db import Base, UTCDateTime, utcnow

# The engine's sharded state (worker.grpo.distributed.SHARDED_DIR): resume-only, never downloaded.
RESUME_ONLY_DIR = "distributed/"


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("job_id", "step"),
        Index("ix_checkpoints_tenant_id_id", "tenant_id", "id"),
        Index("ix_checkpoints_tenant_id_tinker_path", "tenant_id", "tinker_path"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    # Denormalised from the job so tenant-scoped lookups are one indexed read.
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    # None for weights saved through the Tinker API (then `tinker_path` says which).
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), nullable=True)
    # tinker://<training client>/<weights|sampler_weights>/<name> the weights were saved as; None for a job's.
    # Saving under the same name again adds another checkpoint: the path then loads the newest.
    tinker_path: Mapped[str | None] = mapped_column(String(512), nullable=True)
    step: Mapped[int] = mapped_column(Integer)  # 0 for the Tinker API's
    storage_path: Mapped[str] = mapped_column(String(512))
    # [{"path": "adapter_model.safetensors", "size": 123, "sha256": "..."}], paths relative to storage_path.
    manifest: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    @property
    def downloadable(self) -> list[dict[str, Any]]:
        """The files a tenant sees and downloads: all but the sharded training state of a multi-device job
        (`distributed/`, read back only when the job resumes; the weights beside it are consolidated)."""
        return [entry for entry in self.manifest if not entry["path"].startswith(RESUME_ONLY_DIR)]


class CheckpointPin(Base):
    """One download in progress: retention and job deletion leave the checkpoint alone while a live pin exists.

    Each download adds its own row, renews `expires_at` while it streams and deletes the row when it ends; a
    row left by a crashed API process simply expires.
    """

    __tablename__ = "checkpoint_pins"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True)
    checkpoint_id: Mapped[str] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
