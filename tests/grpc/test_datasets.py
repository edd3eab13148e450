"""DatasetService over a real channel: the same records as the REST API, tenant isolation, bad input."""

from __future__ import annotations

import hashlib
import json

import grpc
import pytest
from fastapi.testclient import TestClient

from contract.gen.grpo.v1 import datasets_pb2, datasets_pb2_grpc
from tests.grpc.helpers import (
    bearer,
    error_code,
    error_details,
    error_field,
    upload,
    upload_ending_early,
    upload_requests,
)
from tests.service.factories import TenantHeaders


def _jsonl(rows: int) -> bytes:
    lines = [
        json.dumps({"prompt": f"What is {i} + {i}? Think it through carefully.", "answer": str(2 * i)})
        for i in range(rows)
    ]
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> datasets_pb2_grpc.DatasetServiceAsyncStub:
    return datasets_pb2_grpc.DatasetServiceStub(channel)


class TestUploadDataset:
    async def test_multi_megabyte_upload_matches_rest(
        self, channel: grpc.aio.Channel, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        data = _jsonl(40_000)
        assert len(data) > 3 * 1024 * 1024
        via_grpc = await upload(channel, tenant_a.api_key, data, name="train", chunk_size=256 * 1024 + 7)
        rest = client.post("/v1/datasets", headers=tenant_a, files={"file": ("train", data)})
        assert rest.status_code == 201, rest.text
        body = rest.json()
        assert via_grpc.sha256 == body["sha256"] == hashlib.sha256(data).hexdigest()
        assert via_grpc.num_rows == body["num_rows"] == 40_000
        assert via_grpc.size_bytes == body["bytes"] == len(data)
        assert list(via_grpc.columns) == body["columns"] == ["prompt", "answer"]
        assert via_grpc.name == body["name"] == "train"
        # The gRPC record is a real dataset: REST reads it back the same.
        assert client.get(f"/v1/datasets/{via_grpc.id}", headers=tenant_a).json()["sha256"] == via_grpc.sha256

    async def test_invalid_lines_are_named(self, channel: grpc.aio.Channel, tenant_a: TenantHeaders) -> None:
        data = b'{"prompt": "fine"}\nnot json\n{"prompt": ""}\n{"prompt": "also fine"}\n'
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await upload(channel, tenant_a.api_key, data, chunk_size=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_code(err.value) == "dataset_invalid"
        assert "line 2" in (err.value.details() or "")
        assert [p["line"] for p in error_details(err.value)] == [2, 3]

    async def test_first_message_must_be_metadata(
        self, stub: datasets_pb2_grpc.DatasetServiceAsyncStub, tenant_a: TenantHeaders
    ) -> None:
        async def chunks_only():  # type: ignore[no-untyped-def]
            yield datasets_pb2.UploadDatasetRequest(chunk=b'{"prompt": "x"}\n')

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.UploadDataset(chunks_only(), metadata=bearer(tenant_a.api_key))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_field(err.value) == "metadata"

    async def test_bad_name_is_invalid_argument(
        self, stub: datasets_pb2_grpc.DatasetServiceAsyncStub, tenant_a: TenantHeaders
    ) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.UploadDataset(
                upload_requests(b'{"prompt": "x"}\n', name="x" * 300), metadata=bearer(tenant_a.api_key)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_field(err.value) == "name"

    async def test_too_large_is_resource_exhausted(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from service.kit.config import get_settings

        monkeypatch.setattr(get_settings(), "max_dataset_bytes", 1000)
        code, details = await upload_ending_early(channel, tenant_a.api_key, _jsonl(100))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "1000" in details, details


class TestReadAndDelete:
    async def test_get_list_delete(
        self,
        channel: grpc.aio.Channel,
        stub: datasets_pb2_grpc.DatasetServiceAsyncStub,
        tenant_a: TenantHeaders,
    ) -> None:
        auth = bearer(tenant_a.api_key)
        first = await upload(channel, tenant_a.api_key, _jsonl(3), name="one")
        second = await upload(channel, tenant_a.api_key, _jsonl(4), name="two")
        got = (
            await stub.GetDataset(datasets_pb2.GetDatasetRequest(dataset_id=first.id), metadata=auth)
        ).dataset
        assert got == first

        page1 = await stub.ListDatasets(datasets_pb2.ListDatasetsRequest(page_size=1), metadata=auth)
        assert [d.id for d in page1.datasets] == [second.id]  # newest first
        page2 = await stub.ListDatasets(
            datasets_pb2.ListDatasetsRequest(page_size=1, page_token=page1.next_page_token), metadata=auth
        )
        assert [d.id for d in page2.datasets] == [first.id]
        assert page2.next_page_token == ""

        await stub.DeleteDataset(datasets_pb2.DeleteDatasetRequest(dataset_id=first.id), metadata=auth)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetDataset(datasets_pb2.GetDatasetRequest(dataset_id=first.id), metadata=auth)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    async def test_other_tenants_datasets_are_not_found(
        self,
        channel: grpc.aio.Channel,
        stub: datasets_pb2_grpc.DatasetServiceAsyncStub,
        tenant_a: TenantHeaders,
        tenant_b: TenantHeaders,
    ) -> None:
        mine = await upload(channel, tenant_a.api_key, _jsonl(3))
        theirs = bearer(tenant_b.api_key)
        for call, request in (
            (stub.GetDataset, datasets_pb2.GetDatasetRequest(dataset_id=mine.id)),
            (stub.DeleteDataset, datasets_pb2.DeleteDatasetRequest(dataset_id=mine.id)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request, metadata=theirs)  # type: ignore[operator]
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert err.value.details() == f"dataset {mine.id!r} not found"
        listed = await stub.ListDatasets(datasets_pb2.ListDatasetsRequest(), metadata=theirs)
        assert list(listed.datasets) == []

    async def test_page_size_out_of_range_names_the_field(
        self, stub: datasets_pb2_grpc.DatasetServiceAsyncStub, tenant_a: TenantHeaders
    ) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListDatasets(
                datasets_pb2.ListDatasetsRequest(page_size=101), metadata=bearer(tenant_a.api_key)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_field(err.value) == "page_size"
