"""REST API load benchmark.

Runs, in one go:
- the API under uvicorn on a throwaway PostgreSQL database (migrated with Alembic, seeded with a
  tenant, an API key, a dataset and one job), broker `memory://` so POSTs pay the real enqueue call
  without filling a shared Redis;
- a bare FastAPI hello-world app under the same uvicorn settings;
and loads both with the same async generator (aiohttp, at most 64 connections). Not httpx: its
connection pool collapses at 64 connections (hello-world measured 58 req/s with httpx vs 912 with
aiohttp on the same box), which would measure the client instead of the servers.

Two modes, both in every round (rounds interleave the apps, so each comparison is made under the same
machine load):
- closed loop (throughput): 64 connections, each sends its next request when the previous answer
  arrives. Prints req/s, p50/p99, errors for `GET /v1/jobs/{id}`, `GET /v1/jobs?limit=20`,
  `POST /v1/jobs` and each one's ratio to the hello-world req/s. Its latencies are not a latency
  measurement: with 64 requests always in flight, latency = 64 / throughput (Little's law), so a p99
  under 50 ms would need more than 1280 req/s.
- open loop (latency): requests arrive at a fixed rate whether or not earlier ones were answered, at
  each of `--open-fractions` (default 0.5 and 0.1) of the hello-world closed-loop req/s of the same
  round, the same rate for hello-world and `GET /v1/jobs/{id}`. 0.5 is the acceptance target's rate
  (half of hello-world's throughput with p99 < 50 ms); 0.1 shows the latency of a lightly loaded API.
  Latency runs from each request's scheduled send time, so queueing in the client counts too (no
  coordinated omission).

`--baseline DIR` also measures the API from another source tree (e.g. `git worktree add /tmp/base HEAD~1`)
on the same database in the same rounds: before/after figures from one run. Each API server is started
for its turn in a round and stopped after it, so at most one of them holds database connections.

    .venv/bin/python bench/api_load.py [--duration 10] [--rounds 3] [--open-fractions 0.5 0.1] [--baseline DIR]

`--checks` instead measures what the per-key checks cost: the same API with rate limiting on (budgets so high
they never trigger) and off (`GRPO_RATE_LIMIT_READS=0`, `..._WRITES=0`), alternating which goes first in each
round, on `--database sqlite` (in-process buckets, the embedded mode) or `--database postgres` (buckets in the
Redis at $GRPO_TEST_REDIS_URL, default redis://127.0.0.1:6379, db 13: production). Usage metering is done by
the worker, not on the API path, so it has no share in these figures.

    .venv/bin/python bench/api_load.py --checks --database sqlite [--duration 10] [--rounds 3]

Both servers and the load generator share this machine's cores: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[1]
ADMIN_URL = os.environ.get("GRPO_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("GRPO_TEST_REDIS_URL", "redis://127.0.0.1:6379")

# The baseline (uvicorn runs it as `api_load:hello_app`): FastAPI's own README example, a `def` route.
hello_app = FastAPI()


@hello_app.get("/")
def hello() -> dict[str, str]:
    return {"hello": "world"}


# The same with `async def`: no thread-pool hop, so a lower floor than the README's `def` route above. Printed
# next to it so that the ratio against the stricter baseline is in every run too.
@hello_app.get("/async")
async def hello_async() -> dict[str, str]:
    return {"hello": "world"}


@dataclass
class Result:
    name: str
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


# --- the load generator ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    headers: dict[str, str] | None = None
    json: dict[str, Any] | None = None


async def _load(base_url: str, call: Call, *, connections: int, duration: float, warmup: float) -> Result:
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(base_url=base_url, connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        measure_from = start + warmup
        stop = measure_from + duration

        async def connection() -> None:
            nonlocal errors
            while (now := time.perf_counter()) < stop:
                try:
                    async with session.request(
                        call.method, call.path, headers=call.headers, json=call.json
                    ) as resp:
                        await resp.read()
                        ok = resp.status < 400
                except (TimeoutError, aiohttp.ClientError):
                    ok = False
                done = time.perf_counter()
                if now >= measure_from:
                    latencies.append(done - now)
                    errors += not ok

        await asyncio.gather(*(connection() for _ in range(connections)))
        elapsed = time.perf_counter() - measure_from
    latencies.sort()
    return Result(
        name="",
        requests=len(latencies),
        errors=errors,
        seconds=elapsed,
        p50_ms=1000 * statistics.median(latencies),
        p99_ms=1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    )


async def _open_load(
    base_url: str, call: Call, *, rate: float, connections: int, duration: float, warmup: float
) -> Result:
    """Fixed arrival rate; each latency is measured from the request's scheduled send time."""
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(base_url=base_url, connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        measure_from = start + warmup
        stop = measure_from + duration

        async def one(scheduled: float) -> None:
            nonlocal errors
            try:
                async with session.request(
                    call.method, call.path, headers=call.headers, json=call.json
                ) as resp:
                    await resp.read()
                    ok = resp.status < 400
            except (TimeoutError, aiohttp.ClientError):
                ok = False
            if scheduled >= measure_from:
                latencies.append(time.perf_counter() - scheduled)
                errors += not ok

        tasks: list[asyncio.Task[None]] = []
        n = 0
        while (scheduled := start + n / rate) < stop:
            if (delay := scheduled - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(scheduled)))
            n += 1
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - measure_from
    latencies.sort()
    return Result(
        name="",
        requests=len(latencies),
        errors=errors,
        seconds=elapsed,
        p50_ms=1000 * statistics.median(latencies),
        p99_ms=1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    )


def run_open_load(name: str, base_url: str, call: Call, rate: float, args: argparse.Namespace) -> Result:
    result = asyncio.run(
        _open_load(
            base_url,
            call,
            rate=rate,
            connections=args.connections,
            duration=args.duration,
            warmup=args.warmup,
        )
    )
    result.name = name
    print(
        f"  {name:<34} offered {rate:6.0f} req/s   done {result.rps:6.0f} req/s   p50 {result.p50_ms:6.1f} ms   "
        f"p99 {result.p99_ms:6.1f} ms   errors {result.errors}",
        flush=True,
    )
    return result


def server_cpu_seconds(pid: int) -> float:
    """User + system CPU of a server process and its workers."""
    process = psutil.Process(pid)
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def run_load(
    name: str, base_url: str, call: Call, args: argparse.Namespace, server_pid: int
) -> tuple[Result, float]:
    """Load one endpoint; returns the result and the server's CPU milliseconds per request."""
    cpu_before = server_cpu_seconds(server_pid)
    result = asyncio.run(
        _load(base_url, call, connections=args.connections, duration=args.duration, warmup=args.warmup)
    )
    # Warm-up requests burn CPU too: spread the CPU over every request of the run, counted by rate.
    total_requests = result.rps * (args.duration + args.warmup)
    cpu_ms = 1000 * (server_cpu_seconds(server_pid) - cpu_before) / max(total_requests, 1)
    result.name = name
    print(
        f"  {name:<34} {result.rps:8.0f} req/s   p50 {result.p50_ms:6.1f} ms   p99 {result.p99_ms:6.1f} ms   "
        f"errors {result.errors}   server CPU {cpu_ms:.2f} ms/req",
        flush=True,
    )
    return result, cpu_ms


# --- servers --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def uvicorn_server(
    app: str, env: dict[str, str], args: argparse.Namespace, *, factory: bool = False, source: Path = ROOT
) -> Iterator[tuple[str, int]]:
    """Serve `app` from the source tree `source` (its working directory comes first on sys.path)."""
    port = _free_port()
    command = [
        sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
        "--workers", str(args.workers), "--log-level", "warning", "--no-access-log",
        "--app-dir", str(source / "bench"),
    ]  # fmt: skip
    if factory:
        command.append("--factory")
    proc = subprocess.Popen(command, cwd=source, env={**os.environ, **env})
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if (
                    httpx.get(f"{base_url}/openapi.json" if factory else base_url, timeout=1).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{app} did not start")
            time.sleep(0.2)
        yield base_url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# --- the database ---------------------------------------------------------------------------------


@contextmanager
def throwaway_database() -> Iterator[str]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"grpo_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


LIST_LIMIT = 20


def seed(database_url: str) -> tuple[str, str, str]:
    """Migrate, then create a tenant, an API key, a dataset and 21 jobs. Returns (key, dataset id, a job id)."""
    from cli.migrate import upgrade_head
    from contract.spec import JobSpec
    from service.datasets.models import Dataset
    from service.jobs import service as jobs_service
    from service.kit.db import session_scope, utcnow
    from service.kit.ids import new_id
    from service.tenants import service as tenants

    class NoQueue:
        def send_job(self, job_id: str, *, queue: str) -> None:
            pass

    upgrade_head(database_url)
    with session_scope() as session:
        tenant = tenants.create_tenant(session, "bench")
        _row, key = tenants.create_api_key(session, tenant)
        dataset = Dataset(
            id=new_id("ds"), tenant_id=tenant.id, name="bench", num_rows=1, bytes=1, sha256="0" * 64,
            columns=["prompt"], storage_key="datasets/bench.jsonl", created_at=utcnow(),
        )  # fmt: skip
        session.add(dataset)
        session.flush()
        # A full first page for `GET /v1/jobs?limit=20` from the first round on (POSTs add more later).
        spec = JobSpec.model_validate(job_body(dataset.id))
        jobs = [jobs_service.create_job(session, tenant.id, spec, NoQueue()) for _ in range(LIST_LIMIT + 1)]
        return key, dataset.id, jobs[0].id


def job_body(dataset_id: str) -> dict[str, Any]:
    return {
        "name": "bench",
        "base_model": "builtin:tiny",
        "train_dataset": dataset_id,
        "rewards": [{"type": "builtin", "name": "exact_match", "weight": 1.0}],
        "hyperparameters": {"max_steps": 100, "num_generations": 4, "prompts_per_step": 2},
    }


# --- main -----------------------------------------------------------------------------------------


HELLO = "GET / (hello-world)"
HELLO_ASYNC = "GET /async (hello, async def)"
TARGET = "GET /v1/jobs/{id}"
BASELINE = " [baseline]"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--duration", type=float, default=10.0, help="Measured seconds per endpoint, mode and round."
    )
    parser.add_argument(
        "--warmup", type=float, default=2.0, help="Unmeasured seconds before each measurement."
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="Rounds of hello-world + API; medians are reported."
    )
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (both apps).")
    parser.add_argument(
        "--open-fractions",
        type=float,
        nargs="*",
        default=[0.5, 0.1],
        help="Open-loop arrival rates as fractions of the round's hello-world closed-loop req/s (none = skip).",
    )
    parser.add_argument(
        "--baseline", type=Path, help="Another source tree of the API to measure in the same rounds."
    )
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    parser.add_argument(
        "--checks", action="store_true", help="Compare the API with rate limiting on and off (see above)."
    )
    parser.add_argument(
        "--database", choices=["postgres", "sqlite"], default="postgres", help="--checks: the database."
    )
    return parser.parse_args()


def _median_row(measured: list[tuple[Result, float, float]]) -> dict[str, float]:
    return {
        "rps": statistics.median(r.rps for r, _, _ in measured),
        "p50_ms": statistics.median(r.p50_ms for r, _, _ in measured),
        "p99_ms": statistics.median(r.p99_ms for r, _, _ in measured),
        "errors": sum(r.errors for r, _, _ in measured),
        # closed loop: req/s / hello-world req/s; open loop: the offered rate
        "ratio_or_rate": statistics.median(x for _, x, _ in measured),
        "server_cpu_ms_per_request": statistics.median(cpu for _, _, cpu in measured),
    }


def print_summary(
    closed: dict[str, list[tuple[Result, float, float]]], opened: dict[str, list[tuple[Result, float, float]]]
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    print("\nclosed loop (throughput; latency here is 64 connections / throughput), medians over rounds")
    print(
        f"  {'endpoint':<34} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} {'ratio':>6} {'CPU ms/req':>11}"
    )
    closed_summary = {name: _median_row(measured) for name, measured in closed.items()}
    for name, med in closed_summary.items():
        print(
            f"  {name:<34} {med['rps']:8.0f} {med['p50_ms']:8.1f} {med['p99_ms']:8.1f} {med['errors']:7.0f} "
            f"{med['ratio_or_rate']:6.2f} {med['server_cpu_ms_per_request']:11.2f}"
        )
    open_summary = {name: _median_row(measured) for name, measured in opened.items()}
    if open_summary:
        print("\nopen loop (latency at a fixed arrival rate, the same for every app), medians over rounds")
        print(f"  {'endpoint':<34} {'offered':>8} {'done/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
        for name, med in open_summary.items():
            print(
                f"  {name:<34} {med['ratio_or_rate']:8.0f} {med['rps']:8.0f} {med['p50_ms']:8.1f} "
                f"{med['p99_ms']:8.1f} {med['errors']:7.0f}"
            )
    return closed_summary, open_summary


def open_name(endpoint: str, fraction: float) -> str:
    return f"{endpoint} @ {fraction:g}x"


def print_target(
    closed: dict[str, dict[str, float]], opened: dict[str, dict[str, float]], suffix: str
) -> None:
    ratio = closed[TARGET + suffix]["ratio_or_rate"]
    closed_p99 = closed[TARGET + suffix]["p99_ms"]
    # This API's rows (and hello-world's): the baseline's errors do not count against the current tree.
    errors = sum(
        m["errors"]
        for name, m in [*closed.items(), *opened.items()]
        if name.startswith(HELLO) or (BASELINE in name) == (suffix == BASELINE)
    )
    line = (
        f"\ntarget{suffix} (GET /v1/jobs/{{id}}): closed-loop ratio {ratio:.2f} (>= 0.5: "
        f"{'met' if ratio >= 0.5 else 'NOT met'}) with p99 {closed_p99:.1f} ms (< 50 ms: "
        f"{'met' if closed_p99 < 50 else 'NOT met'})"
    )
    at_half = open_name(TARGET + suffix, 0.5)
    if at_half in opened:
        p99 = opened[at_half]["p99_ms"]
        rate = opened[at_half]["ratio_or_rate"]
        line += (
            f", open-loop p99 {p99:.1f} ms at {rate:.0f} req/s (< 50 ms: {'met' if p99 < 50 else 'NOT met'})"
        )
    print(line + f", errors {errors:.0f}")
    strict = closed[TARGET + suffix]["rps"] / closed[HELLO_ASYNC]["rps"]
    print(f"  against the async def hello-world instead: closed-loop ratio {strict:.2f}")


# Rate limiting on with budgets no run reaches (1e9 per minute), and off.
CHECKS_ON = {"GRPO_RATE_LIMIT_READS": "1000000000", "GRPO_RATE_LIMIT_WRITES": "1000000000"}
CHECKS_OFF = {"GRPO_RATE_LIMIT_READS": "0", "GRPO_RATE_LIMIT_WRITES": "0"}


@contextmanager
def bench_database(kind: str, data_dir: str) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{data_dir}/bench.db"
        return
    with throwaway_database() as url:
        yield url


def main_checks(args: argparse.Namespace) -> None:
    """The API with rate limiting on and off, alternating which goes first per round; medians and ratios."""
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}  # endpoint -> on/off -> [(req/s, CPU ms)]
    with tempfile.TemporaryDirectory() as data_dir, bench_database(args.database, data_dir) as database_url:
        env = {
            "GRPO_DATABASE_URL": database_url,
            "GRPO_DATA_DIR": data_dir,
            "GRPO_BROKER_URL": "memory://",
            "GRPO_ENV": "development",
            # postgres: the production setup, buckets shared in Redis; sqlite: the embedded one, in-process.
            "GRPO_RATE_LIMIT_REDIS_URL": f"{REDIS_URL}/13" if args.database == "postgres" else "",
        }
        os.environ.update(env)
        key, dataset_id, job_id = seed(database_url)
        gc.collect()
        gc.freeze()  # see main()
        headers = {"Authorization": f"Bearer {key}"}
        calls = [
            (TARGET, Call("GET", f"/v1/jobs/{job_id}", headers)),
            ("POST /v1/jobs", Call("POST", "/v1/jobs", headers, job_body(dataset_id))),
        ]
        print(
            f"rate limiting on vs off, {args.database}, uvicorn {args.workers} worker(s), {args.connections} "
            f"connections, {os.cpu_count()} CPUs, {args.rounds} rounds of {args.duration:.0f} s per measurement",
            flush=True,
        )
        for round_no in range(1, args.rounds + 1):
            print(f"round {round_no}", flush=True)
            order = [("on", CHECKS_ON), ("off", CHECKS_OFF)]
            for mode, overrides in order if round_no % 2 else order[::-1]:
                with uvicorn_server("service.app:create_app", {**env, **overrides}, args, factory=True) as (
                    api_url,
                    api_pid,
                ):
                    for name, call in calls:
                        result, cpu = run_load(f"{name} [{mode}]", api_url, call, args, api_pid)
                        assert result.errors == 0, f"{name} [{mode}]: {result.errors} errors"
                        results.setdefault(name, {}).setdefault(mode, []).append((result.rps, cpu))
    print(f"\nrate limiting on / off ({args.database}), medians over rounds")
    print(f"  {'endpoint':<20} {'on req/s':>9} {'off req/s':>9} {'ratio':>6} {'per-round ratios':>24} "
          f"{'CPU ms/req on/off':>18}")
    summary: dict[str, dict[str, float]] = {}
    for name, modes in results.items():
        on, off = modes["on"], modes["off"]
        ratios = [a[0] / b[0] for a, b in zip(on, off, strict=True)]
        on_rps, off_rps = statistics.median(r for r, _ in on), statistics.median(r for r, _ in off)
        on_cpu, off_cpu = statistics.median(c for _, c in on), statistics.median(c for _, c in off)
        summary[name] = {"on_rps": on_rps, "off_rps": off_rps, "ratio": on_rps / off_rps,
                         "on_cpu_ms": on_cpu, "off_cpu_ms": off_cpu}
        print(f"  {name:<20} {on_rps:9.0f} {off_rps:9.0f} {on_rps / off_rps:6.2f} "
              f"{' '.join(f'{r:.2f}' for r in ratios):>24} {on_cpu:8.2f}/{off_cpu:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"database": args.database, "checks": summary}, indent=2))


def main() -> None:
    args = parse_args()
    if args.checks:
        main_checks(args)
        return
    closed: dict[str, list[tuple[Result, float, float]]] = {}  # name -> [(result, ratio, cpu ms/req)]
    opened: dict[str, list[tuple[Result, float, float]]] = {}  # name -> [(result, offered rate, 0)]
    with throwaway_database() as database_url, tempfile.TemporaryDirectory() as data_dir:
        env = {
            "GRPO_DATABASE_URL": database_url,
            "GRPO_DATA_DIR": data_dir,
            "GRPO_BROKER_URL": "memory://",
            "GRPO_ENV": "development",
        }
        os.environ.update(env)
        key, dataset_id, job_id = seed(database_url)
        # The load generator's own pauses count against whichever app it is loading: this process holds the
        # service's modules (it seeded the database with them), ~150k objects, and each full collection of
        # them stops it ~100 ms, with no answer read and no request sent: enough to move hello-world's open-loop
        # p99 at 1800 req/s from ~3 ms to tens of ms. Frozen for every app alike.
        gc.collect()
        gc.freeze()
        headers = {"Authorization": f"Bearer {key}"}
        calls = [
            (TARGET, Call("GET", f"/v1/jobs/{job_id}", headers)),
            (f"GET /v1/jobs?limit={LIST_LIMIT}", Call("GET", f"/v1/jobs?limit={LIST_LIMIT}", headers)),
            ("POST /v1/jobs", Call("POST", "/v1/jobs", headers, job_body(dataset_id))),
        ]
        print(
            f"uvicorn, {args.workers} worker(s) per app, {args.connections} connections, {os.cpu_count()} CPUs, "
            f"{args.rounds} rounds of {args.duration:.0f} s per measurement, open loop at "
            f"{args.open_fractions} x hello-world req/s",
            flush=True,
        )
        apis = [("", ROOT)] + ([(BASELINE, args.baseline.resolve())] if args.baseline else [])
        with uvicorn_server("api_load:hello_app", {}, args) as (hello_url, hello_pid):
            # Interleaved rounds: each ratio compares measurements taken under the same machine load.
            for round_no in range(1, args.rounds + 1):
                print(f"round {round_no}", flush=True)
                hello, hello_cpu = run_load(HELLO, hello_url, Call("GET", "/"), args, hello_pid)
                closed.setdefault(HELLO, []).append((hello, 1.0, hello_cpu))
                hello_async, hello_async_cpu = run_load(
                    HELLO_ASYNC, hello_url, Call("GET", "/async"), args, hello_pid
                )
                closed.setdefault(HELLO_ASYNC, []).append(
                    (hello_async, hello_async.rps / hello.rps, hello_async_cpu)
                )
                rates = [(fraction, fraction * hello.rps) for fraction in args.open_fractions]
                for fraction, rate in rates:
                    name = open_name(HELLO, fraction)
                    opened.setdefault(name, []).append(
                        (run_open_load(name, hello_url, Call("GET", "/"), rate, args), rate, 0.0)
                    )
                for suffix, source in apis:
                    with uvicorn_server("service.app:create_app", env, args, factory=True, source=source) as (
                        api_url,
                        api_pid,
                    ):
                        for name, call in calls:
                            result, cpu = run_load(name + suffix, api_url, call, args, api_pid)
                            closed.setdefault(name + suffix, []).append((result, result.rps / hello.rps, cpu))
                        for fraction, rate in rates:
                            name = open_name(TARGET + suffix, fraction)
                            result = run_open_load(name, api_url, calls[0][1], rate, args)
                            opened.setdefault(name, []).append((result, rate, 0.0))

    closed_summary, open_summary = print_summary(closed, opened)
    print_target(closed_summary, open_summary, "")
    if args.baseline:
        print_target(closed_summary, open_summary, BASELINE)
    if args.json:
        payload = {
            "closed_loop": closed_summary,
            "open_loop": open_summary,
            "open_fractions": args.open_fractions,
            "connections": args.connections,
            "workers": args.workers,
            "cpus": os.cpu_count(),
        }
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
