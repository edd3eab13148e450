"""Byte streaming for checkpoint downloads: single HTTP ranges and a tar archive built on the fly.

Both read storage in CHUNK-sized pieces and never hold a whole file: memory stays constant
whatever the checkpoint's size.
"""

from __future__ import annotations

import logging
import re
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO

from service.kit.errors import DomainError
from service.storage import Storage

CHUNK = 1024 * 1024
BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 10240: tar files are padded to whole records, as tarfile does

log = logging.getLogger(__name__)


class RangeNotSatisfiable(DomainError):
    code = "range_not_satisfiable"
    http_status = 416

    def __init__(self, size: int) -> None:
        super().__init__(f"the requested range is outside the file's {size} bytes", details={"size": size})
        self.size = size


@dataclass(frozen=True)
class ByteRange:
    start: int
    end: int  # inclusive

    @property
    def length(self) -> int:
        return self.end - self.start + 1

    def content_range(self, size: int) -> str:
        return f"bytes {self.start}-{self.end}/{size}"


# One range, ASCII digits only, at most 19 of them (every offset below 10**19 fits; `int()` of a longer run
# is slow and, past 4300 digits, an error). `str.isdigit` would accept "²" or "٣", which `int` refuses.
_RANGE = re.compile(r"bytes=(?:([0-9]{1,19})-([0-9]{0,19})|-([0-9]{1,19}))", re.ASCII | re.IGNORECASE)


def parse_range(header: str | None, size: int) -> ByteRange | None:
    """One `Range: bytes=...` spec -> the bytes to send; None = send the whole file.

    Follows RFC 9110 §14: a header that is not a single well-formed byte range is ignored (full
    200 response; multipart ranges are not supported); a well-formed range that starts past the end
    (or a zero-length suffix) raises RangeNotSatisfiable (416).
    """
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first, last, suffix = match.groups()
    if suffix is not None:  # the last N bytes
        if int(suffix) == 0 or size == 0:
            raise RangeNotSatisfiable(size)
        return ByteRange(max(0, size - int(suffix)), size - 1)
    start = int(first)
    if last and int(last) < start:
        return None  # invalid spec: ignored
    if start >= size:
        raise RangeNotSatisfiable(size)
    end = int(last) if last else size - 1
    return ByteRange(start, min(end, size - 1))


def iter_file(handle: IO[bytes], start: int, length: int) -> Iterator[bytes]:
    """`length` bytes of an already open file from `start`; closes it when done (or abandoned)."""
    try:
        handle.seek(start)
        remaining = length
        while remaining > 0:
            chunk = handle.read(min(CHUNK, remaining))
            if not chunk:
                raise OSError(f"file ended {remaining} bytes early")
            remaining -= len(chunk)
            yield chunk
    finally:
        handle.close()


# --- tar ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TarMember:
    name: str  # path inside the archive
    key: str  # storage key
    size: int


def _header(member: TarMember, mtime: float) -> bytes:
    info = tarfile.TarInfo(member.name)
    info.size = member.size
    info.mtime = int(mtime)
    info.mode = 0o644
    info.type = tarfile.REGTYPE
    # PAX: long and non-ASCII names get an extended header instead of being truncated.
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def _padding(size: int) -> int:
    return -size % BLOCK


def tar_plan(members: Sequence[TarMember], mtime: float) -> tuple[list[bytes], int]:
    """Headers of every member and the archive's exact length (for Content-Length)."""
    headers = [_header(member, mtime) for member in members]
    body = sum(len(h) + m.size + _padding(m.size) for h, m in zip(headers, members, strict=True))
    body += 2 * BLOCK  # end-of-archive marker
    return headers, body + (-body % RECORD)


def iter_tar(
    storage: Storage, members: Sequence[TarMember], headers: Sequence[bytes], total: int
) -> Iterator[bytes]:
    """The archive, member by member: header, the file read in chunks, zero padding, end marker."""
    sent = 0
    for member, header in zip(members, headers, strict=True):
        yield header
        sent += len(header)
        copied = 0
        for chunk in iter_file(storage.open(member.key), 0, member.size):
            copied += len(chunk)
            yield chunk
        sent += copied
        pad = _padding(member.size)
        if pad:
            yield b"\0" * pad
            sent += pad
    yield b"\0" * (total - sent)


def archive_name(checkpoint_id: str) -> str:
    return f"{checkpoint_id}.tar"
