"""Server memory while it answers a 100 MB JSON body: with the body limit (default) vs without it.

    .venv/bin/python bench/input_limits.py [--mib 100] [--reps 2]

Each run starts its own `grpo serve --no-worker` (SQLite in a temp dir) as a child process, sends `POST /v1/jobs`
whose `metadata` value is `--mib` MiB, chunked (no Content-Length, so the limit must act while the body streams),
and samples the server's RSS every 10 ms from /proc. Comparator: the same server with
GRPO_MAX_REQUEST_BODY_BYTES=2**40 (no effective limit; the schema's metadata caps then refuse the parsed body).
Runs alternate limited / unlimited so machine drift hits both alike. Prints per run the status, the seconds to
the answer and the peak RSS growth, then the median growth of each and the ratio limited/unlimited.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(data_dir: Path, limit: int | None) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {**os.environ, "GRPO_DATA_DIR": str(data_dir), "GRPO_GRPC_PORT": "0", "GRPO_ENV": "development"}
    if limit is not None:
        env["GRPO_MAX_REQUEST_BODY_BYTES"] = str(limit)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--port", str(port), "--migrate", "--no-worker"],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def send(port: int, mib: int) -> bytes:
    """The chunked body; stops sending as soon as the server answers or closes. Returns the status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer grpo_sk_bench\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        parts = [b'{"base_model": "builtin:tiny", "train_dataset": "ds_x", "rewards": '
                 b'[{"type": "builtin", "name": "exact_match"}], "hyperparameters": {}, "metadata": {"note": "']
        parts += [b"x" * MIB] * mib + [b'"}}']
        try:
            for part in parts:
                sock.settimeout(0)
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break
                except BlockingIOError:
                    pass
                sock.settimeout(120)
                sock.sendall(b"%x\r\n%b\r\n" % (len(part), part))
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(120)
        return sock.recv(65536).split(b"\r\n", 1)[0]


def one_run(limit: int | None, mib: int) -> tuple[str, float, float]:
    data_dir = Path(tempfile.mkdtemp(prefix="grpo-bench-limits-"))
    proc, port = start_server(data_dir, limit)
    try:
        time.sleep(1.0)  # let start-up settle
        start = peak = rss(proc.pid)
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.wait(0.01):
                peak = max(peak, rss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        began = time.monotonic()
        status = send(port, mib).decode(errors="replace")
        seconds = time.monotonic() - began
        time.sleep(0.2)
        stop.set()
        sampler.join()
        return status, seconds, (max(peak, rss(proc.pid)) - start) / MIB
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        shutil.rmtree(data_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    growth: dict[str, list[float]] = {"limited": [], "unlimited": []}
    for rep in range(args.reps):
        order = ["limited", "unlimited"] if rep % 2 == 0 else ["unlimited", "limited"]
        for name in order:
            status, seconds, grew = one_run(None if name == "limited" else 2**40, args.mib)
            growth[name].append(grew)
            print(f"{name:9s} rep {rep}: {status}, answered in {seconds:.2f} s, server RSS +{grew:.0f} MiB", flush=True)
    limited, unlimited = statistics.median(growth["limited"]), statistics.median(growth["unlimited"])
    print(f"median RSS growth: limited +{limited:.0f} MiB, unlimited +{unlimited:.0f} MiB, "
          f"ratio limited/unlimited {limited / unlimited:.3f}")


if __name__ == "__main__":
    main()
