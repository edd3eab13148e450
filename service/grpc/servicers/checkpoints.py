"""CheckpointService: the same domain functions as /v1/checkpoints (service.checkpoints.service) and
/v1/jobs/{job_id}/checkpoints (service.jobs.service); ListCheckpoints by `tinker_path` is GET /v1/checkpoints.

DownloadCheckpoint is the gRPC twin of the per-file download with Range: each file is announced with its
manifest entry (path, size, sha256) and the offset it starts at, then streamed in chunks read from storage
off the event loop. The manifest is the allow-list, exactly as for REST.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import grpc
from sqlalchemy.orm import Session

from contract.gen.grpo.v1 import checkpoints_pb2, checkpoints_pb2_grpc, common_pb2
from service.checkpoints import retention, service
from service.checkpoints.download import iter_file
from service.checkpoints.models import Checkpoint
from service.checkpoints.schemas import checkpoint_out
from service.grpc.auth import current_tenant
from service.grpc.calls import in_session
from service.grpc.convert import checkpoint_to_proto
from service.jobs import service as jobs
from service.kit.errors import DomainError, NotFound, ValidationFailed
from service.storage import get_storage

Context = grpc.aio.ServicerContext[Any, Any]
DEFAULT_CHUNK = 1024 * 1024
MAX_CHUNK = 4 * 1024 * 1024


class OffsetOutOfRange(DomainError):
    code = "offset_out_of_range"
    http_status = 416
    grpc_status = grpc.StatusCode.OUT_OF_RANGE


@dataclass(frozen=True)
class _Planned:
    """One file to send: its manifest entry, storage key and starting offset."""

    path: str
    size: int
    sha256: str
    key: str
    offset: int


def _plan(session: Session, tenant_id: str, request: checkpoints_pb2.DownloadCheckpointRequest) -> list[_Planned]:
    checkpoint = service.get_checkpoint(session, tenant_id, request.checkpoint_id)
    wanted = list(request.paths) or [entry["path"] for entry in checkpoint.downloadable]
    listed = {entry["path"] for entry in checkpoint.downloadable}
    for path in request.offsets:
        if path not in listed:
            raise NotFound("checkpoint file", path)
    planned = []
    for path in wanted:
        entry = service.manifest_entry(checkpoint, path)  # NotFound for anything unlisted
        offset = request.offsets.get(path, 0)
        if not 0 <= offset <= entry["size"]:
            raise OffsetOutOfRange(
                f"offsets[{path!r}]: {offset} is outside the file's {entry['size']} bytes",
                details={"field": f"offsets[{path!r}]", "size": entry["size"]},
            )
        planned.append(_Planned(path, entry["size"], entry["sha256"], service.file_key(checkpoint, entry), offset))
    return planned


def _chunk_size(requested: int) -> int:
    if requested == 0:
        return DEFAULT_CHUNK
    if not 1 <= requested <= MAX_CHUNK:
        message = f"chunk_size: must be between 1 and {MAX_CHUNK} (0 = {DEFAULT_CHUNK})"
        raise ValidationFailed(message, details=[{"field": "chunk_size", "message": message}])
    return requested


def _chunks(handle: IO[bytes], start: int, length: int, size: int) -> Iterator[bytes]:
    """Storage bytes in pieces of at most `size` (iter_file's own pieces, re-cut)."""
    for piece in iter_file(handle, start, length):
        for i in range(0, len(piece), size):
            yield piece[i : i + size]


def _listed(session: Session, tenant_id: str, request: checkpoints_pb2.ListCheckpointsRequest) -> Sequence[Checkpoint]:
    """A job's checkpoints, or a tinker:// path's (exactly one of the two named)."""
    if request.tinker_path and request.job_id:
        message = "tinker_path: name a job_id or a tinker_path, not both"
        raise ValidationFailed(message, details=[{"field": "tinker_path", "message": message}])
    if request.tinker_path:
        return service.tinker_checkpoints(session, tenant_id, request.tinker_path)
    return jobs.list_job_checkpoints(session, tenant_id, request.job_id)


class CheckpointServicer(checkpoints_pb2_grpc.CheckpointServiceServicer):
    async def ListCheckpoints(
        self, request: checkpoints_pb2.ListCheckpointsRequest, context: Context
    ) -> checkpoints_pb2.ListCheckpointsResponse:
        tenant = current_tenant()
        rows = await in_session(lambda s: [checkpoint_out(c) for c in _listed(s, tenant.tenant_id, request)])
        return checkpoints_pb2.ListCheckpointsResponse(checkpoints=[checkpoint_to_proto(c) for c in rows])

    async def GetCheckpoint(
        self, request: checkpoints_pb2.GetCheckpointRequest, context: Context
    ) -> checkpoints_pb2.GetCheckpointResponse:
        tenant = current_tenant()
        row = await in_session(
            lambda s: checkpoint_out(service.get_checkpoint(s, tenant.tenant_id, request.checkpoint_id))
        )
        return checkpoints_pb2.GetCheckpointResponse(checkpoint=checkpoint_to_proto(row))

    async def DownloadCheckpoint(
        self, request: checkpoints_pb2.DownloadCheckpointRequest, context: Context
    ) -> AsyncIterator[checkpoints_pb2.DownloadCheckpointResponse]:
        tenant = current_tenant()
        chunk_size = _chunk_size(request.chunk_size)
        planned = await in_session(lambda s: _plan(s, tenant.tenant_id, request))
        storage = get_storage()
        for item in planned:
            info = common_pb2.FileInfo(path=item.path, size_bytes=item.size, sha256=item.sha256)
            yield checkpoints_pb2.DownloadCheckpointResponse(
                file=checkpoints_pb2.FileHeader(file=info, offset=item.offset)
            )
            if item.offset == item.size:
                continue
            try:
                handle = await asyncio.to_thread(storage.open, item.key)
            except FileNotFoundError as exc:
                raise NotFound("checkpoint file", item.path) from exc
            try:
                pin_id = await asyncio.to_thread(retention.pin, request.checkpoint_id)  # kept while it streams
                pieces = retention.pinned_while_streaming(
                    pin_id, _chunks(handle, item.offset, item.size - item.offset, chunk_size)
                )
                offset = item.offset
                while (data := await asyncio.to_thread(next, pieces, None)) is not None:
                    yield checkpoints_pb2.DownloadCheckpointResponse(
                        chunk=checkpoints_pb2.FileChunk(path=item.path, offset=offset, data=data)
                    )
                    offset += len(data)
            finally:
                await asyncio.to_thread(handle.close)
