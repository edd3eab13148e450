"""One blob store for datasets and checkpoints (fsspec: a local directory by default, `s3://bucket/prefix`).

Keys are relative, '/'-separated and built by the server from ids (`dataset_key`, `checkpoint_key`),
never from user input; `Storage` still refuses any key that could escape its root ('..', absolute
paths, backslashes, empty segments) as a second line of defence.
Workers on other machines write checkpoints with the same class pointed at the same URL (s3://...).
"""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Iterable
from functools import lru_cache
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from service.kit.config import get_settings


class InvalidStorageKey(ValueError):
    """A key that is not a plain relative path under the storage root."""


def validate_key(key: str) -> str:
    """Return `key` if it is a safe relative key, else raise InvalidStorageKey."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key or ":" in key.split("/", 1)[0]:
        raise InvalidStorageKey(f"storage key {key!r} must be a relative path")
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise InvalidStorageKey(f"storage key {key!r} has an empty, '.' or '..' segment")
    return key


def dataset_key(dataset_id: str) -> str:
    return validate_key(f"datasets/{dataset_id}.jsonl")


def job_prefix(job_id: str) -> str:
    """Everything a job wrote: its checkpoints and TensorBoard files."""
    return validate_key(f"checkpoints/{job_id}")


def checkpoint_prefix(job_id: str, checkpoint_id: str) -> str:
    return validate_key(f"checkpoints/{job_id}/{checkpoint_id}")


def checkpoint_key(job_id: str, checkpoint_id: str, relative_path: str) -> str:
    """A file of a checkpoint; `relative_path` comes from the worker-written manifest, validated here."""
    return validate_key(f"{checkpoint_prefix(job_id, checkpoint_id)}/{relative_path}")


def tensorboard_key(job_id: str, relative_path: str) -> str:
    """A TensorBoard event file of a job, stored next to its checkpoints."""
    return validate_key(f"checkpoints/{job_id}/tensorboard/{relative_path}")


def primitive_weights_prefix(tenant_id: str, token: str) -> str:
    """Weights a training client of the primitive API saved (`token`: fresh per save, chosen by the worker)."""
    return validate_key(f"primitives/{tenant_id}/{token}")


class Storage:
    """Blob operations on keys relative to one root URL."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)
        if self._local:
            self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return f"{self.root}/{validate_key(key)}"

    def put_stream(self, key: str, chunks: Iterable[bytes]) -> int:
        """Write `chunks` to `key` one at a time (never joined in memory); returns the byte count."""
        writer = self.begin_put(key)
        try:
            for chunk in chunks:
                writer.write(chunk)
        except BaseException:
            writer.abort()
            raise
        writer.commit()
        return writer.written

    def begin_put(self, key: str) -> BlobWriter:
        """A push-style writer for `key`: `write()` chunks, then `commit()` (or `abort()`)."""
        return BlobWriter(self, key)

    def open(self, key: str) -> IO[bytes]:
        """A seekable binary reader (Range requests seek, then read)."""
        handle: IO[bytes] = self.fs.open(self._path(key), "rb")
        return handle

    def size(self, key: str) -> int:
        return int(self.fs.size(self._path(key)))

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(key)))

    def delete(self, key: str) -> None:
        """Delete a key, or every key under it if it is a prefix. Missing keys are not an error."""
        path = self._path(key)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=self.fs.isdir(path))

    def list(self, prefix: str) -> list[str]:
        """Every key under `prefix` (recursively), relative to the root, sorted."""
        base = self._path(prefix)
        if not self.fs.exists(base):
            return []
        found = self.fs.find(base)
        root = self.fs._strip_protocol(self.root).rstrip("/")
        keys = []
        for path in found:
            stripped = self.fs._strip_protocol(path)
            keys.append(posixpath.relpath(stripped, root))
        return sorted(keys)


class BlobWriter:
    """Writes one key incrementally. Readers never see half a blob.

    Local files are written under a temporary name and renamed on commit; on object stores the
    object only appears when the (multipart) upload completes, and abort removes what was written.
    """

    def __init__(self, storage: Storage, key: str) -> None:
        self._fs = storage.fs
        self._local = storage._local
        self._path = storage._path(key)
        self._target = f"{self._path}.partial-{uuid.uuid4().hex}" if self._local else self._path
        if self._local:
            self._fs.makedirs(posixpath.dirname(self._path), exist_ok=True)
        self._handle: IO[bytes] = self._fs.open(self._target, "wb")
        self.written = 0

    def write(self, chunk: bytes) -> None:
        self._handle.write(chunk)
        self.written += len(chunk)

    def commit(self) -> None:
        self._handle.close()
        if self._local:
            self._fs.mv(self._target, self._path)

    def abort(self) -> None:
        if not self._handle.closed:
            self._handle.close()
        if self._fs.exists(self._target):
            self._fs.rm(self._target)


@lru_cache
def _storage_for(url: str) -> Storage:
    return Storage(url)


def get_storage() -> Storage:
    """The configured storage (settings.storage_url), shared per URL."""
    return _storage_for(get_settings().storage_url)
