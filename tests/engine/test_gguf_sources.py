"""Which local model sources are GGUF files (worker.grpo.pretrained.gguf_file_of): converted before loading,
or refused with a reason when the gguf package is missing. Everything else goes to from_pretrained unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from worker.grpo.model_paths import resolve_model_path
from worker.grpo.pretrained import GGUFUnavailable, convert_local_gguf, gguf_file_of

HEADER = b"GGUF" + (3).to_bytes(4, "little") + bytes(16)


def test_a_gguf_file_or_a_folder_holding_only_one(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(HEADER)
    assert gguf_file_of(tmp_path / "model.gguf") == tmp_path / "model.gguf"
    assert gguf_file_of(tmp_path) == tmp_path / "model.gguf"
    # The magic decides, not the name.
    (tmp_path / "renamed.bin").write_bytes(HEADER)
    assert gguf_file_of(tmp_path / "renamed.bin") == tmp_path / "renamed.bin"


def test_other_sources_are_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file")
    assert gguf_file_of(tmp_path / "fake.gguf") is None
    assert gguf_file_of(tmp_path) is None  # its only .gguf is not one
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.gguf").write_bytes(HEADER)
    assert gguf_file_of(model) is None  # an ordinary model directory (config.json) is loaded as such
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(HEADER)
    (two / "b.gguf").write_bytes(HEADER)
    assert gguf_file_of(two) is None  # which one? from_pretrained gets the folder and says why not
    assert gguf_file_of(tmp_path / "missing") is None
    assert resolve_model_path("org/name", tmp_path / "cache") == "org/name"
    assert resolve_model_path(str(model), tmp_path / "cache") == str(model)


def test_without_the_gguf_package_the_reason_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # what an interpreter without the package reports
    (tmp_path / "model.gguf").write_bytes(HEADER)
    with pytest.raises(GGUFUnavailable, match="^GGUF needs the gguf package on the worker$"):
        resolve_model_path(str(tmp_path / "model.gguf"), tmp_path / "cache")
    with pytest.raises(GGUFUnavailable):
        convert_local_gguf(tmp_path / "model.gguf", tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
