"""Streaming dataset ingestion: bytes in, one pass, constant memory.

Each chunk is size-checked, hashed, written to storage and split into lines that are validated with the
engine's own rules (`contract.dataset_format`), so a dataset the service accepts never fails later in
a job. Transport-free: the REST multipart reader and the gRPC upload stream both feed it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from contract.dataset_format import DatasetIssue, JsonlValidator
from service.datasets.errors import DatasetInvalid
from service.kit.errors import PayloadTooLarge
from service.storage import Storage, dataset_key

# One line is held in memory while it is being completed; longer lines are refused rather than buffered.
MAX_LINE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class IngestResult:
    storage_key: str
    bytes: int
    sha256: str
    num_rows: int
    columns: list[str]


def _problems(issues: list[DatasetIssue]) -> list[dict[str, object]]:
    return [{"line": issue.line or None, "error": issue.message} for issue in issues]


class DatasetIngest:
    """Feed chunks with `feed`, then `finish` (commits the blob) or `abort` (removes it)."""

    def __init__(self, storage: Storage, dataset_id: str, max_bytes: int) -> None:
        self.dataset_id = dataset_id
        self.storage_key = dataset_key(dataset_id)
        self._max_bytes = max_bytes
        self._writer = storage.begin_put(self.storage_key)
        self._sha256 = hashlib.sha256()
        self._validator = JsonlValidator()
        self._partial_line = bytearray()
        self._bytes = 0
        self._done = False

    @property
    def bytes_received(self) -> int:
        return self._bytes

    def feed(self, chunk: bytes) -> None:
        """Take the next chunk. Raises PayloadTooLarge past the limit, DatasetInvalid for an overlong line."""
        self._bytes += len(chunk)
        if self._bytes > self._max_bytes:
            self.abort()
            raise PayloadTooLarge(
                f"dataset exceeds the {self._max_bytes}-byte limit", details={"limit_bytes": self._max_bytes}
            )
        self._sha256.update(chunk)
        self._writer.write(chunk)
        self._split_lines(chunk)

    def _split_lines(self, chunk: bytes) -> None:
        buffer = self._partial_line
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", start)) != -1:
            self._validator.feed(bytes(buffer[start:end]))
            start = end + 1
        del buffer[:start]
        if len(buffer) > MAX_LINE_BYTES:
            line = self._validator.line_number + 1
            issues = [
                *self._validator.summary.errors,
                DatasetIssue(line, f"line longer than {MAX_LINE_BYTES} bytes"),
            ]
            self.abort()
            raise DatasetInvalid(_problems(issues), self._validator.summary.num_errors + 1)

    def finish(self) -> IngestResult:
        """Validate the last line and the whole; commit the blob. Raises DatasetInvalid (blob removed)."""
        if self._partial_line:
            self._validator.feed(bytes(self._partial_line))
            self._partial_line.clear()
        summary = self._validator.finish()
        if not summary.ok:
            self.abort()
            raise DatasetInvalid(_problems(summary.errors), summary.num_errors)
        self._writer.commit()
        self._done = True
        return IngestResult(
            storage_key=self.storage_key,
            bytes=self._bytes,
            sha256=self._sha256.hexdigest(),
            num_rows=summary.num_rows,
            columns=list(summary.columns),
        )

    def abort(self) -> None:
        """Drop what was written (idempotent)."""
        if not self._done:
            self._done = True
            self._writer.abort()
