"""Incremental multipart/form-data reading for dataset uploads.

Starlette's form parser spools the whole upload to a temporary file before the route runs, so a size
limit could only be enforced after receiving everything. This reader parses the request stream as it
arrives and hands the `file` part to a `DatasetIngest` in bounded batches (on a worker thread: storage
writes and JSON validation block), so an over-limit upload is refused as soon as it passes the limit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from service.datasets.ingest import DatasetIngest
from service.kit.errors import PayloadTooLarge, ValidationFailed

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

FILE_FIELD = "file"
NAME_FIELD = "name"
MAX_NAME_BYTES = 1024
# Slack over the dataset limit for the multipart framing and the small `name` field.
FRAMING_ALLOWANCE = 64 * 1024
# File bytes collected before a hop to the worker thread (bounds memory and thread switches alike).
BATCH_BYTES = 1024 * 1024


def _invalid(message: str, fld: str = FILE_FIELD) -> ValidationFailed:
    return ValidationFailed(message, details=[{"field": fld, "message": message}])


def multipart_boundary(content_type: str | None) -> bytes:
    """The boundary of a multipart/form-data Content-Type, or ValidationFailed."""
    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise _invalid("the request body must be multipart/form-data with a 'file' field (JSONL)")
    return boundary


def check_content_length(content_length: str | None, max_bytes: int) -> None:
    """Refuse before reading anything when the declared body is already far past the limit."""
    if content_length and content_length.isdigit() and int(content_length) > max_bytes + FRAMING_ALLOWANCE:
        raise PayloadTooLarge(
            f"dataset exceeds the {max_bytes}-byte limit", details={"limit_bytes": max_bytes}
        )


@dataclass
class _Parts:
    """Parser callback state: which part we are in and what it produced."""

    header_field: bytearray = field(default_factory=bytearray)
    header_value: bytearray = field(default_factory=bytearray)
    current: str | None = None
    filename: str | None = None
    name: bytearray = field(default_factory=bytearray)
    seen: set[str] = field(default_factory=set)
    pending: list[bytes] = field(default_factory=list)
    pending_bytes: int = 0
    error: ValidationFailed | None = None
    extra_fields: frozenset[str] = frozenset()  # more short text fields a caller accepts (OpenAI's `purpose`)
    extra: dict[str, bytearray] = field(default_factory=dict)

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda data, start, end: self.header_field.extend(data[start:end]),
            "on_header_value": lambda data, start, end: self.header_value.extend(data[start:end]),
            "on_header_end": self._header_end,
            "on_part_data": self._part_data,
        }

    def _part_begin(self) -> None:
        self.current = None

    def _header_end(self) -> None:
        if self.header_field.decode("latin-1").lower() == "content-disposition":
            _kind, options = parse_options_header(bytes(self.header_value))
            name = options.get(b"name", b"").decode("utf-8", "replace")
            if name not in (FILE_FIELD, NAME_FIELD, *self.extra_fields):
                self.error = self.error or _invalid(f"unexpected form field {name!r}", name or "form")
            elif name in self.seen:
                self.error = self.error or _invalid(f"form field {name!r} given twice", name)
            else:
                self.seen.add(name)
                self.current = name
                if name in self.extra_fields:
                    self.extra[name] = bytearray()
                if name == FILE_FIELD and b"filename" in options:
                    self.filename = options[b"filename"].decode("utf-8", "replace")
        self.header_field.clear()
        self.header_value.clear()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self.current == FILE_FIELD:
            self.pending.append(bytes(data[start:end]))
            self.pending_bytes += end - start
        elif self.current is not None:
            value = self.name if self.current == NAME_FIELD else self.extra[self.current]
            value.extend(data[start:end])
            if len(value) > MAX_NAME_BYTES:
                self.error = self.error or _invalid(
                    f"{self.current!r} is longer than {MAX_NAME_BYTES} bytes", self.current
                )

    def take_pending(self) -> list[bytes]:
        chunks, self.pending, self.pending_bytes = self.pending, [], 0
        return chunks


def _feed_all(ingest: DatasetIngest, chunks: list[bytes]) -> None:
    for chunk in chunks:
        ingest.feed(chunk)


@dataclass(frozen=True)
class UploadForm:
    name: str | None  # the `name` field, else None
    filename: str | None  # the file part's filename, else None
    extra: dict[str, str] = field(default_factory=dict)  # the extra text fields given




async def read_upload(
    stream: AsyncIterator[bytes], boundary: bytes, ingest: DatasetIngest, *, extra_fields: frozenset[str] = frozenset()
) -> UploadForm:
    """Parse the body, streaming the `file` part into `ingest`. The caller aborts `ingest` on error."""
    parts = _Parts(extra_fields=extra_fields)
    parser = MultipartParser(boundary, parts.callbacks())
    try:
        async for chunk in stream:
            parser.write(chunk)
            if parts.error:
                raise parts.error
            if parts.pending_bytes >= BATCH_BYTES:
                await run_in_threadpool(_feed_all, ingest, parts.take_pending())
        parser.finalize()
    except MultipartParseError as exc:
        raise _invalid(f"malformed multipart body: {exc}") from exc
    if parts.error:
        raise parts.error
    if parts.pending:
        await run_in_threadpool(_feed_all, ingest, parts.take_pending())
    if FILE_FIELD not in parts.seen:
        raise _invalid("the form has no 'file' field")
    name = parts.name.decode("utf-8", "replace") if NAME_FIELD in parts.seen else None
    extra = {k: v.decode("utf-8", "replace") for k, v in parts.extra.items()}
    return UploadForm(name=name, filename=parts.filename, extra=extra)
