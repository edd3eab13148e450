"""Response shapes of the datasets API."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field


class DatasetOut(BaseModel):
    id: str = Field(examples=["ds_01J9Z3K2Q8XW5T7M4N6P8R0S2V"])
    name: str = Field(examples=["gsm8k-train"])
    num_rows: int = Field(description="Valid, non-blank lines.")
    bytes: int = Field(description="Size of the uploaded file.")
    sha256: str = Field(description="Hex sha256 of the uploaded bytes.")
    columns: list[str] = Field(description="Every column seen in any row, in first-seen order.")
    created_at: datetime


class DatasetList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DatasetOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next (older) page.")
