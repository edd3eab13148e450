"""EnvironmentService: the same domain functions as /v1/environments (service.environments.service)."""

from __future__ import annotations

from typing import Any

import grpc
from sqlalchemy.orm import Session

from contract.api.environments import EnvironmentOut
from contract.gen.grpo.v1 import environments_pb2 as pb
from contract.gen.grpo.v1 import environments_pb2_grpc
from service.environments import service
from service.environments.schemas import environment_out, environment_with_secret
from service.grpc.auth import current_tenant
from service.grpc.calls import in_session
from service.grpc.convert import environment_create_from_proto, environment_to_proto
from service.kit.paging import RESOURCES, page_size

Context = grpc.aio.ServicerContext[Any, Any]


class EnvironmentServicer(environments_pb2_grpc.EnvironmentServiceServicer):

    async def RegisterEnvironment(
        self, request: pb.RegisterEnvironmentRequest, context: Context
    ) -> pb.RegisterEnvironmentResponse:
        tenant = current_tenant()
        body = environment_create_from_proto(request)
        # Registration reads the server (up to its timeout): in_session runs it on a worker thread.
        row = await in_session(lambda s: environment_with_secret(service.create_environment(s, tenant.tenant_id, body)))
        return pb.RegisterEnvironmentResponse(environment=environment_to_proto(row), signing_secret=row.signing_secret)

    async def GetEnvironment(self, request: pb.GetEnvironmentRequest, context: Context) -> pb.GetEnvironmentResponse:
        tenant = current_tenant()
        row = await in_session(
            lambda s: environment_out(service.get_environment(s, tenant.tenant_id, request.environment_id))
        )
        return pb.GetEnvironmentResponse(environment=environment_to_proto(row))

    async def ListEnvironments(
        self, request: pb.ListEnvironmentsRequest, context: Context
    ) -> pb.ListEnvironmentsResponse:
        tenant = current_tenant()
        limit = page_size(request.page_size, RESOURCES)

        def work(s: Session) -> tuple[list[EnvironmentOut], bool]:
            rows, has_more = service.list_environments(s, tenant.tenant_id, limit=limit,
                                                       after=request.page_token or None)
            return [environment_out(r) for r in rows], has_more

        rows, has_more = await in_session(work)
        return pb.ListEnvironmentsResponse(
            environments=[environment_to_proto(r) for r in rows],
            next_page_token=rows[-1].id if has_more and rows else "",
        )

    async def CheckEnvironment(
        self, request: pb.CheckEnvironmentRequest, context: Context
    ) -> pb.CheckEnvironmentResponse:
        tenant = current_tenant()
        row = await in_session(
            lambda s: environment_out(service.check_environment(s, tenant.tenant_id, request.environment_id))
        )
        return pb.CheckEnvironmentResponse(environment=environment_to_proto(row))

    async def DeleteEnvironment(
        self, request: pb.DeleteEnvironmentRequest, context: Context
    ) -> pb.DeleteEnvironmentResponse:
        tenant = current_tenant()
        await in_session(lambda s: service.delete_environment(s, tenant.tenant_id, request.environment_id))
        return pb.DeleteEnvironmentResponse()

    async def RotateEnvironmentSecret(
        self, request: pb.RotateEnvironmentSecretRequest, context: Context
    ) -> pb.RotateEnvironmentSecretResponse:
        tenant = current_tenant()
        row = await in_session(
            lambda s: environment_with_secret(service.rotate_secret(s, tenant.tenant_id, request.environment_id))
        )
        return pb.RotateEnvironmentSecretResponse(environment=environment_to_proto(row),
                                                  signing_secret=row.signing_secret)
