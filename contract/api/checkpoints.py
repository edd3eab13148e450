"""Response shapes of the checkpoints API."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field


class CheckpointFile(BaseModel):
    path: str = Field(
        description="Relative path inside the checkpoint.", examples=["adapter_model.safetensors"]
    )
    size: int = Field(description="Bytes.")
    sha256: str = Field(description="Hex sha256 of the file; also its download ETag.")


class CheckpointOut(BaseModel):
    object: Literal["checkpoint"] = "checkpoint"
    id: str = Field(examples=["ckpt_01JDX3V8Q4M2C6T9W1R5Y7Z0AB"])
    job_id: str
    step: int
    files: list[CheckpointFile]
    total_bytes: int
    metrics: dict[str, float | None] = Field(description="The job's metrics at this step.")
    created_at: datetime


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointOut] = Field(description="Oldest first (by step).")
