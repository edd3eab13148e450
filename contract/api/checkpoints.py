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
    job_id: str | None = Field(
        description="The job that saved it; null for weights saved through the Tinker API (see `tinker_path`)."
    )
    tinker_path: str | None = Field(
        None,
        description="For weights saved through the Tinker API: the tinker:// path they were saved as "
        "(`tinker://<model_id>/weights/<name>`: adapter and optimizer state, or `.../sampler_weights/<name>`: the "
        "adapter). Null for a job's checkpoint.",
        examples=["tinker://ses_01JDX3V8Q4M2C6T9W1R5Y7Z0AB:train:0/weights/step-10"],
    )
    step: int = Field(description="The job's optimiser step it was saved at; 0 for the Tinker API's.")
    files: list[CheckpointFile]
    total_bytes: int
    metrics: dict[str, float | None] = Field(description="The job's metrics at this step (none for the Tinker API's).")
    created_at: datetime


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointOut] = Field(description="Oldest first (a job's by step, a tinker:// path's by time).")
