"""RewardFunctionService over a real channel: register/get/list/rotate/delete, isolation, bad input."""

from __future__ import annotations

import grpc
import pytest
from fastapi.testclient import TestClient

from contract.gen.grpo.v1 import reward_functions_pb2 as pb
from contract.gen.grpo.v1 import reward_functions_pb2_grpc
from tests.grpc.helpers import bearer, error_code, error_field
from tests.service.factories import TenantHeaders


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> reward_functions_pb2_grpc.RewardFunctionServiceAsyncStub:
    return reward_functions_pb2_grpc.RewardFunctionServiceStub(channel)


def _register(**fields: object) -> pb.RegisterRewardFunctionRequest:
    return pb.RegisterRewardFunctionRequest(
        **{"name": "judge", "url": "https://rewards.example.com/score", **fields}  # type: ignore[arg-type]
    )


class TestRewardFunctions:
    async def test_lifecycle(
        self, stub: reward_functions_pb2_grpc.RewardFunctionServiceAsyncStub, tenant_a: TenantHeaders, client: TestClient
    ) -> None:
        auth = bearer(tenant_a.api_key)
        created = await stub.RegisterRewardFunction(
            _register(max_batch_size=16, headers={"Authorization": "Bearer t0k", "x-pass": "hunter2"}), metadata=auth
        )
        rf = created.reward_function
        assert created.signing_secret.startswith("whsec_")
        assert (rf.max_batch_size, rf.max_concurrency, rf.timeout_s) == (16, 4, 10.0)  # REST defaults
        assert (rf.max_attempts, rf.backoff_s, rf.breaker_threshold, rf.step_deadline_s, rf.max_abstain_fraction) == (
            5, 0.5, 3, 300.0, 0.25
        )
        assert dict(rf.headers) == {"Authorization": "<redacted>", "x-pass": "<redacted>"}
        got = (await stub.GetRewardFunction(pb.GetRewardFunctionRequest(reward_function_id=rf.id), metadata=auth))
        assert got.reward_function == rf
        listed = await stub.ListRewardFunctions(pb.ListRewardFunctionsRequest(), metadata=auth)
        assert [dict(r.headers) for r in listed.reward_functions] == [dict(rf.headers)]
        assert client.get(f"/v1/reward-functions/{rf.id}", headers=tenant_a).json()["max_batch_size"] == 16

        rotated = await stub.RotateRewardFunctionSecret(
            pb.RotateRewardFunctionSecretRequest(reward_function_id=rf.id), metadata=auth
        )
        assert rotated.signing_secret.startswith("whsec_") and rotated.signing_secret != created.signing_secret

        second = (await stub.RegisterRewardFunction(_register(name="other"), metadata=auth)).reward_function
        page = await stub.ListRewardFunctions(pb.ListRewardFunctionsRequest(page_size=1), metadata=auth)
        assert [r.id for r in page.reward_functions] == [second.id] and page.next_page_token
        await stub.DeleteRewardFunction(pb.DeleteRewardFunctionRequest(reward_function_id=rf.id), metadata=auth)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetRewardFunction(pb.GetRewardFunctionRequest(reward_function_id=rf.id), metadata=auth)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    @pytest.mark.parametrize(
        ("fields", "field"),
        [
            ({"name": "bad/name"}, "name"),
            ({"timeout_s": 0.0}, "timeout_s"),
            ({"headers": {"Content-Type": "x"}}, "headers"),
            ({"max_attempts": 0}, "max_attempts"),
            ({"breaker_threshold": 21}, "breaker_threshold"),
            ({"max_abstain_fraction": 2.0}, "max_abstain_fraction"),
            ({"step_deadline_s": 0.0}, "step_deadline_s"),
            ({"backoff_s": 100.0}, "backoff_s"),
        ],
    )
    async def test_invalid_fields_are_named(
        self,
        stub: reward_functions_pb2_grpc.RewardFunctionServiceAsyncStub,
        tenant_a: TenantHeaders,
        fields: dict[str, object],
        field: str,
    ) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterRewardFunction(_register(**fields), metadata=bearer(tenant_a.api_key))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_field(err.value) == field

    async def test_failure_policy_is_stored(
        self, stub: reward_functions_pb2_grpc.RewardFunctionServiceAsyncStub, tenant_a: TenantHeaders, client: TestClient
    ) -> None:
        auth = bearer(tenant_a.api_key)
        policy = {"max_attempts": 2, "backoff_s": 0.25, "breaker_threshold": 9, "step_deadline_s": 60.0,
                  "max_abstain_fraction": 0.5}
        rf = (await stub.RegisterRewardFunction(_register(**policy), metadata=auth)).reward_function
        assert {name: getattr(rf, name) for name in policy} == policy
        rest = client.get(f"/v1/reward-functions/{rf.id}", headers=tenant_a).json()
        assert {name: rest[name] for name in policy} == policy

    async def test_url_policy_applies(
        self, stub: reward_functions_pb2_grpc.RewardFunctionServiceAsyncStub, tenant_a: TenantHeaders
    ) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterRewardFunction(
                _register(url="https://user:pw@rewards.example.com/"), metadata=bearer(tenant_a.api_key)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_code(err.value) == "url_rejected"

    async def test_other_tenant_gets_not_found(
        self,
        stub: reward_functions_pb2_grpc.RewardFunctionServiceAsyncStub,
        tenant_a: TenantHeaders,
        tenant_b: TenantHeaders,
    ) -> None:
        rf = (await stub.RegisterRewardFunction(_register(), metadata=bearer(tenant_a.api_key))).reward_function
        theirs = bearer(tenant_b.api_key)
        for call, request in (
            (stub.GetRewardFunction, pb.GetRewardFunctionRequest(reward_function_id=rf.id)),
            (stub.DeleteRewardFunction, pb.DeleteRewardFunctionRequest(reward_function_id=rf.id)),
            (stub.RotateRewardFunctionSecret, pb.RotateRewardFunctionSecretRequest(reward_function_id=rf.id)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request, metadata=theirs)  # type: ignore[operator]
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
