"""Checkpoints: recording, listing, single-file downloads (Range, ETag, traversal), streamed tar archives."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import tarfile
import tracemalloc
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.checkpoints.download import TarMember, iter_tar, parse_range, tar_plan
from service.checkpoints.models import Checkpoint
from service.checkpoints.service import new_checkpoint_id
from service.jobs.progress import record_checkpoint
from service.kit.db import session_scope
from service.kit.errors import Conflict, ValidationFailed
from service.storage import Storage, checkpoint_key, get_storage
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import job_spec, make_dataset, put_checkpoint, start_job

WEIGHTS = bytes(range(256)) * 1000  # 256 000 bytes, every offset distinguishable
FILES = {
    "adapter_model.safetensors": WEIGHTS,
    "adapter_config.json": b'{"r": 16}',
    "tokenizer/tokenizer.json": b'{"vocab": {}}',
}


@pytest.fixture
def job_with_checkpoint(
    client: TestClient, tenant_a: TenantHeaders
) -> tuple[str, Checkpoint, dict[str, Any]]:
    response = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=tenant_a)
    job_id = response.json()["id"]
    attempt = start_job(job_id)
    from service.jobs import progress

    with session_scope() as session:
        progress.record_metrics(session, job_id, attempt, 5, {"loss": 0.5, "reward": 0.7})
    checkpoint, manifest = put_checkpoint(get_storage(), job_id, attempt, 5, FILES)
    return job_id, checkpoint, manifest


def file_url(checkpoint: Checkpoint, path: str) -> str:
    return f"/v1/checkpoints/{checkpoint.id}/files/{path}"


class TestRecordAndRead:
    def test_get_and_list(
        self, client: TestClient, tenant_a: TenantHeaders, job_with_checkpoint: Any
    ) -> None:
        job_id, checkpoint, manifest = job_with_checkpoint
        body = client.get(f"/v1/checkpoints/{checkpoint.id}", headers=tenant_a).json()
        assert body["job_id"] == job_id and body["step"] == 5
        assert body["metrics"] == {"loss": 0.5, "reward": 0.7}
        assert {f["path"]: {"size": f["size"], "sha256": f["sha256"]} for f in body["files"]} == manifest
        assert body["total_bytes"] == sum(len(c) for c in FILES.values())
        listed = client.get(f"/v1/jobs/{job_id}/checkpoints", headers=tenant_a).json()["data"]
        assert [c["id"] for c in listed] == [checkpoint.id]
        job = client.get(f"/v1/jobs/{job_id}", headers=tenant_a).json()
        assert job["resume_checkpoint_id"] == checkpoint.id
        events = client.get(f"/v1/jobs/{job_id}/events", params={"types": "checkpoint"}, headers=tenant_a)
        assert events.json()["data"][0]["data"]["checkpoint_id"] == checkpoint.id

    def test_manifest_must_match_storage_and_be_safe(
        self, client: TestClient, tenant_a: TenantHeaders, job_with_checkpoint: Any
    ) -> None:
        job_id, checkpoint, _ = job_with_checkpoint
        storage = get_storage()
        ckpt_id = new_checkpoint_id()
        storage.put_stream(checkpoint_key(job_id, ckpt_id, "a.bin"), [b"abc"])
        good = {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}
        bad_manifests: list[dict[str, Any]] = [
            {"../escape": good},
            {"a.bin": {**good, "size": 4}},
            {"a.bin": {**good, "sha256": "xyz"}},
            {"missing.bin": good},
            {},
        ]
        for files in bad_manifests:
            with pytest.raises(ValidationFailed), session_scope() as session:
                record_checkpoint(session, storage, job_id, 1, checkpoint_id=ckpt_id, step=9, files=files)
        with pytest.raises(Conflict), session_scope() as session:  # one checkpoint per step
            record_checkpoint(
                session, storage, job_id, 1, checkpoint_id=ckpt_id, step=5, files={"a.bin": good}
            )


class TestFileDownload:
    def test_whole_file_with_etag(
        self, client: TestClient, tenant_a: TenantHeaders, job_with_checkpoint: Any
    ) -> None:
        _, checkpoint, manifest = job_with_checkpoint
        response = client.get(file_url(checkpoint, "adapter_model.safetensors"), headers=tenant_a)
        assert response.status_code == 200
        assert response.content == WEIGHTS
        assert response.headers["etag"] == f'"{manifest["adapter_model.safetensors"]["sha256"]}"'
        assert response.headers["accept-ranges"] == "bytes"
        assert int(response.headers["content-length"]) == len(WEIGHTS)
        nested = client.get(file_url(checkpoint, "tokenizer/tokenizer.json"), headers=tenant_a)
        assert nested.content == FILES["tokenizer/tokenizer.json"]
        cached = client.get(
            file_url(checkpoint, "adapter_model.safetensors"),
            headers={**tenant_a, "If-None-Match": response.headers["etag"]},
        )
        assert cached.status_code == 304 and cached.content == b""

    @pytest.mark.parametrize(
        ("header", "start", "end"),
        [
            ("bytes=0-0", 0, 0),
            ("bytes=1000-1999", 1000, 1999),
            ("bytes=255990-", 255990, 255999),
            ("bytes=-10", 255990, 255999),
            ("bytes=255000-999999", 255000, 255999),
        ],
    )
    def test_range_returns_exactly_those_bytes(
        self,
        client: TestClient,
        tenant_a: TenantHeaders,
        job_with_checkpoint: Any,
        header: str,
        start: int,
        end: int,
    ) -> None:
        _, checkpoint, _ = job_with_checkpoint
        response = client.get(
            file_url(checkpoint, "adapter_model.safetensors"), headers={**tenant_a, "Range": header}
        )
        assert response.status_code == 206
        assert response.content == WEIGHTS[start : end + 1]
        assert response.headers["content-range"] == f"bytes {start}-{end}/{len(WEIGHTS)}"
        assert int(response.headers["content-length"]) == end - start + 1

    @pytest.mark.parametrize(
        "header", ["bytes=256000-", "bytes=999999-1000000", "bytes=-0", "bytes=9999999999999999999-"]
    )
    def test_unsatisfiable_range_is_416(
        self, client: TestClient, tenant_a: TenantHeaders, job_with_checkpoint: Any, header: str
    ) -> None:
        _, checkpoint, _ = job_with_checkpoint
        response = client.get(
            file_url(checkpoint, "adapter_model.safetensors"), headers={**tenant_a, "Range": header}
        )
        assert response.status_code == 416
        assert response.headers["content-range"] == f"bytes */{len(WEIGHTS)}"
        assert response.json()["error"]["code"] == "range_not_satisfiable"

    @pytest.mark.parametrize(
        "header",
        [
            "bytes=5-2",
            "items=0-1",
            "bytes=0-1,5-6",
            "bytes=abc",
            "bytes=-",
            # A digit that str.isdigit accepts and int() refuses (superscript two; sent as latin-1).
            "bytes=\u00b2-",
            "bytes=0-\u00b2",
            "bytes=-\u00b2",
            # Longer than 19 digits, 5000 of them: past what int() parses by default.
            "bytes=" + "1" * 5000 + "-",
            "bytes=0-" + "9" * 5000,
            "bytes=-" + "9" * 5000,
            "bytes=" + "0" * 20 + "-",
        ],
    )
    def test_unusable_range_header_is_ignored(
        self, client: TestClient, tenant_a: TenantHeaders, job_with_checkpoint: Any, header: str
    ) -> None:
        _, checkpoint, _ = job_with_checkpoint
        # Bytes on the wire, as the server decodes them (latin-1): httpx would refuse a non-ASCII str.
        headers: dict[str, Any] = {**tenant_a, "Range": header.encode("latin-1")}
        response = client.get(file_url(checkpoint, "adapter_model.safetensors"), headers=headers)
        assert response.status_code == 200 and response.content == WEIGHTS

    def test_stale_if_range_sends_the_whole_file(
        self, client: TestClient, tenant_a: TenantHeaders, job_with_checkpoint: Any
    ) -> None:
        _, checkpoint, _ = job_with_checkpoint
        response = client.get(
            file_url(checkpoint, "adapter_model.safetensors"),
            headers={**tenant_a, "Range": "bytes=0-9", "If-Range": '"0000"'},
        )
        assert response.status_code == 200 and len(response.content) == len(WEIGHTS)

    @pytest.mark.parametrize(
        "path",
        [
            "%2e%2e%2f%2e%2e%2f%2e%2e%2fgrpo.db",
            "..%2F..%2F..%2Fgrpo.db",
            "tokenizer/%2e%2e/adapter_config.json",
            "%2Fetc%2Fpasswd",
            "manifest.json",
            "adapter_model.safetensors.partial",
            "tokenizer",
            "ADAPTER_CONFIG.JSON",
        ],
    )
    def test_traversal_and_unlisted_names_are_404(
        self, client: TestClient, tenant_a: TenantHeaders, job_with_checkpoint: Any, path: str
    ) -> None:
        _, checkpoint, _ = job_with_checkpoint
        # A real file next to the checkpoint that traversal would reach:
        get_storage().put_stream(f"checkpoints/{checkpoint.job_id}/secret.txt", [b"secret"])
        response = client.get(file_url(checkpoint, path), headers=tenant_a)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
        assert b"secret" not in response.content

    def test_dot_segments_in_the_raw_path_are_404(
        self, client: TestClient, tenant_a: TenantHeaders, job_with_checkpoint: Any
    ) -> None:
        # HTTP clients normalise "../" away before sending; hand the raw path to the ASGI app instead.
        _, checkpoint, _ = job_with_checkpoint
        get_storage().put_stream(f"checkpoints/{checkpoint.job_id}/secret.txt", [b"secret"])
        path = f"/v1/checkpoints/{checkpoint.id}/files/../secret.txt"
        status, body = asyncio.run(raw_asgi_get(client.app, path, dict(tenant_a)))
        assert status == 404 and b"secret" not in body.replace(b"secret.txt", b"")


async def raw_asgi_get(app: Any, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


class TestParseRange:
    """The header parser alone, on characters an HTTP client would not send (non-latin-1 digits)."""

    @pytest.mark.parametrize("header", ["bytes=\u0663-", "bytes=0-\u0663", "bytes=-\uff11", "bytes=\U0001d7d9-"])
    def test_non_ascii_digits_are_ignored(self, header: str) -> None:
        assert parse_range(header, 100) is None

    def test_nineteen_digits_are_a_range(self) -> None:
        assert parse_range("bytes=0-" + "9" * 19, 100) == parse_range("bytes=0-99", 100)


class TestArchive:
    def test_archive_extracts_to_files_matching_the_manifest(
        self, client: TestClient, tenant_a: TenantHeaders, job_with_checkpoint: Any
    ) -> None:
        _, checkpoint, manifest = job_with_checkpoint
        response = client.get(f"/v1/checkpoints/{checkpoint.id}/archive", headers=tenant_a)
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/x-tar"
        assert int(response.headers["content-length"]) == len(response.content)
        with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
        assert set(members) == {f"{checkpoint.id}/{path}" for path in manifest}
        for path, meta in manifest.items():
            content = members[f"{checkpoint.id}/{path}"]
            assert len(content) == meta["size"]
            assert hashlib.sha256(content).hexdigest() == meta["sha256"]

    def test_long_and_unicode_names_survive(self, settings: Any, tmp_path: Any) -> None:
        storage = Storage(str(tmp_path / "blobs"))
        names = ["a" * 150 + "/b.bin", "données/é.txt"]
        members = []
        for i, name in enumerate(names):
            storage.put_stream(f"k{i}", [name.encode() * 3])
            members.append(TarMember(name=name, key=f"k{i}", size=len(name.encode()) * 3))
        headers, total = tar_plan(members, 0)
        data = b"".join(iter_tar(storage, members, headers, total))
        assert len(data) == total and total % tarfile.RECORDSIZE == 0
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            assert [m.name for m in tar.getmembers()] == names

    def test_archive_streams_in_constant_memory(self, settings: Any, tmp_path: Any) -> None:
        storage = Storage(str(tmp_path / "blobs"))
        size = 48 * 1024 * 1024
        block = os.urandom(1024 * 1024)
        storage.put_stream("big.bin", (block for _ in range(size // len(block))))
        members = [TarMember(name="ckpt/big.bin", key="big.bin", size=size)]
        headers, total = tar_plan(members, 0)
        digest = hashlib.sha256()
        tracemalloc.start()
        try:
            for chunk in iter_tar(storage, members, headers, total):
                digest.update(chunk)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 8 * 1024 * 1024, f"peak {peak} bytes for a {size}-byte file"


ROUTES = [
    "/v1/checkpoints/{id}",
    "/v1/checkpoints/{id}/files/adapter_config.json",
    "/v1/checkpoints/{id}/archive",
]


class TestTenantIsolation:
    @pytest.mark.parametrize("route", ROUTES)
    def test_other_tenants_checkpoint_is_the_same_404_as_a_random_id(
        self, client: TestClient, tenant_b: TenantHeaders, job_with_checkpoint: Any, route: str
    ) -> None:
        _, checkpoint, _ = job_with_checkpoint
        missing = "ckpt_" + "0" * (len(checkpoint.id) - 5)
        other = client.get(route.format(id=checkpoint.id), headers=tenant_b)
        random = client.get(route.format(id=missing), headers=tenant_b)
        assert other.status_code == random.status_code == 404
        assert other.json() == {
            "error": {
                "code": "not_found",
                "message": f"checkpoint {checkpoint.id!r} not found",
                "details": None,
            }
        }
        assert random.json()["error"]["message"] == f"checkpoint {missing!r} not found"
