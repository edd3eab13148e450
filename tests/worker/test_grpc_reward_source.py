"""GrpcRewardSource against real loopback gRPC reward servers that verify every signature.

The same behaviours as the HTTP client's tests (tests/worker/test_reward_client.py), over the gRPC wire:
signing as metadata, batching and concurrency, retries of UNAVAILABLE / DEADLINE_EXCEEDED /
RESOURCE_EXHAUSTED, the circuit breaker, the cache, strict validation, SSRF pinning and TLS by name.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest

from contract.gen.grpo.v1 import reward_pb2
from outbound.rewards import (
    RetryEvent,
    RewardEndpointInvalidResponse,
    RewardEndpointRefused,
    RewardItem,
    RewardUnavailable,
    test_endpoint,
)
from outbound.rewards.errors import RewardEndpointGrpcError
from outbound.rewards.factory import build_remote_source
from outbound.rewards.grpc_source import GrpcRewardSource
from outbound.signing import grpc_signed_content, load_secret, sign_headers
from outbound.urlpolicy import UrlRejected, check_url_syntax, is_grpc_url
from worker.grpc_reward_server import RewardRequestRejected, add_reward_service, verify_score_request

from .grpc_reward_servers import GrpcFault, GrpcRewardServer, encode_rewards, running_grpc
from .reward_servers import closed_port, new_secret
from .test_reward_client import expected, make_config, make_items

NAME = "rewards.internal.test"


@pytest.fixture
def secret() -> str:
    return new_secret()


@pytest.fixture
def server(secret: str) -> Iterator[GrpcRewardServer]:
    with running_grpc(GrpcRewardServer(secret)) as srv:
        yield srv


def source_for(server: GrpcRewardServer, secret: str, **overrides: object) -> GrpcRewardSource:
    return GrpcRewardSource(make_config(server.url, secret, **overrides))


class TestJobLikeRun:
    async def test_steps_are_scored_signed_batched_and_cached(self, server: GrpcRewardServer, secret: str) -> None:
        source = source_for(server, secret, headers={"Authorization": "Bearer t0k"}, max_batch_size=8)
        try:
            for step in range(3):  # like a job: a few steps, the last repeating the first one's completions
                items = make_items(3, 4) if step != 1 else make_items(2, 4, distinct=False)
                assert await source(items, step=step) == expected(items)
        finally:
            await source.aclose()
        assert server.rejected == []
        # step 0: 12 items -> 8 + 4; step 1: 2 distinct completions -> 1 request; step 2: all cached.
        assert sorted(len(c.request.items) for c in server.seen) == [2, 4, 8]
        assert source.stats.cache_hits == 12 and source.stats.deduplicated == 6
        for call in server.seen:
            assert call.metadata["authorization"] == "Bearer t0k"
            assert call.metadata["webhook-signature"].startswith("v1,")
            request = call.request
            assert request.job_id == "job_123" and request.reward_function_id == "rf_test"
            groups = {item.group_id for item in request.items}
            for item in request.items:
                assert json.loads(item.extras_json["answer"]) == str(item.group_id)
                assert list(item.completion_ids) == [1, 2]
            assert len(groups) * 4 == len(request.items) or request.step == 1  # whole groups per request
        assert {call.request.step for call in server.seen} == {0, 1}

    async def test_signature_covers_the_exact_bytes(self, server: GrpcRewardServer, secret: str) -> None:
        source = source_for(server, secret)
        await source(make_items(1, 2), step=0)
        await source.aclose()
        call = server.seen[0]
        signer = load_secret(secret)
        timestamp = datetime.fromtimestamp(int(call.metadata["webhook-timestamp"]), tz=UTC)
        resigned = signer.sign(call.metadata["webhook-id"], timestamp, base64.b64encode(call.raw).decode())
        assert resigned == call.metadata["webhook-signature"]

    async def test_concurrency_limit_respected(self, secret: str) -> None:
        with running_grpc(GrpcRewardServer(secret, latency_s=0.15)) as server:
            items = make_items(8, 4)  # 32 items, batches of 4 -> 8 requests
            source = source_for(server, secret, max_batch_size=4, max_concurrency=3)
            assert await source(items, step=0) == expected(items)
            await source.aclose()
        assert server.received == 8 and server.max_in_flight == 3

    def test_usable_from_successive_event_loops(self, server: GrpcRewardServer, secret: str) -> None:
        source = source_for(server, secret, cache_max_entries=0)
        items = make_items(2, 2)
        assert asyncio.run(source(items, step=0)) == expected(items)
        assert asyncio.run(source(items, step=1)) == expected(items)

    async def test_connects_to_the_validated_address_with_the_name_as_authority(
        self, server: GrpcRewardServer, secret: str
    ) -> None:
        calls: list[str] = []

        async def resolver(host: str, port: int) -> list[str]:
            calls.append(host)
            return ["127.0.0.1"]

        config = make_config(f"grpc://{NAME}:{server.port}", secret)
        source = GrpcRewardSource(config, resolver=resolver)
        assert await source(make_items(1, 2), step=0) == expected(make_items(1, 2))
        await source.aclose()
        assert calls == [NAME]  # resolved once by the policy; the channel targets the IP, no second lookup


    async def test_reordered_dns_answers_keep_the_existing_channel(self, server: GrpcRewardServer, secret: str) -> None:
        # Round-robin DNS: later answers list another (validated) address first. The source keeps using the
        # channel it has (only 127.0.0.1 listens here; switching to 127.0.0.2 would be refused).
        answers = iter([["127.0.0.1"], ["127.0.0.2", "127.0.0.1"], ["127.0.0.2", "127.0.0.1"]])

        async def round_robin(host: str, port: int) -> list[str]:
            return next(answers)

        config = make_config(f"grpc://{NAME}:{server.port}", secret, cache_max_entries=0, max_attempts=1)
        source = GrpcRewardSource(config, resolver=round_robin)
        for step in range(3):
            assert await source(make_items(1, 2), step=step) == expected(make_items(1, 2))
        await source.aclose()
        assert server.received == 3


class TestRetries:
    @pytest.mark.parametrize(
        "fault",
        [
            GrpcFault(status=grpc.StatusCode.UNAVAILABLE),
            GrpcFault(status=grpc.StatusCode.RESOURCE_EXHAUSTED),
            GrpcFault(delay_s=3.0),  # past the 2 + 0.5 s deadline -> DEADLINE_EXCEEDED
        ],
        ids=["unavailable", "resource_exhausted", "deadline_exceeded"],
    )
    async def test_transient_statuses_are_retried_with_the_same_id(self, secret: str, fault: GrpcFault) -> None:
        plan = lambda n, r: fault if n <= 2 else None  # noqa: E731
        with running_grpc(GrpcRewardServer(secret, faults=plan)) as server:
            events: list[RetryEvent] = []
            # The connect step gets headroom: on a loaded machine a 0.5 s channel lookup can time out too,
            # which is another (legitimate) retry that never reaches the server.
            source = GrpcRewardSource(
                make_config(server.url, secret, timeout_s=0.5, connect_timeout_s=2.0), on_retry=events.append
            )
            assert await source(make_items(1, 2), step=0) == expected(make_items(1, 2))
            await source.aclose()
        assert server.received == 3 and len(events) == 2
        assert all(e.reason.startswith("gRPC ") for e in events), events
        assert len({c.metadata["webhook-id"] for c in server.seen}) == 1  # stable across retries

    async def test_pushback_is_honoured(self, secret: str) -> None:
        plan = lambda n, r: (  # noqa: E731
            GrpcFault(status=grpc.StatusCode.RESOURCE_EXHAUSTED, trailers=(("grpc-retry-pushback-ms", "300"),))
            if n == 1
            else None
        )
        with running_grpc(GrpcRewardServer(secret, faults=plan)) as server:
            events: list[RetryEvent] = []
            source = GrpcRewardSource(make_config(server.url, secret), on_retry=events.append)
            await source(make_items(1, 1), step=0)
            await source.aclose()
        assert [e.wait_s for e in events] == [0.3]

    async def test_permanent_status_fails_without_retry(self, secret: str) -> None:
        plan = lambda n, r: GrpcFault(status=grpc.StatusCode.INVALID_ARGUMENT, details="bad prompt")  # noqa: E731
        with running_grpc(GrpcRewardServer(secret, faults=plan)) as server:
            source = source_for(server, secret)
            with pytest.raises(RewardEndpointGrpcError, match="INVALID_ARGUMENT: 'bad prompt'") as info:
                await source(make_items(1, 2), step=0)
            await source.aclose()
        assert info.value.code == "reward_endpoint_grpc_error" and info.value.status == "INVALID_ARGUMENT"
        assert server.received == 1


class TestCircuitBreaker:
    async def test_endpoint_down_opens_breaker_then_recovers(self, secret: str) -> None:
        down = True
        plan = lambda n, r: GrpcFault(status=grpc.StatusCode.UNAVAILABLE) if down else None  # noqa: E731
        with running_grpc(GrpcRewardServer(secret, faults=plan)) as server:
            source = source_for(server, secret, max_attempts=3, breaker_threshold=2, breaker_reset_s=0.5)
            items = make_items(1, 2)
            # The request is sent again until 2 requests in a row exhausted their 3 attempts.
            with pytest.raises(RewardUnavailable, match="gRPC UNAVAILABLE.*circuit open after 2"):
                await source(items, step=0)
            assert server.received == 6
            with pytest.raises(RewardUnavailable, match="circuit open"):
                await source(items, step=0)
            assert server.received == 6
            down = False
            await asyncio.sleep(0.6)
            assert await source(items, step=0) == expected(items)
            await source.aclose()

    async def test_connection_refused_is_unavailable(self, secret: str) -> None:
        events: list[RetryEvent] = []
        config = make_config(f"grpc://127.0.0.1:{closed_port()}", secret, max_attempts=3, breaker_threshold=1)
        source = GrpcRewardSource(config, on_retry=events.append)
        with pytest.raises(RewardUnavailable, match="gRPC UNAVAILABLE") as info:
            await source(make_items(1, 2), step=0)
        await source.aclose()
        assert info.value.code == "reward_endpoint_unavailable" and len(events) == 2


class TestInvalidResponses:
    @pytest.mark.parametrize(
        ("body", "what"),
        [
            (encode_rewards([1.0]), "rewards has 1 values for 2 items"),
            (encode_rewards([math.nan, 1.0]), "rewards[0] is nan"),
            (encode_rewards([math.inf, 1.0]), "rewards[0] is inf"),
            (b"\xff\xff\xff", "not a ScoreResponse message"),
            (encode_rewards([1.0] * 2000), "exceeds the 4096-byte limit"),
        ],
    )
    async def test_rejected_with_endpoint_and_reason(self, secret: str, body: bytes, what: str) -> None:
        with running_grpc(GrpcRewardServer(secret, faults=lambda n, r: GrpcFault(body=body))) as server:
            source = source_for(server, secret, max_response_bytes=4096)
            with pytest.raises(RewardEndpointInvalidResponse) as info:
                await source(make_items(1, 2), step=0)
            await source.aclose()
        assert info.value.code == "reward_endpoint_invalid_response"
        assert what in str(info.value) and server.url in str(info.value)
        assert server.received == 1

    async def test_abstentions_pass_through(self, secret: str) -> None:
        with running_grpc(GrpcRewardServer(secret, score=lambda r: [None, 2.0])) as server:
            source = source_for(server, secret)
            assert await source(make_items(1, 2), step=0) == [None, 2.0]
            await source.aclose()


class TestSsrf:
    async def test_loopback_refused_in_production_before_connecting(
        self, server: GrpcRewardServer, secret: str
    ) -> None:
        config = make_config(server.url, secret).model_copy(update={"allow_private": False})
        source = GrpcRewardSource(config)
        with pytest.raises(RewardEndpointRefused, match="127.0.0.1 is a loopback address"):
            await source(make_items(1, 2), step=0)
        assert server.received == 0

    async def test_name_resolving_to_private_refused_in_production(
        self, server: GrpcRewardServer, secret: str
    ) -> None:
        async def private(host: str, port: int) -> list[str]:
            return ["93.184.215.14", "10.1.2.3"]

        config = make_config(f"grpcs://rewards.example.com:{server.port}", secret, allow_private=False)
        source = GrpcRewardSource(config, resolver=private)
        with pytest.raises(RewardEndpointRefused, match=r"rewards.example.com resolves to a private address$"):
            await source(make_items(1, 2), step=0)
        assert server.received == 0

    def test_url_policy_for_grpc_schemes(self) -> None:
        assert check_url_syntax("grpcs://Rewards.Example.com:443/", allow_private=False) == (
            "grpcs://rewards.example.com"
        )
        assert check_url_syntax("grpc://127.0.0.1:50051", allow_private=True) == "grpc://127.0.0.1:50051"
        assert is_grpc_url("grpcs://x.example.com") and not is_grpc_url("https://x.example.com/")
        for url, reason in [
            ("grpc://rewards.example.com:50051", "scheme 'grpc' is not allowed"),  # plaintext in production
            ("grpcs://10.0.0.1:50051", "private address"),
            ("grpcs://[::ffff:127.0.0.1]:50051", "loopback"),
            ("grpcs://rewards.example.com/grpo.v1.RewardService/Score", "names a server only"),
            ("grpcs://user:pw@rewards.example.com", "credentials"),
        ]:
            with pytest.raises(UrlRejected, match=reason):
                check_url_syntax(url, allow_private=False)

    def test_headers_must_be_valid_metadata(self, secret: str) -> None:
        with pytest.raises(ValueError, match="not a valid gRPC metadata key"):
            GrpcRewardSource(make_config("grpc://127.0.0.1:1", secret, headers={"grpc-timeout": "1"}))
        with pytest.raises(ValueError, match="printable ASCII"):  # a tab: HTTP header text, not metadata
            GrpcRewardSource(make_config("grpc://127.0.0.1:1", secret, headers={"x-name": "a\tb"}))


def make_cert(directory: Path, name: str) -> tuple[bytes, bytes]:
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{name}", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return key.read_bytes(), cert.read_bytes()


class TestTls:
    async def test_grpcs_verifies_the_name_while_connecting_to_the_validated_ip(
        self, secret: str, tmp_path: Path
    ) -> None:
        key, cert = make_cert(tmp_path, NAME)
        _, other_cert = make_cert(tmp_path, "someone-else.test")

        async def to_loopback(host: str, port: int) -> list[str]:
            return ["127.0.0.1"]

        with running_grpc(GrpcRewardServer(secret, tls=(key, cert))) as server:
            config = make_config(f"grpcs://{NAME}:{server.port}", secret)
            source = GrpcRewardSource(config, resolver=to_loopback, root_certificates=cert)
            assert await source(make_items(1, 2), step=0) == expected(make_items(1, 2))
            await source.aclose()
            # A server whose certificate is not for the name (here: not trusted for it) never gets the request.
            wrong = GrpcRewardSource(
                config.model_copy(update={"max_attempts": 1}), resolver=to_loopback, root_certificates=other_cert
            )
            with pytest.raises(RewardUnavailable):
                await wrong(make_items(1, 2), step=0)
            await wrong.aclose()
        assert server.received == 1


class TestTestEndpoint:
    async def test_dry_run_over_grpc(self, server: GrpcRewardServer, secret: str) -> None:
        items = [RewardItem(id="a", prompt="p", completion="abc"), RewardItem(id="b", prompt="p", completion="a")]
        rewards, latency_ms = await test_endpoint(make_config(server.url, secret), items)
        assert rewards == [3.0, 1.0] and latency_ms > 0 and server.received == 1

    def test_factory_picks_the_transport(self, secret: str) -> None:
        assert isinstance(build_remote_source(make_config("grpc://127.0.0.1:1", secret)), GrpcRewardSource)
        assert not isinstance(build_remote_source(make_config("http://127.0.0.1:1/", secret)), GrpcRewardSource)


class TestServerHelper:
    """worker.grpc_reward_server: what users run; it must refuse tampered and stale requests."""

    def _signed(self, secret: str, raw: bytes, *, at: datetime | None = None) -> dict[str, str]:
        return sign_headers(load_secret(secret), "msg_1", grpc_signed_content(raw), now=at or datetime.now(tz=UTC))

    def test_verify_accepts_signed_and_refuses_tampered_or_stale(self, secret: str) -> None:
        raw = reward_pb2.ScoreRequest(job_id="j", items=[reward_pb2.ScoreItem(prompt="p", completion="c")])
        body = raw.SerializeToString()
        assert verify_score_request(secret, self._signed(secret, body), body).job_id == "j"
        tampered = reward_pb2.ScoreRequest(job_id="k", items=raw.items).SerializeToString()
        stale = self._signed(secret, body, at=datetime.now(tz=UTC) - timedelta(minutes=6))
        for metadata, payload in [(self._signed(secret, body), tampered), (stale, body)]:
            with pytest.raises(RewardRequestRejected) as info:
                verify_score_request(secret, metadata, payload)
            assert info.value.status == 401

    async def test_add_reward_service_round_trip_on_grpc_aio(self, secret: str) -> None:
        server = grpc.aio.server()
        add_reward_service(server, secret, lambda request: [float(len(i.completion)) for i in request.items])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            source = GrpcRewardSource(make_config(f"grpc://127.0.0.1:{port}", secret))
            items = make_items(2, 3)
            assert await source(items, step=0) == expected(items)
            await source.aclose()
            other = GrpcRewardSource(make_config(f"grpc://127.0.0.1:{port}", new_secret()))
            with pytest.raises(RewardEndpointGrpcError, match="UNAUTHENTICATED"):
                await other(items, step=0)
            await other.aclose()
        finally:
            await server.stop(grace=None)
