"""Request/response models of the datasets API."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from service.datasets.models import Dataset


class DatasetOut(BaseModel):
    id: str = Field(examples=["ds_01J9Z3K2Q8XW5T7M4N6P8R0S2V"])
    name: str = Field(examples=["gsm8k-train"])
    num_rows: int = Field(description="Valid, non-blank lines.")
    bytes: int = Field(description="Size of the uploaded file.")
    sha256: str = Field(description="Hex sha256 of the uploaded bytes.")
    columns: list[str] = Field(description="Every column seen in any row, in first-seen order.")
    created_at: datetime

    @classmethod
    def from_row(cls, row: Dataset) -> DatasetOut:
        return cls(
            id=row.id,
            name=row.name,
            num_rows=row.num_rows,
            bytes=row.bytes,
            sha256=row.sha256,
            columns=list(row.columns),
            created_at=row.created_at,
        )


class DatasetList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DatasetOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next (older) page.")
