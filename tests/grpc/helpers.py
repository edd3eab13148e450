"""Client-side helpers for the gRPC tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc

from contract.gen.grpo.v1 import datasets_pb2, datasets_pb2_grpc
from service.grpc.errors import ERROR_CODE_KEY, ERROR_DETAILS_KEY, ERROR_FIELD_KEY


def bearer(api_key: str) -> tuple[tuple[str, str], ...]:
    """Call metadata authenticating with `api_key`."""
    return (("authorization", f"Bearer {api_key}"),)


def trailer(error: grpc.aio.AioRpcError, key: str) -> str | None:
    for name, value in error.trailing_metadata() or ():
        if name == key:
            return str(value)
    return None


def error_code(error: grpc.aio.AioRpcError) -> str | None:
    return trailer(error, ERROR_CODE_KEY)


def error_field(error: grpc.aio.AioRpcError) -> str | None:
    return trailer(error, ERROR_FIELD_KEY)


def error_details(error: grpc.aio.AioRpcError) -> Any:
    raw = trailer(error, ERROR_DETAILS_KEY)
    return None if raw is None else json.loads(raw)


async def upload_requests(
    data: bytes, name: str = "prompts", chunk_size: int = 64 * 1024
) -> AsyncIterator[datasets_pb2.UploadDatasetRequest]:
    yield datasets_pb2.UploadDatasetRequest(metadata=datasets_pb2.UploadDatasetMetadata(name=name))
    for start in range(0, len(data), chunk_size):
        yield datasets_pb2.UploadDatasetRequest(chunk=data[start : start + chunk_size])


async def upload(
    channel: grpc.aio.Channel, api_key: str, data: bytes, name: str = "prompts", chunk_size: int = 64 * 1024
) -> datasets_pb2.Dataset:
    stub = datasets_pb2_grpc.DatasetServiceStub(channel)
    reply = await stub.UploadDataset(upload_requests(data, name, chunk_size), metadata=bearer(api_key))
    return reply.dataset


async def upload_ending_early(
    channel: grpc.aio.Channel, api_key: str, data: bytes
) -> tuple[grpc.StatusCode, str]:
    """The server's status for an upload it must end before the client's end of stream (a size limit).

    Sends the metadata and `data` as one chunk, then only waits. Any write that reaches a call the
    server has already ended makes grpc.aio replace the server's status with its own INTERNAL
    ("Internal error from Core"), so neither more chunks nor the end of stream are sent.
    """
    stub = datasets_pb2_grpc.DatasetServiceStub(channel)
    call = stub.UploadDataset(metadata=bearer(api_key))
    await call.write(
        datasets_pb2.UploadDatasetRequest(metadata=datasets_pb2.UploadDatasetMetadata(name="big"))
    )
    await call.write(datasets_pb2.UploadDatasetRequest(chunk=data))
    return await call.code(), await call.details() or ""
