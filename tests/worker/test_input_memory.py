"""Oversized inputs against a real `grpo serve` process (REST and gRPC on loopback): each is refused within
seconds, and the server's resident memory stays within RSS_BOUND of what it was before the request.

The bound (documented in docs/security.md): refusing a 100 MB body costs the server at most the
8 MiB body limit plus parsing overhead, asserted as under 96 MiB of extra RSS (measured: about 8 MiB for
the 100 MB JSON body, 48 MiB for the 200k-column dataset line, 2 MiB for the 100 MB gRPC message);
accepting such a body whole cost over 1 GB before the limit existed.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from contract.gen.grpo.v1 import job_spec_pb2, jobs_pb2, jobs_pb2_grpc
from tests.worker.conftest import PROMPTS, tiny_spec
from tests.worker.procs import ApiClient, PeakMemory, Proc, Stack, free_port, private_tmp

pytestmark = [pytest.mark.slow]

MIB = 1024 * 1024
RSS_BOUND = 96 * MIB


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    data_dir = private_tmp("grpo-input-memory-")
    stack = Stack(database_url=f"sqlite:///{data_dir}/grpo.db", broker_url=f"sqla+sqlite:///{data_dir}/broker.db",
                  data_dir=data_dir, grpc_port=free_port())
    try:
        stack.start_api(worker=False)
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture(scope="module")
def server(stack: Stack) -> Proc:
    return stack.procs[0]


@pytest.fixture(scope="module")
def api(stack: Stack) -> ApiClient:
    return stack.make_client()


def post_chunked(port: int, path: str, token: str, content_type: str, chunks: Iterator[bytes]) -> bytes:
    """POST with Transfer-Encoding: chunked (no Content-Length to refuse up front); stops sending once the
    server answers or closes. Returns the raw response."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        sock.setblocking(False)
        response = b""
        try:
            for chunk in chunks:
                try:
                    response += sock.recv(65536)
                except BlockingIOError:
                    pass
                if response:
                    break
                sock.setblocking(True)
                sock.sendall(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                sock.setblocking(False)
            else:
                sock.setblocking(True)
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.setblocking(True)
        while b"\r\n\r\n" not in response or not _complete(response):
            data = sock.recv(65536)
            if not data:
                break
            response += data
        return response


def _complete(response: bytes) -> bool:
    head, _, body = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def _token(api: ApiClient) -> str:
    return str(api.http.headers["Authorization"]).removeprefix("Bearer ")


def test_rest_100_mb_metadata_is_413_in_bounded_memory(stack: Stack, server: Proc, api: ApiClient) -> None:
    spec = tiny_spec(api.upload_dataset(PROMPTS))
    before, after = json.dumps({**spec, "metadata": {"note": ""}}).rsplit('""', 1)

    def body() -> Iterator[bytes]:
        yield (before + '"').encode()
        for _ in range(100):
            yield b"x" * MIB
        yield ('"' + after).encode()

    started = time.monotonic()
    with PeakMemory(lambda: rss(server.popen.pid)) as memory:
        response = post_chunked(stack.api_port, "/v1/jobs", _token(api), "application/json", body())
    assert time.monotonic() - started < 10
    assert response.startswith(b"HTTP/1.1 413"), response[:300]
    assert b'"payload_too_large"' in response
    print(f"server RSS grew {memory.growth / MIB:.1f} MiB")
    assert memory.growth < RSS_BOUND, f"server RSS grew {memory.growth / MIB:.0f} MiB"
    assert api.http.get("/v1/jobs").json()["data"] == []


# A 5000-digit length never reaches the app: the HTTP server (h11) answers 400 itself.
@pytest.mark.parametrize(("length", "status"), [(str(100 * MIB), b"413"), ("9" * 5000, b"400")])
def test_rest_declared_length_over_the_limit_is_refused_before_the_body(
    stack: Stack, api: ApiClient, length: str, status: bytes
) -> None:
    with socket.create_connection(("127.0.0.1", stack.api_port), timeout=5) as sock:
        sock.sendall(
            f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {_token(api)}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{".encode()
        )
        response = sock.recv(65536)  # no body follows: only an up-front refusal answers within the timeout
    assert response.startswith(b"HTTP/1.1 " + status), response[:300]


def test_rest_dataset_with_200k_columns_is_422_in_bounded_memory(stack: Stack, server: Proc, api: ApiClient) -> None:
    wide = json.dumps({"prompt": "p", **{f"column_{i}": i for i in range(200_000)}}).encode() + b"\n"
    boundary = "limitsboundary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="w.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n").encode()

    def body() -> Iterator[bytes]:
        yield head + b'{"prompt": "fine"}\n'
        for offset in range(0, len(wide), MIB):
            yield wide[offset:offset + MIB]
        yield f"\r\n--{boundary}--\r\n".encode()

    started = time.monotonic()
    with PeakMemory(lambda: rss(server.popen.pid)) as memory:
        response = post_chunked(stack.api_port, "/v1/datasets", _token(api),
                                f"multipart/form-data; boundary={boundary}", body())
    assert time.monotonic() - started < 10
    assert response.startswith(b"HTTP/1.1 422"), response[:300]
    details = json.loads(response.partition(b"\r\n\r\n")[2])["error"]["details"]
    assert details[0]["line"] == 2 and "200001 columns" in details[0]["error"]
    print(f"server RSS grew {memory.growth / MIB:.1f} MiB")
    assert memory.growth < RSS_BOUND, f"server RSS grew {memory.growth / MIB:.0f} MiB"


async def test_grpc_100_mb_metadata_is_resource_exhausted_in_bounded_memory(
    stack: Stack, server: Proc, api: ApiClient
) -> None:
    dataset_id = api.upload_dataset(PROMPTS)
    spec = job_spec_pb2.JobSpec(
        base_model="builtin:tiny", train_dataset=dataset_id,
        rewards=[job_spec_pb2.RewardSpec(exact_match=job_spec_pb2.ExactMatchReward())],
        hyperparameters=job_spec_pb2.Hyperparameters(max_steps=1, num_generations=2, prompts_per_step=1),
        metadata={"note": "x" * (100 * MIB)},
    )
    started = time.monotonic()
    with PeakMemory(lambda: rss(server.popen.pid)) as memory:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await jobs_pb2_grpc.JobServiceStub(channel).CreateJob(
                    jobs_pb2.CreateJobRequest(spec=spec), metadata=(("authorization", f"Bearer {_token(api)}"),)
                )
    assert time.monotonic() - started < 10
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    print(f"server RSS grew {memory.growth / MIB:.1f} MiB")
    assert memory.growth < RSS_BOUND, f"server RSS grew {memory.growth / MIB:.0f} MiB"
    assert api.http.get("/v1/jobs").json()["data"] == []


async def test_grpc_metadata_over_the_schema_cap_is_invalid_argument(stack: Stack, api: ApiClient) -> None:
    spec = job_spec_pb2.JobSpec(
        base_model="builtin:tiny", train_dataset=api.upload_dataset(PROMPTS),
        rewards=[job_spec_pb2.RewardSpec(exact_match=job_spec_pb2.ExactMatchReward())],
        hyperparameters=job_spec_pb2.Hyperparameters(max_steps=1, num_generations=2, prompts_per_step=1),
        metadata={"note": "x" * 2000},
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await jobs_pb2_grpc.JobServiceStub(channel).CreateJob(
                jobs_pb2.CreateJobRequest(spec=spec), metadata=(("authorization", f"Bearer {_token(api)}"),)
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1024" in (err.value.details() or "")
