"""The SDK's `download_checkpoint` writes only under its destination, whatever the server lists (issue 30).

The listing of a checkpoint's files comes from the server; a hostile or broken one could list `../x`, an
absolute path, or a path through a symbolic link that the destination already holds. The path check is tested
directly, then end to end: both clients against a real HTTP server on loopback that lists such paths and
serves every file it is asked for, so a client that did not refuse would write outside the destination.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

from client.async_sdk import AsyncGRPOClient
from client.sdk import GRPOClient, UnsafeCheckpointPath, checkpoint_file_targets

CHECKPOINT = "ckpt_01JDX3V8Q4M2C6T9W1R5Y7Z0AB"
CONTENT = b"weights"


class TestCheckpointFileTargets:
    def test_plain_relative_paths_land_under_the_destination(self, tmp_path: Path) -> None:
        targets = checkpoint_file_targets(tmp_path, ["config.json", "sub/dir/model.safetensors", "./a/./b.bin"])
        root = tmp_path.resolve()
        assert targets == [root / "config.json", root / "sub/dir/model.safetensors", root / "a/b.bin"]

    @pytest.mark.parametrize(
        ("path", "reason"),
        [
            ("../escape.txt", "'..'"),
            ("sub/../../escape.txt", "'..'"),
            ("sub/..", "'..'"),
            ("/etc/cron.d/x", "absolute"),
            ("//host/share/x", "absolute"),
            ("C:/Windows/x", "absolute"),
            ("C:x", "absolute"),
            ("..\\escape.txt", "backslash"),
            ("", "empty"),
            (".", "names no file"),
            ("a\x00b", "NUL"),
        ],
    )
    def test_paths_that_could_leave_the_destination_are_refused(self, tmp_path: Path, path: str, reason: str) -> None:
        with pytest.raises(UnsafeCheckpointPath, match=reason) as refused:
            checkpoint_file_targets(tmp_path, ["config.json", path])
        assert refused.value.path == path

    def test_a_symbolic_link_in_the_destination_cannot_lead_outside(self, tmp_path: Path) -> None:
        dest, outside = tmp_path / "dest", tmp_path / "outside"
        dest.mkdir()
        outside.mkdir()
        (dest / "link").symlink_to(outside, target_is_directory=True)
        (dest / "inside").mkdir()
        (dest / "ok").symlink_to(dest / "inside", target_is_directory=True)
        assert checkpoint_file_targets(dest, ["ok/model.bin"]) == [dest.resolve() / "ok/model.bin"]
        with pytest.raises(UnsafeCheckpointPath, match="symbolic link"):
            checkpoint_file_targets(dest, ["link/model.bin"])


class HostileCheckpointServer(ThreadingHTTPServer):
    """Lists `paths` as the checkpoint's files and serves CONTENT for any file path it is asked for."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.paths = paths
        self.downloads: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    server: HostileCheckpointServer

    def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
        prefix = f"/v1/checkpoints/{CHECKPOINT}"
        if self.path == prefix:
            files = [{"path": p, "size": len(CONTENT), "sha256": "0" * 64} for p in self.server.paths]
            body = json.dumps({
                "object": "checkpoint", "id": CHECKPOINT, "job_id": "job_x", "step": 1, "files": files,
                "total_bytes": len(CONTENT) * len(files), "metrics": {}, "created_at": "2025-01-01T00:00:00Z",
            }).encode()
            self._answer(body, "application/json")
        elif self.path.startswith(f"{prefix}/files/"):
            self.server.downloads.append(unquote(self.path[len(prefix) + 7:]))
            self._answer(CONTENT, "application/octet-stream")
        else:
            self.send_error(404)

    def _answer(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the http.server hook's signature
        pass


Serve = Callable[[list[str]], HostileCheckpointServer]


@pytest.fixture
def serve() -> Iterator[Serve]:
    servers: list[HostileCheckpointServer] = []

    def start(paths: list[str]) -> HostileCheckpointServer:
        server = HostileCheckpointServer(paths)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _url(server: HostileCheckpointServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def _files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


class TestDownloadCheckpoint:
    def test_a_listing_with_dot_dot_is_refused_and_nothing_is_written(self, tmp_path: Path, serve: Serve) -> None:
        server = serve(["config.json", "../../escape.txt"])
        dest = tmp_path / "a" / "dest"
        with GRPOClient(_url(server), "grpo_sk_test") as client, pytest.raises(UnsafeCheckpointPath, match="'..'"):
            client.download_checkpoint(CHECKPOINT, dest)
        assert server.downloads == []  # refused before the first file
        assert _files_under(tmp_path) == set()

    def test_an_absolute_path_is_refused(self, tmp_path: Path, serve: Serve) -> None:
        target = tmp_path / "outside.txt"
        server = serve([str(target)])
        with GRPOClient(_url(server), "grpo_sk_test") as client, pytest.raises(UnsafeCheckpointPath, match="absolute"):
            client.download_checkpoint(CHECKPOINT, tmp_path / "dest")
        assert not target.exists()

    def test_a_symbolic_link_already_in_the_destination_is_not_followed_out(self, tmp_path: Path, serve: Serve) -> None:
        dest, outside = tmp_path / "dest", tmp_path / "outside"
        dest.mkdir()
        outside.mkdir()
        (dest / "cache").symlink_to(outside, target_is_directory=True)
        server = serve(["cache/model.bin"])
        with GRPOClient(_url(server), "grpo_sk_test") as client, pytest.raises(UnsafeCheckpointPath):
            client.download_checkpoint(CHECKPOINT, dest)
        assert list(outside.iterdir()) == []

    def test_a_safe_listing_downloads_every_file(self, tmp_path: Path, serve: Serve) -> None:
        server = serve(["config.json", "shards/model.bin"])
        with GRPOClient(_url(server), "grpo_sk_test") as client:
            assert client.download_checkpoint(CHECKPOINT, tmp_path / "dest") == tmp_path / "dest"
        assert _files_under(tmp_path / "dest") == {"config.json", "shards/model.bin"}
        assert (tmp_path / "dest/shards/model.bin").read_bytes() == CONTENT

    async def test_the_async_client_refuses_too(self, tmp_path: Path, serve: Serve) -> None:
        server = serve(["ok.bin", "sub/../../escape.txt"])
        async with AsyncGRPOClient(_url(server), "grpo_sk_test") as client:
            with pytest.raises(UnsafeCheckpointPath, match="'..'"):
                await client.download_checkpoint(CHECKPOINT, tmp_path / "dest")
        assert server.downloads == [] and _files_under(tmp_path) == set()
