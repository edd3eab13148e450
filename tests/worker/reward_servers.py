"""Real loopback reward servers for the tests (uvicorn in a thread, port 0) with fault injection.

The server verifies every request with the user helper (`worker.reward_server.verify_and_parse`) before
anything else, and records what it saw so tests can assert on signatures, batching and concurrency.
Faults are chosen per request by a `FaultPlan` callable: (request number from 1, parsed request) -> Fault.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from worker.reward_server import RewardRequest, RewardRequestRejected, encode_response, verify_and_parse


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(24)).decode()


@dataclass(frozen=True)
class Fault:
    """What to do instead of (or before) answering normally."""

    status: int | None = None  # answer this status with `body` (default: a short text)
    body: bytes | None = None  # raw body to send (with status 200 unless `status` is set)
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # sleep first (longer than the client's timeout = a timeout fault)


FaultPlan = Callable[[int, RewardRequest], Fault | None]
ScoreFn = Callable[[RewardRequest], list[float | None]]


def score_by_length(request: RewardRequest) -> list[float | None]:
    """Default scorer: the completion's length, so tests can predict every reward."""
    return [float(len(item.completion)) for item in request.items]


@dataclass
class Seen:
    """One verified request as the server saw it."""

    headers: dict[str, str]
    body: bytes
    request: RewardRequest
    number: int


class RewardServer:
    """A reward endpoint on 127.0.0.1:<port> serving POST on any path."""

    def __init__(
        self,
        secret: str,
        *,
        score: ScoreFn = score_by_length,
        faults: FaultPlan | None = None,
        latency_s: float = 0.0,
    ) -> None:
        self.secret = secret
        self.score = score
        self.faults = faults
        self.latency_s = latency_s
        self.seen: list[Seen] = []
        self.rejected: list[str] = []  # reasons of requests that failed verification
        self.received = 0  # every request, verified or not
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/score"

    async def _handle(self, request: Request) -> Response:
        body = await request.body()
        with self._lock:
            self.received += 1
            number = self.received
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            try:
                parsed = verify_and_parse(self.secret, request.headers, body)
            except RewardRequestRejected as exc:
                self.rejected.append(str(exc))
                return JSONResponse({"error": str(exc)}, status_code=exc.status)
            self.seen.append(Seen(dict(request.headers), body, parsed, number))
            fault = self.faults(number, parsed) if self.faults else None
            delay = self.latency_s + (fault.delay_s if fault else 0.0)
            if delay:
                await asyncio.sleep(delay)
            if fault and (fault.status is not None or fault.body is not None):
                status = fault.status if fault.status is not None else 200
                content = fault.body if fault.body is not None else f"injected {status}".encode()
                return Response(
                    content, status_code=status, headers=fault.headers, media_type="application/json"
                )
            return Response(encode_response(self.score(parsed)), media_type="application/json")
        finally:
            with self._lock:
                self.in_flight -= 1

    def start(self) -> RewardServer:
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["POST"])])
        self._server, self._thread, self.port = start_uvicorn(app, port=self.port)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            stop_uvicorn(self._server, self._thread)
        self._server = None
        self._thread = None


def start_uvicorn(app: Any, *, port: int = 0, **options: Any) -> tuple[uvicorn.Server, threading.Thread, int]:
    """Serve the ASGI `app` on 127.0.0.1:`port` (0 = any free port) in a daemon thread; wait until it listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("reward server did not start")
        time.sleep(0.01)
    return server, thread, port


def stop_uvicorn(server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(timeout=10)


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """Serve `app` on loopback for the duration; yields its base URL."""
    server, thread, port = start_uvicorn(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_uvicorn(server, thread)


@contextmanager
def running(server: RewardServer) -> Iterator[RewardServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


def closed_port() -> int:
    """A loopback port with nothing listening (connection refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
