"""The grpc.aio server: domain servicers, health checking (grpc.health.v1) and reflection.

`grpo serve` runs `serve_grpc(settings.grpc_port)` next to uvicorn on the same event loop; tests use
`running_grpc(0)`, or call `create_grpc_server(0)` and start it themselves.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.grpc import servicers
from service.grpc.interceptors import AuthInterceptor, ErrorInterceptor
from service.grpc.scopes import check_scopes_declared
from service.grpc.validation import TextInterceptor
from service.kit.config import get_settings
from service.kit.heap import startup_objects_frozen
from service.kit.reads import THREADED_READS, Reads, open_reads
from service.tenants.ratelimit import close_buckets
from service.webhooks import outbox

log = logging.getLogger(__name__)

# Large enough for a 4 MiB upload/download chunk plus framing.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# The smallest receive limit: an upload chunk (up to 4 MiB) plus framing must always fit.
MIN_RECEIVE_BYTES = 5 * 1024 * 1024


def max_receive_bytes() -> int:
    """The largest message a client may send: the REST body limit, but never below an upload chunk. A larger
    message is refused by gRPC itself (RESOURCE_EXHAUSTED) from its length prefix, before it is buffered."""
    return max(get_settings().max_request_body_bytes, MIN_RECEIVE_BYTES)


async def create_grpc_server(
    port: int, host: str = "127.0.0.1", *, reads: Reads = THREADED_READS
) -> tuple[grpc.aio.Server, int]:
    """A configured, not yet started server bound to host:port (0 = any free port) and the port it got.

    Async because grpc.aio binds the server to the running event loop. `reads` runs the polled job reads;
    `running_grpc` opens the configured one (the asyncpg pool on PostgreSQL) and closes it with the server.
    """
    outbox.register()  # job events written by this process are announced (service.webhooks.outbox)
    server = grpc.aio.server(
        # Outermost first: errors wraps auth so an invalid key is rendered as UNAUTHENTICATED; requests are
        # checked once authenticated.
        interceptors=[ErrorInterceptor(), AuthInterceptor(), TextInterceptor()],
        options=[
            ("grpc.max_receive_message_length", max_receive_bytes()),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    service_names = servicers.register_all(server, reads)
    check_scopes_declared(descriptor_pool.Default().FindServiceByName(name) for name in service_names)

    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *service_names):  # "" is the overall server status
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the gRPC server to {host}:{port}")
    return server, bound


@asynccontextmanager
async def running_grpc(port: int, host: str = "127.0.0.1") -> AsyncIterator[tuple[grpc.aio.Server, int]]:
    """A started server with the configured reads (see `service.app`'s lifespan); yields it and its port, then
    stops it (short grace period) and closes the reads."""
    settings = get_settings()
    reads = await open_reads(settings)
    try:
        server, bound = await create_grpc_server(port, host, reads=reads)
        await server.start()
        try:
            with startup_objects_frozen(settings.gc_freeze):  # see service.kit.heap
                yield server, bound
        finally:
            await server.stop(grace=5)
    finally:
        await reads.close()
        await close_buckets()


async def serve_grpc(port: int, host: str = "127.0.0.1") -> None:
    """Run the gRPC server until cancelled."""
    async with running_grpc(port, host) as (server, bound):
        log.info("gRPC server listening on %s:%d", host, bound)
        await server.wait_for_termination()
