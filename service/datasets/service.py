"""Datasets: upload (streamed validation into storage), list, get, delete.

Transport-free: REST and gRPC both call these with a Session and the caller's tenant id.
Deletion is soft (the row stays for jobs that referenced it); the blob is removed once the delete commits.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from sqlalchemy.orm import Session

from contract.dataset_format import parse_row, prompt_column
from contract.graders import Grader, MissingField, item_references, missing_item_field
from service.datasets import repository
from service.datasets.errors import DatasetInUse
from service.datasets.ingest import DatasetIngest
from service.datasets.models import Dataset
from service.kit.config import get_settings
from service.kit.db import on_commit, utcnow
from service.kit.errors import NotFound, ValidationFailed
from service.kit.ids import new_id
from service.kit.paging import page
from service.quotas import service as quotas
from service.storage import get_storage

MAX_NAME_LEN = 256

# "Does an unfinished job train or evaluate on this dataset?" (session, tenant id, dataset id). The jobs
# domain answers it (service.jobs.service.dataset_in_use); callers hand it in, so datasets never import the
# jobs that reference them (jobs import datasets: the live rows a spec names, the first-row check).
InUse = Callable[[Session, str, str], bool]
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def begin_upload() -> DatasetIngest:
    """A fresh dataset id and an ingest writing to its storage key, with the configured size limit."""
    return DatasetIngest(get_storage(), new_id("ds"), get_settings().max_dataset_bytes)


def clean_name(name: str | None, fallback: str | None) -> str:
    """The dataset's display name: the given name, else the uploaded filename, else "dataset"."""
    value = (name if name is not None else (fallback or "dataset")).strip()
    if not value or len(value) > MAX_NAME_LEN or _CONTROL.search(value):
        raise ValidationFailed(
            f"name must be 1-{MAX_NAME_LEN} printable characters",
            details=[{"field": "name", "message": "invalid dataset name"}],
        )
    return value


def create_dataset(session: Session, tenant_id: str, name: str, ingest: DatasetIngest) -> Dataset:
    """Finish the upload (raises DatasetInvalid, removing the blob) and record the dataset. Past the tenant's
    storage quota: QuotaExceeded, before the blob is committed (the caller aborts the ingest)."""
    quotas.check_dataset_storage(session, tenant_id, ingest.bytes_received, repository.stored_bytes)
    result = ingest.finish()
    row = Dataset(
        id=ingest.dataset_id,
        tenant_id=tenant_id,
        name=name,
        num_rows=result.num_rows,
        bytes=result.bytes,
        sha256=result.sha256,
        columns=result.columns,
        storage_key=result.storage_key,
    )
    repository.add(session, row)
    return row


def get_dataset(session: Session, tenant_id: str, dataset_id: str) -> Dataset:
    row = repository.get(session, tenant_id, dataset_id)
    if row is None:
        raise NotFound("dataset", dataset_id)
    return row


def live_datasets(session: Session, tenant_id: str, ids: Sequence[str]) -> dict[str, Dataset]:
    """{id: row} of those of `ids` that are the tenant's and not deleted (what a job may name)."""
    return repository.live(session, tenant_id, ids)


def first_row_missing(dataset: Dataset, grader: Grader) -> tuple[int, MissingField] | None:
    """(1-based line, what is missing) of the first row of `dataset` without a field the grader reads as
    ``{{item.*}}``.

    One streamed pass over the stored file (datasets are bounded by the upload limit); rows are read the way the
    worker reads them (the prompt column is not part of the item)."""
    if not item_references(grader):
        return None
    with get_storage().open(dataset.storage_key) as handle:
        for line, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            parsed, _ = parse_row(raw)
            if parsed is None:
                continue  # the upload validated every line
            parsed.pop(prompt_column(parsed) or "prompt", None)
            missing = missing_item_field(grader, parsed)
            if missing is not None:
                return line, missing
    return None


def list_datasets(
    session: Session, tenant_id: str, *, limit: int, after: str | None
) -> tuple[Sequence[Dataset], bool]:
    """A page, newest first, and whether more follow."""
    rows = repository.list_page(session, tenant_id, limit=limit + 1, after=after)
    return page(rows, limit)


def delete_dataset(session: Session, tenant_id: str, dataset_id: str, *, in_use: InUse) -> None:
    """Soft-delete; 409 while an unfinished job uses it (`in_use`). The blob goes once the transaction
    commits."""
    row = repository.get(session, tenant_id, dataset_id, for_update=True)
    if row is None:
        raise NotFound("dataset", dataset_id)
    if in_use(session, tenant_id, dataset_id):
        raise DatasetInUse(
            f"dataset {dataset_id!r} is used by an unfinished job; cancel it or wait for it to finish",
            details={"dataset_id": dataset_id},
        )
    row.deleted_at = utcnow()
    session.flush()
    storage, key = get_storage(), row.storage_key
    on_commit(session, lambda: storage.delete(key))
