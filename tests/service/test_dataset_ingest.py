"""DatasetIngest and the multipart helpers as units (storage on fsspec's in-memory filesystem)."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from service.datasets import ingest as ingest_module
from service.datasets.errors import DatasetInvalid
from service.datasets.ingest import DatasetIngest
from service.datasets.multipart import check_content_length, multipart_boundary
from service.kit.errors import PayloadTooLarge, ValidationFailed
from service.storage import Storage


@pytest.fixture
def storage() -> Storage:
    return Storage(f"memory://ingest-{uuid.uuid4().hex}")


def test_lines_split_across_chunks_are_validated_whole(storage: Storage) -> None:
    data = b'{"prompt": "a", "x": 1}\r\n{"prompt": [{"role": "user", "content": "b"}]}\n\n{"prompt": "c"}'
    ingest = DatasetIngest(storage, "ds_1", max_bytes=1000)
    for i in range(0, len(data), 3):  # chunk boundaries everywhere, CRLF included
        ingest.feed(data[i : i + 3])
    result = ingest.finish()
    assert (result.num_rows, result.bytes, result.columns) == (3, len(data), ["prompt", "x"])
    assert result.sha256 == hashlib.sha256(data).hexdigest()
    with storage.open("datasets/ds_1.jsonl") as handle:
        assert handle.read() == data


def test_limit_is_enforced_on_the_chunk_that_passes_it(storage: Storage) -> None:
    ingest = DatasetIngest(storage, "ds_2", max_bytes=10)
    ingest.feed(b'{"prompt"')
    with pytest.raises(PayloadTooLarge):
        ingest.feed(b': "x"}\n')
    assert storage.list("datasets") == []


def test_overlong_line_is_refused_without_buffering_it(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingest_module, "MAX_LINE_BYTES", 100)
    ingest = DatasetIngest(storage, "ds_3", max_bytes=10_000)
    ingest.feed(b'{"prompt": "ok"}\n')
    with pytest.raises(DatasetInvalid) as caught:
        ingest.feed(b'{"prompt": "' + b"x" * 200)
    assert caught.value.details == [{"line": 2, "error": "line longer than 100 bytes"}]
    assert storage.list("datasets") == []


def test_content_length_far_over_the_limit_is_refused_up_front() -> None:
    check_content_length("1000", max_bytes=1000)
    check_content_length(None, max_bytes=1000)
    with pytest.raises(PayloadTooLarge):
        check_content_length(str(10**12), max_bytes=1000)


@pytest.mark.parametrize(
    "content_type", [None, "application/json", "multipart/form-data", "text/plain; boundary=x"]
)
def test_only_multipart_with_a_boundary_is_accepted(content_type: str | None) -> None:
    with pytest.raises(ValidationFailed):
        multipart_boundary(content_type)
    assert multipart_boundary("multipart/form-data; boundary=abc") == b"abc"
