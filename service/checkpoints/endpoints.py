"""Routes (thin): parse, call the domain service, render. A job's list of checkpoints is a jobs route; the
checkpoints of a tinker:// path (weights saved through the Tinker API) are listed here."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Header, Query
from fastapi.responses import JSONResponse, Response, StreamingResponse

from contract.api.checkpoints import CheckpointList, CheckpointOut
from contract.fields import Text
from service.checkpoints import retention, service
from service.checkpoints.download import (
    RangeNotSatisfiable,
    TarMember,
    archive_name,
    iter_file,
    iter_tar,
    parse_range,
    tar_plan,
)
from service.checkpoints.schemas import checkpoint_out
from service.kit.deps import SessionDep
from service.kit.errors import NotFound
from service.kit.openapi import error_responses
from service.kit.params import PathId
from service.storage import get_storage
from service.tenants.auth import CurrentTenant

router = APIRouter(tags=["checkpoints"])

_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


@router.get(
    "/checkpoints",
    response_model=CheckpointList,
    summary="The checkpoints of weights saved through the Tinker API as a tinker:// path",
    responses=error_responses(401),
)
def list_tinker_checkpoints(
    tinker_path: Annotated[
        Text,
        Query(
            max_length=512,
            description="`tinker://<model_id>/weights/<name>` or `tinker://<model_id>/sampler_weights/<name>`. "
            "Each save under that path is a checkpoint, oldest first: the last is what the path loads now. "
            "Another tenant's path lists nothing, like an unknown one.",
        ),
    ],
    tenant: CurrentTenant,
    session: SessionDep,
) -> CheckpointList:
    return CheckpointList(
        data=[checkpoint_out(row) for row in service.tinker_checkpoints(session, tenant.tenant_id, tinker_path)]
    )


@router.get(
    "/checkpoints/{checkpoint_id}",
    response_model=CheckpointOut,
    summary="Get a checkpoint: step, files (size, sha256), metrics at that step",
    responses=error_responses(401, 404),
)
def get_checkpoint(checkpoint_id: PathId, tenant: CurrentTenant, session: SessionDep) -> CheckpointOut:
    return checkpoint_out(service.get_checkpoint(session, tenant.tenant_id, checkpoint_id))


@router.get(
    "/checkpoints/{checkpoint_id}/files/{path:path}",
    summary="Download one file of a checkpoint (HTTP Range supported)",
    response_class=StreamingResponse,
    responses={
        200: {"description": "The whole file. `ETag` is its quoted sha256.", "content": _BINARY},
        206: {"description": "The requested single byte range (`Content-Range`).", "content": _BINARY},
        304: {"description": "`If-None-Match` matched the ETag."},
        **error_responses(401, 404, 416),
    },
)
def download_file(
    checkpoint_id: PathId,
    path: PathId,
    tenant: CurrentTenant,
    session: SessionDep,
    range_header: Annotated[
        str | None, Header(alias="Range", description="One range: `bytes=0-1023`.")
    ] = None,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match")] = None,
    if_range: Annotated[str | None, Header(alias="If-Range")] = None,
) -> Response:
    """Only files listed in the checkpoint's manifest can be downloaded; any other path is a 404."""
    checkpoint = service.get_checkpoint(session, tenant.tenant_id, checkpoint_id)
    entry = service.manifest_entry(checkpoint, path)
    size: int = entry["size"]
    etag = f'"{entry["sha256"]}"'
    headers = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        "Content-Disposition": _attachment(path.rsplit("/", 1)[-1]),
    }
    if if_none_match is not None and etag in {tag.strip() for tag in if_none_match.split(",")} | {"*"}:
        return Response(status_code=304, headers=headers)
    if if_range is not None and if_range.strip() != etag:
        range_header = None  # the client's copy is outdated: send the whole file
    try:
        byte_range = parse_range(range_header, size)
    except RangeNotSatisfiable as exc:
        return JSONResponse(
            exc.to_body(), status_code=exc.http_status, headers={"Content-Range": f"bytes */{size}"}
        )
    try:
        handle = get_storage().open(service.file_key(checkpoint, entry))
    except FileNotFoundError as exc:
        raise NotFound("checkpoint file", path) from exc
    pin_id = retention.pin(checkpoint.id)  # retention and deletion keep it while the download streams
    if byte_range is None:
        headers["Content-Length"] = str(size)
        return StreamingResponse(
            retention.pinned_while_streaming(pin_id, iter_file(handle, 0, size)),
            media_type="application/octet-stream",
            headers=headers,
        )
    headers["Content-Length"] = str(byte_range.length)
    headers["Content-Range"] = byte_range.content_range(size)
    return StreamingResponse(
        retention.pinned_while_streaming(pin_id, iter_file(handle, byte_range.start, byte_range.length)),
        status_code=206,
        media_type="application/octet-stream",
        headers=headers,
    )


@router.get(
    "/checkpoints/{checkpoint_id}/archive",
    summary="Download a whole checkpoint as a tar archive (streamed)",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "A POSIX (pax) tar with every manifest file under `<checkpoint_id>/`.",
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
        },
        **error_responses(401, 404),
    },
)
def download_archive(checkpoint_id: PathId, tenant: CurrentTenant, session: SessionDep) -> StreamingResponse:
    checkpoint = service.get_checkpoint(session, tenant.tenant_id, checkpoint_id)
    pin_id = retention.pin(checkpoint.id)
    members = [
        TarMember(
            name=f"{checkpoint.id}/{entry['path']}",
            key=service.file_key(checkpoint, entry),
            size=entry["size"],
        )
        for entry in checkpoint.downloadable
    ]
    headers, total = tar_plan(members, checkpoint.created_at.timestamp())
    return StreamingResponse(
        retention.pinned_while_streaming(pin_id, iter_tar(get_storage(), members, headers, total)),
        media_type="application/x-tar",
        headers={
            "Content-Length": str(total),
            "Content-Disposition": _attachment(archive_name(checkpoint.id)),
        },
    )


def _attachment(filename: str) -> str:
    return f"attachment; filename*=UTF-8''{quote(filename)}"
