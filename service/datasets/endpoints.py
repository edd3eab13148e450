"""Dataset routes (thin): parse, call the domain service, render."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from contract.api.datasets import DatasetList, DatasetOut
from service.datasets import service
from service.datasets.multipart import check_content_length, multipart_boundary, read_upload
from service.datasets.schemas import dataset_out
from service.kit.config import get_settings
from service.kit.deps import SessionDep
from service.kit.openapi import quota_responses
from service.kit.paging import RESOURCES, Limit
from service.kit.params import Cursor, PathId
from service.tenants.auth import CurrentTenant

router = APIRouter(tags=["datasets"])

_UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": 'JSONL: one object per line with "prompt" (a non-empty string or a '
                            'list of {"role", "content"} messages); other columns are passed to rewards.',
                        },
                        "name": {"type": "string", "maxLength": 256, "description": "Default: the filename."},
                    },
                }
            }
        },
    }
}


@router.post(
    "/datasets",
    status_code=201,
    response_model=DatasetOut,
    openapi_extra=_UPLOAD_BODY,
    responses={
        413: {"description": "Larger than the configured limit (`payload_too_large`)."},
        422: {"description": "Invalid lines (`dataset_invalid`, details: [{line, error}], first 20)."},
        **quota_responses(409),
    },
)
async def upload_dataset(request: Request, session: SessionDep, tenant: CurrentTenant) -> DatasetOut:
    """Upload a JSONL prompt dataset (multipart field `file`, optional `name`), validated while it streams."""
    check_content_length(request.headers.get("content-length"), get_settings().max_dataset_bytes)
    boundary = multipart_boundary(request.headers.get("content-type"))
    ingest = await run_in_threadpool(service.begin_upload)
    try:
        form = await read_upload(request.stream(), boundary, ingest)
        name = service.clean_name(form.name, form.filename)
        row = await run_in_threadpool(service.create_dataset, session, tenant.tenant_id, name, ingest)
    except BaseException:
        await run_in_threadpool(ingest.abort)
        raise
    return dataset_out(row)


@router.get("/datasets", response_model=DatasetList)
def list_datasets(
    session: SessionDep, tenant: CurrentTenant, limit: Limit = RESOURCES.default, after: Cursor = None
) -> DatasetList:
    """The tenant's datasets, newest first (cursor pagination)."""
    rows, has_more = service.list_datasets(session, tenant.tenant_id, limit=limit, after=after)
    return DatasetList(
        data=[dataset_out(r) for r in rows],
        has_more=has_more,
        next_after=rows[-1].id if has_more and rows else None,
    )


@router.get("/datasets/{dataset_id}", response_model=DatasetOut)
def get_dataset(dataset_id: PathId, session: SessionDep, tenant: CurrentTenant) -> DatasetOut:
    return dataset_out(service.get_dataset(session, tenant.tenant_id, dataset_id))


@router.delete(
    "/datasets/{dataset_id}",
    status_code=204,
    response_class=Response,
    responses={409: {"description": "Used by an unfinished job (`dataset_in_use`)."}},
)
def delete_dataset(
    dataset_id: PathId, request: Request, session: SessionDep, tenant: CurrentTenant
) -> Response:
    """Delete a dataset (refused while an unfinished job uses it)."""
    service.delete_dataset(session, tenant.tenant_id, dataset_id, in_use=dataset_in_use(request))
    return Response(status_code=204)


def dataset_in_use(request: Request) -> service.InUse:
    """The jobs' "is this dataset in use" check, which the app hands in at start (service.app.create_app sets
    `app.state.dataset_in_use`): datasets import nothing of the jobs that reference them. An app that did not
    set it fails the delete (AttributeError, a 500) rather than deleting a dataset a job may still need."""
    check: service.InUse = request.app.state.dataset_in_use
    return check
