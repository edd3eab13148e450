"""Real loopback gRPC reward servers for the tests (a thread-pool grpc.server on port 0).

The twin of `tests.worker.reward_servers`: every call is verified with the user helper
(`worker.grpc_reward_server.verify_score_request`) before anything else, what was seen is recorded, and a
`GrpcFaultPlan` (call number from 1, parsed request) -> GrpcFault chooses per call what to do instead of
answering normally. The handler answers raw bytes so tests can send invalid responses too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from contract.gen.grpo.v1 import reward_pb2
from worker.grpc_reward_server import RewardRequestRejected, verify_score_request


@dataclass(frozen=True)
class GrpcFault:
    status: grpc.StatusCode | None = None  # abort with this status
    details: str = "injected"
    body: bytes | None = None  # answer these raw bytes instead of a computed ScoreResponse
    trailers: tuple[tuple[str, str], ...] = ()
    delay_s: float = 0.0


GrpcFaultPlan = Callable[[int, reward_pb2.ScoreRequest], GrpcFault | None]
GrpcScoreFn = Callable[[reward_pb2.ScoreRequest], list[float | None]]


def score_by_length(request: reward_pb2.ScoreRequest) -> list[float | None]:
    return [float(len(item.completion)) for item in request.items]


def encode_rewards(rewards: list[float | None]) -> bytes:
    return reward_pb2.ScoreResponse(
        rewards=[reward_pb2.Reward() if r is None else reward_pb2.Reward(value=r) for r in rewards]
    ).SerializeToString()


@dataclass
class SeenCall:
    metadata: dict[str, str]
    raw: bytes
    request: reward_pb2.ScoreRequest
    number: int


class GrpcRewardServer:
    """A RewardService endpoint on 127.0.0.1:<port> (thread-pool grpc.server, optionally TLS)."""

    def __init__(
        self,
        secret: str,
        *,
        score: GrpcScoreFn = score_by_length,
        faults: GrpcFaultPlan | None = None,
        latency_s: float = 0.0,
        tls: tuple[bytes, bytes] | None = None,  # (private key PEM, certificate chain PEM)
    ) -> None:
        self.secret = secret
        self.score = score
        self.faults = faults
        self.latency_s = latency_s
        self.tls = tls
        self.seen: list[SeenCall] = []
        self.rejected: list[str] = []
        self.received = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = 0
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    @property
    def url(self) -> str:
        return f"{'grpcs' if self.tls else 'grpc'}://127.0.0.1:{self.port}"

    def _score(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.received += 1
            number = self.received
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
            try:
                request = verify_score_request(self.secret, metadata, raw)
            except RewardRequestRejected as exc:
                self.rejected.append(str(exc))
                context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            with self._lock:
                self.seen.append(SeenCall(metadata, raw, request, number))
            fault = self.faults(number, request) if self.faults else None
            delay = self.latency_s + (fault.delay_s if fault else 0.0)
            if delay:
                time.sleep(delay)
            if fault and fault.status is not None:
                context.set_trailing_metadata(fault.trailers)
                context.abort(fault.status, fault.details)
            if fault and fault.body is not None:
                return fault.body
            return encode_rewards(self.score(request))
        finally:
            with self._lock:
                self.in_flight -= 1

    def start(self) -> GrpcRewardServer:
        server = grpc.server(ThreadPoolExecutor(max_workers=16))
        handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(self._score)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("grpo.v1.RewardService", {"Score": handler}),)
        )
        address = f"127.0.0.1:{self.port}"
        if self.tls:
            self.port = server.add_secure_port(address, grpc.ssl_server_credentials([self.tls]))
        else:
            self.port = server.add_insecure_port(address)
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(timeout=10)
        self._server = None


@contextmanager
def running_grpc(server: GrpcRewardServer) -> Iterator[GrpcRewardServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()
