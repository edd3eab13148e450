"""RewardFunctionService: the same domain functions as /v1/reward-functions (service.rewards.service)."""

from __future__ import annotations

from typing import Any

import grpc
from sqlalchemy.orm import Session

from contract.api.rewards import RewardFunctionOut
from contract.gen.grpo.v1 import reward_functions_pb2 as pb
from contract.gen.grpo.v1 import reward_functions_pb2_grpc
from service.grpc.auth import current_tenant
from service.grpc.calls import in_session
from service.grpc.convert import (
    reward_function_create_from_proto,
    reward_function_to_proto,
    reward_test_items_from_proto,
    reward_test_result_to_proto,
)
from service.kit.paging import RESOURCES, page_size
from service.rewards import dry_run, service
from service.rewards.schemas import reward_function_out, reward_function_with_secret

Context = grpc.aio.ServicerContext[Any, Any]


class RewardFunctionServicer(reward_functions_pb2_grpc.RewardFunctionServiceServicer):

    async def RegisterRewardFunction(
        self, request: pb.RegisterRewardFunctionRequest, context: Context
    ) -> pb.RegisterRewardFunctionResponse:
        tenant = current_tenant()
        body = reward_function_create_from_proto(request)
        row = await in_session(
            lambda s: reward_function_with_secret(service.create_reward_function(s, tenant.tenant_id, body))
        )
        return pb.RegisterRewardFunctionResponse(
            reward_function=reward_function_to_proto(row), signing_secret=row.signing_secret
        )

    async def GetRewardFunction(self, request: pb.GetRewardFunctionRequest, context: Context) -> pb.GetRewardFunctionResponse:
        tenant = current_tenant()
        row = await in_session(
            lambda s: reward_function_out(
                service.get_reward_function(s, tenant.tenant_id, request.reward_function_id)
            )
        )
        return pb.GetRewardFunctionResponse(reward_function=reward_function_to_proto(row))

    async def ListRewardFunctions(
        self, request: pb.ListRewardFunctionsRequest, context: Context
    ) -> pb.ListRewardFunctionsResponse:
        tenant = current_tenant()
        limit = page_size(request.page_size, RESOURCES)

        def work(s: Session) -> tuple[list[RewardFunctionOut], bool]:
            rows, has_more = service.list_reward_functions(
                s, tenant.tenant_id, limit=limit, after=request.page_token or None
            )
            return [reward_function_out(r) for r in rows], has_more

        rows, has_more = await in_session(work)
        return pb.ListRewardFunctionsResponse(
            reward_functions=[reward_function_to_proto(r) for r in rows],
            next_page_token=rows[-1].id if has_more and rows else "",
        )

    async def DeleteRewardFunction(
        self, request: pb.DeleteRewardFunctionRequest, context: Context
    ) -> pb.DeleteRewardFunctionResponse:
        tenant = current_tenant()
        await in_session(lambda s: service.delete_reward_function(s, tenant.tenant_id, request.reward_function_id))
        return pb.DeleteRewardFunctionResponse()

    async def RotateRewardFunctionSecret(
        self, request: pb.RotateRewardFunctionSecretRequest, context: Context
    ) -> pb.RotateRewardFunctionSecretResponse:
        tenant = current_tenant()
        row = await in_session(
            lambda s: reward_function_with_secret(
                service.rotate_secret(s, tenant.tenant_id, request.reward_function_id)
            )
        )
        return pb.RotateRewardFunctionSecretResponse(
            reward_function=reward_function_to_proto(row), signing_secret=row.signing_secret
        )

    async def TestRewardFunction(
        self, request: pb.TestRewardFunctionRequest, context: Context
    ) -> pb.TestRewardFunctionResponse:
        tenant = current_tenant()
        items = reward_test_items_from_proto(request)
        # The call blocks for up to the endpoint's timeout: in_session runs it on a worker thread.
        result = await in_session(
            lambda s: dry_run.test_reward_function(s, tenant.tenant_id, request.reward_function_id, items)
        )
        return reward_test_result_to_proto(result)
