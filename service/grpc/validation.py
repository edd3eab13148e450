"""Request checks every RPC gets, the gRPC twin of REST's field types (contract.fields).

- Text: no string field of a request, at any depth, may contain NUL (PostgreSQL text cannot hold it). One
  interceptor walks each request message, so ids, page tokens, names and filters are covered in every RPC,
  present and future, and the error names the field (`grpo-error-field`).
- Steps: int64 in the protocol, INTEGER in the database; `int32_field` bounds them where an RPC reads one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from contract.fields import INT32_MAX
from service.grpc.interceptors import Continuation
from service.kit.errors import ValidationFailed

Context = grpc.aio.ServicerContext[Any, Any]


def nul_field(message: Message, prefix: str = "") -> str | None:
    """The dotted path of the first string field containing NUL, or None."""
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        repeated = field.is_repeated
        entry = field.message_type  # set for message fields; a map field's is its entry type
        if entry is not None and entry.GetOptions().map_entry:
            found = _nul_in_map(entry.fields_by_name["value"], value, path)
        elif entry is not None:
            found = None
            for index, item in enumerate(value if repeated else [value]):
                found = nul_field(item, f"{path}.{index}." if repeated else f"{path}.")
                if found is not None:
                    break
        elif field.type == FieldDescriptor.TYPE_STRING:
            found = next(
                (f"{path}.{i}" if repeated else path for i, text in enumerate(value if repeated else [value])
                 if "\x00" in text),
                None,
            )
        else:
            continue
        if found is not None:
            return found
    return None


def _nul_in_map(value_field: FieldDescriptor, entries: Any, path: str) -> str | None:
    for key, value in entries.items():
        if isinstance(key, str) and "\x00" in key:
            return path
        if value_field.type == FieldDescriptor.TYPE_STRING and "\x00" in value:
            return f"{path}.{key}"
        if value_field.type == FieldDescriptor.TYPE_MESSAGE:
            found = nul_field(value, f"{path}.{key}.")
            if found is not None:
                return found
    return None


def check_text(message: Message) -> None:
    path = nul_field(message)
    if path is not None:
        text = "must not contain NUL (U+0000) characters"
        raise ValidationFailed(f"{path}: {text}", details=[{"field": path, "message": text}])


def int32_field(value: int, field: str) -> int:
    """An int64 request field that the database keeps in an INTEGER column (steps): outside INTEGER's range
    it is INVALID_ARGUMENT naming the field."""
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        text = f"must be between {-INT32_MAX - 1} and {INT32_MAX}"
        raise ValidationFailed(f"{field}: {text}", details=[{"field": field, "message": text}])
    return value


async def _checked_stream(requests: AsyncIterator[Message]) -> AsyncIterator[Message]:
    async for request in requests:
        check_text(request)
        yield request


def checked_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler with `check_text` run on every request message before the servicer sees it."""
    if handler.unary_unary is not None:
        unary_unary: Any = handler.unary_unary  # typed as sync by types-grpcio; async on an aio server

        async def uu(request: Message, context: Context) -> Any:
            check_text(request)
            return await unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(uu, handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream is not None:
        unary_stream: Any = handler.unary_stream

        async def us(request: Message, context: Context) -> AsyncIterator[Any]:
            check_text(request)
            async for response in unary_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(us, handler.request_deserializer, handler.response_serializer)
    if handler.stream_unary is not None:
        stream_unary: Any = handler.stream_unary

        async def su(requests: AsyncIterator[Message], context: Context) -> Any:
            return await stream_unary(_checked_stream(requests), context)

        return grpc.stream_unary_rpc_method_handler(su, handler.request_deserializer, handler.response_serializer)
    stream_stream: Any = handler.stream_stream
    assert stream_stream is not None

    async def ss(requests: AsyncIterator[Message], context: Context) -> AsyncIterator[Any]:
        async for response in stream_stream(_checked_stream(requests), context):
            yield response

    return grpc.stream_stream_rpc_method_handler(ss, handler.request_deserializer, handler.response_serializer)


class TextInterceptor(grpc.aio.ServerInterceptor):
    """Runs `check_text` on every request (installed inside the error and auth interceptors)."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        return None if handler is None else checked_handler(handler)
