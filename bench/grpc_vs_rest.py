"""GetJob over gRPC vs over REST, same server process, same database, same concurrency.

Runs, in one go:
- one server process serving both APIs on one event loop, as `grpo serve` does (uvicorn with
  `service.app:create_app()` + `service.grpc.server.serve_grpc`), minus the reaper, the embedded worker and
  uvicorn's per-request access log (the gRPC side logs nothing per call, so the log would be measured too);
- a database: a SQLite file (default) or a throwaway PostgreSQL database (`--db postgres`), migrated with
  Alembic and seeded with a tenant, an API key, a dataset and one job (`bench/api_load.py`'s seed);
- a closed-loop load generator per transport with the same number of callers (`--concurrency`): each sends
  its next call when the previous answer arrives. REST: aiohttp with that many connections (the api_load
  generator). gRPC: grpc.aio with that many concurrent calls multiplexed on `--channels` HTTP/2 channels.

Rounds alternate gRPC and REST so both see the same machine load; medians over rounds are printed side by
side with req/s, p50/p99 latency, errors and the server's CPU milliseconds per call. The load generators
share this machine's cores with the server: read the ratios, and the server CPU per call, not absolutes.

    .venv/bin/python bench/grpc_vs_rest.py [--db sqlite|postgres] [--duration 10] [--rounds 3]
                                           [--concurrency 32] [--channels 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api_load import Call, Result, _free_port, _load, seed, server_cpu_seconds, throwaway_database  # noqa: E402

from contract.gen.grpo.v1 import jobs_pb2, jobs_pb2_grpc  # noqa: E402

# --- the server: both APIs on one loop, as `grpo serve` --------------------------------------------


async def _serve_both(rest_port: int, grpc_port: int) -> None:
    import uvicorn

    from service.app import create_app
    from service.grpc.server import serve_grpc

    config = uvicorn.Config(create_app(), host="127.0.0.1", port=rest_port, log_level="warning", access_log=False)
    grpc_task = asyncio.create_task(serve_grpc(grpc_port, "127.0.0.1"))
    try:
        await uvicorn.Server(config).serve()  # until SIGTERM
    finally:
        grpc_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await grpc_task


@contextmanager
def server_process(env: dict[str, str]) -> Iterator[tuple[str, str, int]]:
    """(REST base URL, gRPC target, pid) of a child serving both APIs; stopped on exit."""
    rest_port, grpc_port = _free_port(), _free_port()
    command = [sys.executable, __file__, "--serve-child", str(rest_port), str(grpc_port)]
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env})
    base_url, target = f"http://127.0.0.1:{rest_port}", f"127.0.0.1:{grpc_port}"
    try:
        deadline = time.monotonic() + 60
        while not _rest_up(base_url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        yield base_url, target, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _rest_up(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# --- the gRPC load generator (the REST one is api_load._load) ----------------------------------------


async def _grpc_load(
    target: str, key: str, job_id: str, *, concurrency: int, channels: int, duration: float, warmup: float
) -> Result:
    latencies: list[float] = []
    errors = 0
    metadata = (("authorization", f"Bearer {key}"),)
    request = jobs_pb2.GetJobRequest(job_id=job_id)
    opened = [grpc.aio.insecure_channel(target) for _ in range(channels)]
    try:
        for channel in opened:
            await channel.channel_ready()
        stubs = [jobs_pb2_grpc.JobServiceStub(channel) for channel in opened]
        answer = await stubs[0].GetJob(request, metadata=metadata)
        if answer.job.id != job_id:
            raise RuntimeError(f"GetJob answered job {answer.job.id!r}, expected {job_id!r}")
        start = time.perf_counter()
        measure_from = start + warmup
        stop = measure_from + duration

        async def caller(stub: jobs_pb2_grpc.JobServiceAsyncStub) -> None:
            nonlocal errors
            while (now := time.perf_counter()) < stop:
                try:
                    await stub.GetJob(request, metadata=metadata, timeout=30)
                    ok = True
                except grpc.aio.AioRpcError:
                    ok = False
                done = time.perf_counter()
                if now >= measure_from:
                    latencies.append(done - now)
                    errors += not ok

        await asyncio.gather(*(caller(stubs[i % channels]) for i in range(concurrency)))
        elapsed = time.perf_counter() - measure_from
    finally:
        for channel in opened:
            await channel.close()
    latencies.sort()
    return Result(
        name="",
        requests=len(latencies),
        errors=errors,
        seconds=elapsed,
        p50_ms=1000 * statistics.median(latencies),
        p99_ms=1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    )


def measure(name: str, run: Any, server_pid: int, args: argparse.Namespace) -> tuple[Result, float]:
    """Run one load (a coroutine factory); the result and the server's CPU milliseconds per call."""
    cpu_before = server_cpu_seconds(server_pid)
    result: Result = asyncio.run(run())
    total_calls = result.rps * (args.duration + args.warmup)  # warm-up calls burn server CPU too
    cpu_ms = 1000 * (server_cpu_seconds(server_pid) - cpu_before) / max(total_calls, 1)
    result.name = name
    print(
        f"  {name:<24} {result.rps:8.0f} calls/s   p50 {result.p50_ms:6.1f} ms   p99 {result.p99_ms:6.1f} ms   "
        f"errors {result.errors}   server CPU {cpu_ms:.2f} ms/call",
        flush=True,
    )
    return result, cpu_ms


# --- main -------------------------------------------------------------------------------------------


@contextmanager
def database(kind: str) -> Iterator[str]:
    if kind == "postgres":
        with throwaway_database() as url:
            yield url
    else:
        with tempfile.TemporaryDirectory() as tmp:
            yield f"sqlite:///{tmp}/grpo.db"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--duration", type=float, default=10.0, help="Measured seconds per transport and round.")
    parser.add_argument("--warmup", type=float, default=2.0, help="Unmeasured seconds before each measurement.")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds (gRPC then REST); medians are reported.")
    parser.add_argument("--concurrency", type=int, default=32, help="Callers in flight, both transports.")
    parser.add_argument("--channels", type=int, default=1, help="gRPC channels the callers share.")
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    parser.add_argument("--serve-child", nargs=2, type=int, metavar=("REST_PORT", "GRPC_PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_child:
        asyncio.run(_serve_both(*args.serve_child))
        return

    rows: dict[str, list[tuple[Result, float]]] = {}
    with database(args.db) as database_url, tempfile.TemporaryDirectory() as data_dir:
        env = {
            "GRPO_DATABASE_URL": database_url,
            "GRPO_DATA_DIR": data_dir,
            "GRPO_BROKER_URL": "memory://",
            "GRPO_ENV": "development",
        }
        os.environ.update(env)
        key, _dataset_id, job_id = seed(database_url)
        rest_call = Call("GET", f"/v1/jobs/{job_id}", {"Authorization": f"Bearer {key}"})
        print(
            f"GetJob: one server process (uvicorn + grpc.aio on one loop), {args.db}, {args.concurrency} callers "
            f"per transport ({args.channels} gRPC channel(s)), {os.cpu_count()} CPUs, {args.rounds} rounds of "
            f"{args.duration:.0f} s",
            flush=True,
        )
        with server_process(env) as (base_url, target, pid):
            for round_no in range(1, args.rounds + 1):
                print(f"round {round_no}", flush=True)
                grpc_result = measure(
                    "gRPC JobService.GetJob",
                    lambda: _grpc_load(
                        target, key, job_id, concurrency=args.concurrency, channels=args.channels,
                        duration=args.duration, warmup=args.warmup,
                    ),
                    pid,
                    args,
                )  # fmt: skip
                rows.setdefault("gRPC JobService.GetJob", []).append(grpc_result)
                rest_result = measure(
                    "REST GET /v1/jobs/{id}",
                    lambda: _load(
                        base_url, rest_call, connections=args.concurrency, duration=args.duration, warmup=args.warmup
                    ),
                    pid,
                    args,
                )
                rows.setdefault("REST GET /v1/jobs/{id}", []).append(rest_result)

    summary: dict[str, dict[str, float]] = {}
    for name, measured in rows.items():
        summary[name] = {
            "calls_per_s": statistics.median(r.rps for r, _ in measured),
            "p50_ms": statistics.median(r.p50_ms for r, _ in measured),
            "p99_ms": statistics.median(r.p99_ms for r, _ in measured),
            "errors": float(sum(r.errors for r, _ in measured)),
            "server_cpu_ms_per_call": statistics.median(cpu for _, cpu in measured),
        }
    grpc_row, rest_row = summary["gRPC JobService.GetJob"], summary["REST GET /v1/jobs/{id}"]
    print(f"\nmedians over {args.rounds} rounds, side by side")
    print(f"  {'':<22} {'gRPC GetJob':>14} {'REST GET':>14} {'gRPC/REST':>10}")
    for label, field, fmt in (
        ("calls/s", "calls_per_s", "{:14.0f}"),
        ("p50 latency ms", "p50_ms", "{:14.1f}"),
        ("p99 latency ms", "p99_ms", "{:14.1f}"),
        ("server CPU ms/call", "server_cpu_ms_per_call", "{:14.2f}"),
        ("errors", "errors", "{:14.0f}"),
    ):
        g, r = grpc_row[field], rest_row[field]
        ratio = f"{g / r:10.2f}" if r else f"{'-':>10}"
        print(f"  {label:<22} {fmt.format(g)} {fmt.format(r)} {ratio}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": summary}, indent=2))


if __name__ == "__main__":
    main()
