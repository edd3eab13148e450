"""DatasetService: the same domain functions as /v1/datasets (service.datasets.service)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from contract.api.datasets import DatasetOut
from contract.gen.grpo.v1 import datasets_pb2, datasets_pb2_grpc
from service.datasets import service
from service.datasets.ingest import DatasetIngest
from service.datasets.schemas import dataset_out
from service.grpc.auth import current_tenant
from service.grpc.calls import in_session
from service.grpc.convert import dataset_to_proto
from service.jobs.service import dataset_in_use
from service.kit.errors import ValidationFailed
from service.kit.paging import RESOURCES, page_size

Context = grpc.aio.ServicerContext[Any, Any]


def _out_of_order(message: str) -> ValidationFailed:
    return ValidationFailed(message, details=[{"field": "metadata", "message": message}])


class DatasetServicer(datasets_pb2_grpc.DatasetServiceServicer):
    async def UploadDataset(
        self, request_iterator: AsyncIterator[datasets_pb2.UploadDatasetRequest], context: Context
    ) -> datasets_pb2.UploadDatasetResponse:
        tenant = current_tenant()
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("payload") != "metadata":
            raise _out_of_order("the first message must carry the metadata")
        name = service.clean_name(first.metadata.name or None, None)
        ingest = await asyncio.to_thread(service.begin_upload)
        try:
            await self._feed(request_iterator, ingest)
            dataset = await in_session(
                lambda s: dataset_out(service.create_dataset(s, tenant.tenant_id, name, ingest))
            )
        except BaseException:
            await asyncio.to_thread(ingest.abort)
            raise
        return datasets_pb2.UploadDatasetResponse(dataset=dataset_to_proto(dataset))

    @staticmethod
    async def _feed(requests: AsyncIterator[datasets_pb2.UploadDatasetRequest], ingest: DatasetIngest) -> None:
        async for message in requests:
            if message.WhichOneof("payload") != "chunk":
                raise _out_of_order("metadata may only be sent in the first message")
            # Hashing, validation and the storage write are blocking: keep them off the event loop.
            await asyncio.to_thread(ingest.feed, message.chunk)

    async def GetDataset(self, request: datasets_pb2.GetDatasetRequest, context: Context) -> datasets_pb2.GetDatasetResponse:
        tenant = current_tenant()
        dataset = await in_session(
            lambda s: dataset_out(service.get_dataset(s, tenant.tenant_id, request.dataset_id))
        )
        return datasets_pb2.GetDatasetResponse(dataset=dataset_to_proto(dataset))

    async def ListDatasets(
        self, request: datasets_pb2.ListDatasetsRequest, context: Context
    ) -> datasets_pb2.ListDatasetsResponse:
        tenant = current_tenant()
        limit = page_size(request.page_size, RESOURCES)
        rows, has_more = await in_session(
            lambda s: _page(service.list_datasets(s, tenant.tenant_id, limit=limit, after=request.page_token or None))
        )
        return datasets_pb2.ListDatasetsResponse(
            datasets=[dataset_to_proto(d) for d in rows],
            next_page_token=rows[-1].id if has_more and rows else "",
        )

    async def DeleteDataset(
        self, request: datasets_pb2.DeleteDatasetRequest, context: Context
    ) -> datasets_pb2.DeleteDatasetResponse:
        tenant = current_tenant()
        await in_session(
            lambda s: service.delete_dataset(s, tenant.tenant_id, request.dataset_id, in_use=dataset_in_use)
        )
        return datasets_pb2.DeleteDatasetResponse()


def _page(result: tuple[Any, bool]) -> tuple[list[DatasetOut], bool]:
    rows, has_more = result
    return [dataset_out(r) for r in rows], has_more
