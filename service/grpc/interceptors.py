"""Server interceptors: error rendering and authentication around every call.

grpc.aio interceptors only see the call's method name and metadata, not the request or the servicer's
exceptions, so each interceptor wraps the handler's behaviour in an async context manager
(`rendered_errors`, `authenticated`). The error interceptor is installed first so it is outermost and
also renders authentication failures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

from service.grpc.auth import authenticated, bearer_token, peer_address
from service.grpc.errors import rendered_errors
from service.grpc.scopes import METHOD_SCOPES
from service.tenants.scopes import Scope

Context = grpc.aio.ServicerContext[Any, Any]
# Builds the context manager a call runs inside, given that call's context.
Around = Callable[[Context], AbstractAsyncContextManager[Any]]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]

# Standard services every client (and load balancer) may call without a key.
PUBLIC_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def wrap_handler(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """The same handler with each call's behaviour running inside `around(context)`."""
    if handler.unary_unary is not None:
        unary_unary: Any = handler.unary_unary  # typed as sync by types-grpcio; async on an aio server

        async def uu(request: Any, context: Context) -> Any:
            async with around(context):
                return await unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(uu, handler.request_deserializer, handler.response_serializer)
    if handler.stream_unary is not None:
        stream_unary: Any = handler.stream_unary  # typed as sync by types-grpcio; async on an aio server

        async def su(requests: AsyncIterator[Any], context: Context) -> Any:
            async with around(context):
                return await stream_unary(requests, context)

        return grpc.stream_unary_rpc_method_handler(su, handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream is not None:
        unary_stream: Any = handler.unary_stream  # typed as sync by types-grpcio; async on an aio server

        async def us(request: Any, context: Context) -> AsyncIterator[Any]:
            async with around(context):
                async for response in unary_stream(request, context):
                    yield response

        return grpc.unary_stream_rpc_method_handler(us, handler.request_deserializer, handler.response_serializer)
    stream_stream: Any = handler.stream_stream
    assert stream_stream is not None

    async def ss(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        async with around(context):
            async for response in stream_stream(requests, context):
                yield response

    return grpc.stream_stream_rpc_method_handler(ss, handler.request_deserializer, handler.response_serializer)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Renders DomainError / pydantic ValidationError / bugs as statuses (service.grpc.errors)."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        return None if handler is None else wrap_handler(handler, rendered_errors)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <key>` on every call except health and reflection; same keys as REST. The key
    must have the scope `scopes` names for the method (service.grpc.scopes); a method missing there is
    refused with any key (PERMISSION_DENIED), never let through."""

    def __init__(self, scopes: Mapping[str, Scope] = METHOD_SCOPES) -> None:
        self._scopes = scopes

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(PUBLIC_METHOD_PREFIXES):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        scope = self._scopes.get(method)
        return wrap_handler(handler, lambda context: authenticated(token, peer_address(context.peer()), scope))
