"""RewardFunctionService.TestRewardFunction over a real channel, against real loopback reward servers.

The same domain operation as POST /v1/reward-functions/{id}/test (service.rewards.dry_run); the servers
verify every signature, and endpoint failures come back as statuses carrying the job's error code.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc
import pytest

from contract.gen.grpo.v1 import reward_functions_pb2 as pb
from contract.gen.grpo.v1 import reward_functions_pb2_grpc
from tests.grpc.helpers import bearer, error_code, error_field
from tests.service.factories import TenantHeaders
from tests.worker.grpc_reward_servers import GrpcRewardServer, running_grpc
from tests.worker.reward_servers import Fault, RewardServer, closed_port, new_secret, running

if TYPE_CHECKING:  # the async stub type exists only in the .pyi stubs
    Stub = reward_functions_pb2_grpc.RewardFunctionServiceAsyncStub
SAMPLES = [
    pb.TestSample(prompt="2+2=", completion="4", metadata_json={"answer": json.dumps(4)}),
    pb.TestSample(prompt="2+2=", completion="five", metadata_json={"answer": json.dumps(4)}, group_id=0),
]


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> Stub:
    return reward_functions_pb2_grpc.RewardFunctionServiceStub(channel)


async def register(stub: Stub, tenant: TenantHeaders, url: str) -> pb.RegisterRewardFunctionResponse:
    request = pb.RegisterRewardFunctionRequest(name="judge", url=url)
    response: pb.RegisterRewardFunctionResponse = await stub.RegisterRewardFunction(
        request, metadata=bearer(tenant.api_key)
    )
    return response


async def dry_run(stub: Stub, tenant: TenantHeaders, rf_id: str, samples: list[pb.TestSample] = SAMPLES) -> pb.TestRewardFunctionResponse:
    request = pb.TestRewardFunctionRequest(reward_function_id=rf_id, samples=samples)
    response: pb.TestRewardFunctionResponse = await stub.TestRewardFunction(request, metadata=bearer(tenant.api_key))
    return response


class TestTestRewardFunction:
    async def test_http_endpoint_scores_with_verified_signature(self, stub: Stub, tenant_a: TenantHeaders) -> None:
        with running(RewardServer(new_secret(), score=lambda r: [None, 4.0])) as server:
            created = await register(stub, tenant_a, server.url)
            server.secret = created.signing_secret
            result = await dry_run(stub, tenant_a, created.reward_function.id)
        assert [r.HasField("value") for r in result.rewards] == [False, True]  # abstention stays unset
        assert result.rewards[1].value == 4.0 and result.latency_ms > 0
        assert server.rejected == [] and server.received == 1
        assert json.loads(server.seen[0].body)["items"][0]["metadata"] == {"answer": 4}

    async def test_grpc_endpoint_scores_with_verified_metadata_signature(
        self, stub: Stub, tenant_a: TenantHeaders
    ) -> None:
        with running_grpc(GrpcRewardServer(new_secret())) as server:
            created = await register(stub, tenant_a, server.url)
            server.secret = created.signing_secret
            result = await dry_run(stub, tenant_a, created.reward_function.id)
        assert [r.value for r in result.rewards] == [1.0, 4.0]
        assert server.rejected == [] and server.seen[0].request.reward_function_id == created.reward_function.id

    async def test_invalid_response_is_failed_precondition_with_the_reason(
        self, stub: Stub, tenant_a: TenantHeaders
    ) -> None:
        with running(RewardServer(new_secret(), faults=lambda n, r: Fault(body=b'{"rewards": [1.0, NaN]}'))) as server:
            created = await register(stub, tenant_a, server.url)
            server.secret = created.signing_secret
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await dry_run(stub, tenant_a, created.reward_function.id)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_code(err.value) == "reward_endpoint_invalid_response"
        assert "NaN" in (err.value.details() or "") and server.url in (err.value.details() or "")

    async def test_unreachable_endpoint_is_unavailable(self, stub: Stub, tenant_a: TenantHeaders) -> None:
        created = await register(stub, tenant_a, f"grpc://127.0.0.1:{closed_port()}")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await dry_run(stub, tenant_a, created.reward_function.id)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_code(err.value) == "reward_endpoint_unavailable"
        assert "gRPC UNAVAILABLE" in (err.value.details() or "")

    async def test_other_tenant_gets_not_found(
        self, stub: Stub, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        with running(RewardServer(new_secret())) as server:
            created = await register(stub, tenant_a, server.url)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await dry_run(stub, tenant_b, created.reward_function.id)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and server.received == 0

    @pytest.mark.parametrize(
        ("samples", "field"),
        [
            ([], "samples"),
            ([pb.TestSample(prompt="p", completion="c", metadata_json={"answer": "{not json"})], "samples.0.metadata_json.answer"),
            ([pb.TestSample(prompt="p", completion="c", group_id=-1)], "samples.0.group_id"),
        ],
    )
    async def test_bad_samples_are_invalid_argument_naming_the_field(
        self, stub: Stub, tenant_a: TenantHeaders, samples: list[pb.TestSample], field: str
    ) -> None:
        created = await register(stub, tenant_a, "http://127.0.0.1:9/score")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await dry_run(stub, tenant_a, created.reward_function.id, samples)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_field(err.value) == field
