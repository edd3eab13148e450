"""Queue latency: submit -> `running` with an idle worker, on Redis and on the embedded default.

For each broker it starts a real stack (`grpo serve --no-worker` + `grpo worker`, or `grpo serve` with its
embedded worker), then N times: submit a `builtin:tiny` job, wait until it is `running`, cancel it and wait
until the worker is idle again. Latency is `started_at - created_at` from the job itself (the API stamps
created_at before the commit that enqueues; the worker stamps started_at in its claim), so polling
granularity does not count. The first job of each run is a warm-up and is left out.

    python bench/queue_latency.py [--samples 12] [--only redis|embedded]

Redis: 127.0.0.1:6379 (database 15) with a throwaway PostgreSQL database on 127.0.0.1:5432.
Embedded: SQLite database and kombu's SQL transport on SQLite (worker.embedded_broker) in a temp dir.
Target: p50 <= 1 s on Redis.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: reuse the tests' process helpers

from tests.worker.conftest import PROMPTS, tiny_spec  # noqa: E402
from tests.worker.procs import ApiClient, Stack, private_tmp, wait_for  # noqa: E402

POSTGRES_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/15"
# After a job the worker's child exits and a fresh one is forked (worker_max_tasks_per_child=1); on a busy
# machine that takes a few seconds, and a job submitted meanwhile waits for it. Measure an idle worker.
IDLE_WAIT_S = 3.0


def measure(stack: Stack, api: ApiClient, samples: int) -> list[float]:
    dataset = api.upload_dataset(PROMPTS)
    latencies: list[float] = []
    for index in range(samples + 1):
        job_id = api.submit(tiny_spec(dataset, max_steps=1000, checkpoint_every=1000))
        job = api.wait_status(job_id, {"running"}, timeout=120)
        api.post(f"/v1/jobs/{job_id}/cancel")
        api.wait_status(job_id, {"cancelled"}, timeout=180)
        started = datetime.fromisoformat(job["started_at"])
        created = datetime.fromisoformat(job["created_at"])
        latency = (started - created).total_seconds()
        if index > 0:  # the first job pays for the first connection and the model build
            latencies.append(latency)
        print(f"  job {index:2d}: submit -> running {latency * 1000:7.1f} ms{'  (warm-up)' if index == 0 else ''}")
        time.sleep(IDLE_WAIT_S)
    return latencies


def run_redis(samples: int) -> list[float]:
    name = f"grpo_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(POSTGRES_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    stack = Stack(database_url=POSTGRES_ADMIN.rsplit("/", 1)[0] + f"/{name}", broker_url=REDIS_URL,
                  data_dir=private_tmp("grpo-bench-redis-"), lease_seconds=60, queued_resend_seconds=120)
    try:
        stack.start_api()
        stack.start_worker()
        return measure(stack, stack.make_client(), samples)
    finally:
        stack.stop_all()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run_embedded(samples: int) -> list[float]:
    data_dir = private_tmp("grpo-bench-embedded-")
    stack = Stack(database_url=f"sqlite:///{data_dir}/grpo.db", broker_url=f"sqla+sqlite:///{data_dir}/broker.db",
                  data_dir=data_dir, lease_seconds=60, queued_resend_seconds=120)
    try:
        api_proc = stack.start_api(worker=True)
        wait_for(lambda: " ready." in api_proc.log(), timeout=120, what="the embedded worker")
        return measure(stack, stack.make_client(), samples)
    finally:
        stack.stop_all()


def summary(name: str, latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return (f"{name:9s} n={len(ordered):2d}  p50 {statistics.median(ordered) * 1000:7.1f} ms  "
            f"p95 {p95 * 1000:7.1f} ms  max {ordered[-1] * 1000:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=12, help="Measured jobs per broker (after one warm-up).")
    parser.add_argument("--only", choices=["redis", "embedded"], help="Measure one broker only.")
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    for name, run in (("redis", run_redis), ("embedded", run_embedded)):
        if args.only in (None, name):
            print(f"{name}:")
            results[name] = run(args.samples)
    print("\nsubmit -> running with an idle worker")
    for name, latencies in results.items():
        print(summary(name, latencies))


if __name__ == "__main__":
    main()
