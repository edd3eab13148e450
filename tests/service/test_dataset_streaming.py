"""Uploads stream: memory does not grow with the file, and an over-limit upload stops being read early.

The body is produced chunk by chunk by an async generator and sent through httpx's ASGI transport (which
forwards chunks as the app asks for them), so the app is in the same process and tracemalloc sees it all.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from service.kit.config import Settings
from tests.service.factories import TenantHeaders

BOUNDARY = "grpo-test-boundary"
MIB = 1024 * 1024
LINE = (json.dumps({"prompt": "p" * 200, "answer": "a"}) + "\n").encode()


class Body:
    """A multipart body of `total` file bytes, generated lazily; records how much the server pulled."""

    def __init__(self, total: int, chunk: int = 64 * 1024) -> None:
        # Whole lines only, so the file stays valid JSONL.
        self.total, self.chunk, self.sent = total - total % len(LINE), chunk, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        block = LINE * (self.chunk // len(LINE))
        while self.sent < self.total:
            # A fresh object per chunk (slicing bytes can return the same object, which would hide copies).
            piece = bytes(memoryview(block)[: self.total - self.sent])
            self.sent += len(piece)
            yield piece
        yield f"\r\n--{BOUNDARY}--\r\n".encode()


async def _post(app: FastAPI, headers: dict[str, str], body: Body) -> tuple[httpx.Response, int]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        tracemalloc.start()
        try:
            response = await client.post(
                "/v1/datasets",
                headers={**headers, "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
                content=body.__aiter__(),
            )
            _current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    return response, peak


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_over_limit_upload_is_413_without_reading_or_holding_the_file(
    app: FastAPI, tenant_a: TenantHeaders, settings: Settings
) -> None:
    settings.max_dataset_bytes = 2 * MIB
    body = Body(total=40 * MIB)
    response, peak = await _post(app, tenant_a, body)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "payload_too_large"
    # Reading stopped right after the limit (one batch of slack), not at the end of the 40 MiB body.
    assert body.sent < 4 * MIB, body.sent
    assert peak < 8 * MIB, peak


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_accepted_upload_memory_does_not_grow_with_file_size(
    app: FastAPI, tenant_a: TenantHeaders, settings: Settings
) -> None:
    body = Body(total=24 * MIB)
    response, peak = await _post(app, tenant_a, body)
    assert response.status_code == 201, response.text
    assert response.json()["bytes"] == body.sent
    assert response.json()["num_rows"] == body.sent // len(LINE)
    assert peak < 8 * MIB, peak
