"""The worker's model-source checks (worker.model_sources): the hub size cap before any download, the hub id
that is also a local directory, and generic errors. No network: the hub API is a server on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from service.jobs.model_sources import ModelSourceKind, ModelSourcePolicy
from worker.model_sources import (
    ModelUnavailable,
    check_hub_size,
    check_source,
    download_size,
    hub_file_sizes,
)

GIB = 1024**3


def policy(tmp_path: Path) -> ModelSourcePolicy:
    return ModelSourcePolicy(None, (tmp_path / "data",), ("*",))


class TestDownloadSize:
    def test_counts_one_weight_format_and_the_top_level_config(self) -> None:
        files = [
            ("config.json", 1_000),
            ("tokenizer.json", 2_000),
            ("model-00001-of-00002.safetensors", 5 * GIB),
            ("model-00002-of-00002.safetensors", 3 * GIB),
            ("model.safetensors.index.json", 100),
            ("pytorch_model.bin", 8 * GIB),  # another format of the same weights: not fetched
            ("onnx/model.onnx", 8 * GIB),  # a subfolder: not fetched
            ("README.md", 10),
        ]
        assert download_size(files) == 1_000 + 2_000 + 8 * GIB + 100

    def test_falls_back_to_bin_weights(self) -> None:
        assert download_size([("config.json", 10), ("pytorch_model.bin", 500)]) == 510

    def test_unknown_size_of_a_fetched_file_is_unknown(self) -> None:
        assert download_size([("config.json", 10), ("model.safetensors", None)]) is None


class TestHubSizeCap:
    def test_refused_over_the_cap_before_downloading(self) -> None:
        listing = [("config.json", 10), ("model.safetensors", 2 * GIB)]
        with pytest.raises(ModelUnavailable) as info:
            check_hub_size("base_model", "org/big", GIB, hub_files=lambda _repo: listing)
        assert info.value.code == "model_too_large"
        assert (
            info.value.message
            == "base_model: 'org/big' is larger than this service's limit of 1073741824 bytes"
        )
        check_hub_size("base_model", "org/big", 3 * GIB, hub_files=lambda _repo: listing)

    def test_unknown_sizes_and_listing_failures_are_refusals(self) -> None:
        with pytest.raises(ModelUnavailable) as info:
            check_hub_size("base_model", "org/x", GIB, hub_files=lambda _repo: [("model.safetensors", None)])
        assert info.value.code == "model_too_large"

        def private(_repo: str) -> list[tuple[str, int | None]]:
            raise PermissionError("401 Client Error for url https://huggingface.co/api/models/org/private")

        with pytest.raises(ModelUnavailable) as info:
            check_hub_size("rewards[0].model", "org/private", GIB, hub_files=private)
        assert info.value.code == "model_load_failed"
        assert "401" not in info.value.message and "huggingface.co" not in info.value.message

    def test_offline_workers_skip_the_listing(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        check_hub_size("base_model", "org/any", 1)  # would need the network otherwise

    def test_real_client_against_a_loopback_hub(self, fake_hub: str, monkeypatch: pytest.MonkeyPatch) -> None:
        """huggingface_hub's own model_info request, answered on loopback: the cap applies to what it reports."""
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the "hub" is on loopback
        files = partial(hub_file_sizes, endpoint=fake_hub)
        assert sorted(files("org/big")) == [("config.json", 100), ("model.safetensors", 5 * GIB)]
        with pytest.raises(ModelUnavailable) as info:
            check_hub_size("base_model", "org/big", 4 * GIB, hub_files=files)
        assert info.value.code == "model_too_large"
        check_hub_size("base_model", "org/big", 6 * GIB, hub_files=files)
        with pytest.raises(ModelUnavailable) as info:
            check_hub_size("base_model", "org/missing", 6 * GIB, hub_files=files)
        assert info.value.code == "model_load_failed"


@pytest.fixture
def fake_hub() -> Iterator[str]:
    """GET /api/models/<org>/<name>[/revision/<rev>] -> a model_info body for org/big, 404 otherwise."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if not self.path.startswith("/api/models/org/big"):
                self._send(404, {"error": "Repository not found"})
                return
            siblings = [
                {"rfilename": "config.json", "size": 100},
                {"rfilename": "model.safetensors", "size": 5 * GIB},
            ]
            self._send(200, {"id": "org/big", "modelId": "org/big", "sha": "0" * 40, "siblings": siblings})

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class TestCheckSource:
    def test_a_hub_id_that_names_a_local_directory_is_refused(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # With the default data_dir ./grpo-data, "grpo-data/storage" is hub-shaped and from_pretrained would
        # read it from the worker's working directory.
        (tmp_path / "grpo-data" / "storage").mkdir(parents=True)
        monkeypatch.chdir(tmp_path)
        with pytest.raises(ModelUnavailable) as info:
            check_source("base_model", "grpo-data/storage", policy(tmp_path))
        assert info.value.code == "model_load_failed"
        assert check_source("base_model", "grpo-data/other", policy(tmp_path)).kind is ModelSourceKind.hub

    def test_policy_refusals_keep_their_reason(self, tmp_path: Path) -> None:
        with pytest.raises(ModelUnavailable) as info:
            check_source("rewards[1].model", str(tmp_path / "data" / "x"), policy(tmp_path))
        assert info.value.code == "model_source_refused"
        assert info.value.message.startswith(f"rewards[1].model: '{tmp_path}/data/x' is not accepted: ")

    def test_local_paths_come_back_resolved(self, tmp_path: Path) -> None:
        (tmp_path / "models" / "m").mkdir(parents=True)
        (tmp_path / "alias").symlink_to(tmp_path / "models")
        source = check_source("base_model", f"{tmp_path}/alias/m", policy(tmp_path))
        assert source.value == str(tmp_path / "models" / "m")


def test_checkpoint_problems_are_reported_without_paths(tmp_path: Path) -> None:
    from worker.failures import checkpoint_problem
    from worker.grpo.checkpoint import CheckpointCorrupt, verify_manifest

    with pytest.raises(CheckpointCorrupt) as corrupt:
        verify_manifest(tmp_path)
    assert checkpoint_problem(corrupt.value) == "corrupt: manifest.json is missing"
    with pytest.raises(OSError) as missing:
        (tmp_path / "nope" / "model.safetensors").open()
    assert checkpoint_problem(missing.value) == "could not be downloaded"
    assert str(tmp_path) in str(corrupt.value) and str(tmp_path) in str(missing.value)  # what is kept back


def test_filesystem_errors_are_named_not_quoted() -> None:
    from worker.failures import training_error_message

    missing = FileNotFoundError(2, "No such file or directory", "/srv/grpo-data/work/job_x/base")
    assert training_error_message(missing) == "FileNotFoundError (details in the worker's log)"
    assert training_error_message(RuntimeError("CUDA out of memory")) == "RuntimeError: CUDA out of memory"


class TestAdapterOnlySources:
    """from_pretrained loads an adapter-only model's `base_model_name_or_path`: it passes the policy too."""

    def adapter(self, directory: Path, config: object) -> Path:
        directory.mkdir(parents=True)
        (directory / "adapter_config.json").write_text(json.dumps(config))
        (directory / "adapter_model.safetensors").write_bytes(b"")
        return directory

    def test_an_adapter_pointing_into_the_data_dir_is_refused(self, tmp_path: Path) -> None:
        stolen = tmp_path / "data" / "storage" / "checkpoints" / "job_a" / "ckpt_a"
        adapter = self.adapter(tmp_path / "models" / "a", {"base_model_name_or_path": str(stolen)})
        with pytest.raises(ModelUnavailable) as info:
            check_source("base_model", str(adapter), policy(tmp_path))
        assert info.value.code == "model_source_refused"
        assert str(stolen) not in info.value.message

    @pytest.mark.parametrize(
        "config", [{"base_model_name_or_path": "checkpoint:ckpt_a"}, {"r": 8}, ["not", "a", "dict"], "{"]
    )
    def test_unusable_adapter_configs_are_refused(self, tmp_path: Path, config: object) -> None:
        adapter = self.adapter(tmp_path / "models" / "a", config)
        if config == "{":
            (adapter / "adapter_config.json").write_text("{")
        with pytest.raises(ModelUnavailable):
            check_source("base_model", str(adapter), policy(tmp_path))

    def test_accepted_bases_and_full_models_pass(self, tmp_path: Path) -> None:
        hub_base = self.adapter(tmp_path / "models" / "a", {"base_model_name_or_path": "org/base"})
        assert check_source("base_model", str(hub_base), policy(tmp_path)).kind is ModelSourceKind.local
        strict = ModelSourcePolicy(None, (tmp_path / "data",), ("other/*",))
        with pytest.raises(ModelUnavailable):
            check_source("base_model", str(hub_base), strict)
        # A full model with an embedded adapter loads its own weights, not the adapter's base.
        (hub_base / "config.json").write_text("{}")
        check_source("base_model", str(hub_base), strict)

    def test_adapter_only_hub_repositories_are_refused(self) -> None:
        listing = [("adapter_config.json", 10), ("adapter_model.safetensors", 1000)]
        with pytest.raises(ModelUnavailable) as info:
            check_hub_size("base_model", "org/lora", GIB, hub_files=lambda _repo: listing)
        assert info.value.code == "model_source_refused"
