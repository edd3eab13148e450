"""The datasets API's responses (shapes in contract.api.datasets) built from rows."""

from __future__ import annotations

from contract.api.datasets import DatasetOut
from service.datasets.models import Dataset


def dataset_out(row: Dataset) -> DatasetOut:
    return DatasetOut(
        id=row.id,
        name=row.name,
        num_rows=row.num_rows,
        bytes=row.bytes,
        sha256=row.sha256,
        columns=list(row.columns),
        created_at=row.created_at,
    )
