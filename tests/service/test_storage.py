"""service.storage: keys, streaming put, seekable reads, list/delete, on a local dir and a non-local fs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.storage import InvalidStorageKey, Storage, checkpoint_key, dataset_key, validate_key


@pytest.fixture(params=["local", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(str(tmp_path / "store"))
    # fsspec's in-memory filesystem stands in for s3: the non-local code path, same API.
    return Storage(f"memory://grpo-{uuid.uuid4().hex}")


def _chunks(total: int, size: int) -> Iterator[bytes]:
    for start in range(0, total, size):
        yield bytes((start + i) % 251 for i in range(min(size, total - start)))


class TestKeys:
    @pytest.mark.parametrize(
        "key",
        ["", "/etc/passwd", "../x", "a/../../b", "a/./b", "a//b", "a\\b", "c:/x", "a/", "a/..", "x\x00y"],
    )
    def test_unsafe_keys_are_refused(self, key: str) -> None:
        with pytest.raises(InvalidStorageKey):
            validate_key(key)

    def test_keys_are_built_from_ids(self) -> None:
        assert dataset_key("ds_01ABC") == "datasets/ds_01ABC.jsonl"
        assert checkpoint_key("job_1", "ckpt_2", "adapter/model.safetensors") == (
            "checkpoints/job_1/ckpt_2/adapter/model.safetensors"
        )
        with pytest.raises(InvalidStorageKey):
            checkpoint_key("job_1", "ckpt_2", "../../datasets/ds_x.jsonl")

    def test_storage_refuses_unsafe_keys(self, storage: Storage) -> None:
        for call in (storage.open, storage.exists, storage.size, storage.delete):
            with pytest.raises(InvalidStorageKey):
                call("../outside")


class TestBlobs:
    def test_put_stream_then_read_with_seek(self, storage: Storage) -> None:
        expected = b"".join(_chunks(300_000, 65_536))
        written = storage.put_stream("datasets/ds_1.jsonl", _chunks(300_000, 65_536))
        assert written == len(expected) == storage.size("datasets/ds_1.jsonl")
        assert storage.exists("datasets/ds_1.jsonl")
        with storage.open("datasets/ds_1.jsonl") as handle:
            handle.seek(123_457)
            assert handle.read(1000) == expected[123_457:124_457]

    def test_list_and_delete(self, storage: Storage) -> None:
        for name in ("a.bin", "sub/b.bin"):
            storage.put_stream(f"checkpoints/job_1/ckpt_1/{name}", [b"x"])
        storage.put_stream("checkpoints/job_1/ckpt_2/c.bin", [b"y"])
        assert storage.list("checkpoints/job_1/ckpt_1") == [
            "checkpoints/job_1/ckpt_1/a.bin",
            "checkpoints/job_1/ckpt_1/sub/b.bin",
        ]
        storage.delete("checkpoints/job_1/ckpt_1")
        assert storage.list("checkpoints/job_1/ckpt_1") == []
        assert storage.exists("checkpoints/job_1/ckpt_2/c.bin")
        storage.delete("checkpoints/job_1/ckpt_1")  # missing: no error
        assert storage.list("nothing/here") == []

    def test_failed_stream_leaves_nothing(self, storage: Storage) -> None:
        def broken() -> Iterator[bytes]:
            yield b"partial"
            raise RuntimeError("client went away")

        with pytest.raises(RuntimeError):
            storage.put_stream("datasets/ds_2.jsonl", broken())
        assert not storage.exists("datasets/ds_2.jsonl")
        assert storage.list("datasets") == []


def test_s3_urls_select_s3fs() -> None:
    # No S3 endpoint here: check only that s3:// resolves to s3fs with the bucket/prefix as root.
    storage = Storage("s3://my-bucket/grpo", anon=True)
    assert type(storage.fs).__name__ == "S3FileSystem"
    assert storage.root == "my-bucket/grpo"
