"""Property-based check of the live API: schemathesis over the app's own OpenAPI, run by
tests/service/test_schemathesis.py inside a network namespace that has only loopback.

    unshare -n python -m tests.service.api_fuzz --database <name> --workdir <dir>

1. Brings loopback up and proves the isolation: PostgreSQL's TCP port on the host is unreachable from here,
   so neither is any other address (the app reaches PostgreSQL through its Unix socket).
2. Migrates the (empty) database, serves the real app with uvicorn on 127.0.0.1, and seeds one tenant with a
   dataset, a reward function served by a real reward endpoint on loopback, a webhook, and a job with events,
   metrics, samples and a checkpoint, so the operations that take an id get past their 404 half of the time.
3. Runs the schemathesis CLI (examples, coverage and fuzzing phases, a fixed seed, a bounded number of
   examples per operation) with every check except two: `positive_data_acceptance`, as a schema-valid body
   may be refused with a 422 for reasons a schema cannot state (a dataset id that does not exist, a JSONL
   line that is not a prompt); and `negative_data_rejection`, as pydantic's lax mode reads JSON `true` as 1
   in a number field, which that check counts as accepting invalid data (not a 5xx, not a broken response,
   but it made the run depend on which numbers the generator happened to replace with booleans). Strings and integers (HOSTILE_PARAMETERS by name, the rest where schemathesis can)
   are, some of the time, a value from HOSTILE_TEXT / HOSTILE_INTEGERS instead (NUL, integers beyond int64, non-ASCII text...).

Exits with schemathesis' status; prints a one-line JSON summary (operations, cases, failures, seconds) last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.openenv_servers import calculator
from tests.worker.reward_servers import RewardServer

SOCKET_DIR = os.environ.get("GRPO_TEST_POSTGRES_SOCKET_DIR", "/var/run/postgresql")
SEED = 20261125
# Examples per operation in the fuzzing phase. Its cost grows with this number (hypothesis draws every case) while
# the coverage phase's boundary cases do not depend on it; GRPO_TEST_FUZZ_EXAMPLES runs a deeper search on demand.
MAX_EXAMPLES = int(os.environ.get("GRPO_TEST_FUZZ_EXAMPLES", "20"))

# Drawn in place of a generated value with the probability below: the classes of input that reached a 500.
# Text and integers apart: in a query string 99999999999999999999 is also a valid string, so an integer drawn for
# a string parameter would count as a schema violation the API rightly accepts.
HOSTILE_TEXT = ["\x00", "a\x00b", "99999999999999999999", "-99999999999999999999", "9223372036854775808",
                "2147483648", "null", "café", "\x7f", "NaN", "1e309"]
HOSTILE_INTEGERS = [9223372036854775807, 9223372036854775808, -9223372036854775809, 2147483647, 2147483648,
                    99999999999999999999]
HOSTILE_PROBABILITY = 0.15
# schemathesis applies the type-wide bindings only to parameters whose schema has a top-level `type` (not to
# optional ones, an anyOf with null) and to no JSON body field: these get the text values by name (an
# integer parameter among them gets them as type violations, which it must refuse).
HOSTILE_PARAMETERS = [
    "query.after", "query.names", "query.types", "query.step", "query.since_step",
    "header.Last-Event-ID", "header.Idempotency-Key",
    "body.name", "body.description", "body.url", "body.base_model", "body.train_dataset", "body.eval_dataset",
    "body.items[*].prompt", "body.items[*].completion",
]
ID_PROBABILITY = 0.5  # how often a path id is the seeded resource's rather than a generated one


def isolate() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=1).close()
    except OSError:
        return
    raise SystemExit("not network-isolated: the host's 127.0.0.1:5432 answers (run under `unshare -n`)")


def serve(url: str) -> tuple[str, Any, threading.Thread]:
    import uvicorn

    from service.app import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise SystemExit("the app did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def seed(base_url: str, reward_server: RewardServer, environment_url: str) -> tuple[str, dict[str, str]]:
    """One tenant and one resource of each kind; returns the tenant's API key and the ids. The reward function
    is `reward_server`, which is given its signing secret; the environment is the OpenEnv server at
    `environment_url`."""
    from service.execution import reporting
    from service.execution.lease import claim_job
    from service.jobs import progress
    from service.jobs.schemas import SampleIn
    from service.kit.db import session_scope
    from service.storage import checkpoint_key, get_storage
    from tests.service.factories import create_tenant

    with session_scope() as session:
        _tenant, key = create_tenant(session, "fuzz")
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base_url, headers=auth, timeout=30) as client:

        def created(response: httpx.Response) -> dict[str, Any]:
            assert response.status_code == 201, response.text
            body: dict[str, Any] = response.json()
            return body

        lines = b"".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}).encode() + b"\n" for i in range(8))
        dataset = created(client.post("/v1/datasets", files={"file": ("add.jsonl", lines)}))
        reward = created(client.post("/v1/reward-functions", json={"name": "judge", "url": reward_server.url}))
        reward_server.secret = reward["signing_secret"]
        webhook = created(client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/hook"}))
        environment = created(client.post("/v1/environments", json={"name": "calc", "url": environment_url}))
        spec = {
            "base_model": "builtin:tiny",
            "train_dataset": dataset["id"],
            "rewards": [{"type": "builtin", "name": "exact_match"}],
            "hyperparameters": {"max_steps": 4, "num_generations": 2, "prompts_per_step": 2},
        }
        job = created(client.post("/v1/jobs", json=spec))
    with session_scope() as session:
        claim = claim_job(session, job["id"], "fuzz-worker", lease_seconds=3600)
    assert claim is not None
    reporting.record_step(claim, 1, {"reward/mean": 0.5, "kl": 0.01}, [SampleIn(prompt="1+1=", completion="2")])
    content = b'{"r": 16}'
    checkpoint_id = "ckpt_fuzz"
    get_storage().put_stream(checkpoint_key(job["id"], checkpoint_id, "adapter_config.json"), [content])
    reporting.record_checkpoint(
        claim, checkpoint_id=checkpoint_id, step=1,
        files={"adapter_config.json": {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}},
    )
    with session_scope() as session:
        progress.record_event(session, job["id"], claim.attempt, "log", "seeded by the API fuzz run")
    ids = {
        "job_id": job["id"],
        "dataset_id": dataset["id"],
        "reward_function_id": reward["id"],
        "webhook_id": webhook["id"],
        "environment_id": environment["id"],
        "checkpoint_id": checkpoint_id,
        "path": "adapter_config.json",
    }
    return key, ids


def config(ids: dict[str, str], max_examples: int) -> str:
    """The schemathesis.toml of the run."""
    lines = [
        f"seed = {SEED}",
        "[generation]",
        f"max-examples = {max_examples}",
        "[phases]",
        "stateful.enabled = false",
        "[dictionaries.hostile_text]",
        f"values = {json.dumps(HOSTILE_TEXT, ensure_ascii=True)}",
        "[dictionaries.hostile_integers]",
        f"values = {json.dumps(HOSTILE_INTEGERS)}",
        "[generation.dictionaries]",
        f'string = {{ dictionary = "hostile_text", probability = {HOSTILE_PROBABILITY} }}',
        f'integer = {{ dictionary = "hostile_integers", probability = {HOSTILE_PROBABILITY} }}',
    ]
    for name in ids:
        lines.append(f"[dictionaries.{name}]")
        lines.append(f"values = [{json.dumps(ids[name])}]")
    lines.append("[parameters]")
    for name in ids:
        lines.append(f'"path.{name}" = {{ dictionary = "{name}", probability = {ID_PROBABILITY} }}')
    for key in HOSTILE_PARAMETERS:
        lines.append(f'"{key}" = {{ dictionary = "hostile_text", probability = {HOSTILE_PROBABILITY} }}')
    return "\n".join(lines) + "\n"


def fuzz(base_url: str, key: str, ids: dict[str, str], workdir: Path, max_examples: int) -> tuple[int, float, Path]:
    """Run schemathesis over the live app; its exit status, how long it took, and where its JSON report is."""
    config_path = workdir / "schemathesis.toml"
    config_path.write_text(config(ids, max_examples))
    report = workdir / "report.json"
    started = time.monotonic()
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "--config-file", str(config_path),
        "run", f"{base_url}/openapi.json",
        "--header", f"Authorization: Bearer {key}",
        "--phases", "examples,coverage,fuzzing",
        "--checks", "all",
        "--exclude-checks", "positive_data_acceptance,negative_data_rejection",
        "--continue-on-failure",
        "--workers", "1",
        "--report", "json", "--report-json-path", str(report),
    ]
    # cwd: schemathesis keeps a cache directory in the working directory.
    status = subprocess.run(command, check=False, cwd=workdir).returncode
    return status, time.monotonic() - started, report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database", required=True, help="an existing, empty PostgreSQL database")
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--max-examples", type=int, default=MAX_EXAMPLES)
    args = parser.parse_args()
    isolate()
    url = f"postgresql+psycopg://postgres@/{args.database}?host={SOCKET_DIR}"
    workdir: Path = args.workdir
    os.environ.update(
        GRPO_ENV="development",
        GRPO_DATABASE_URL=url,
        GRPO_DATA_DIR=str(workdir / "data"),
        GRPO_STORAGE_URL=str(workdir / "storage"),
        GRPO_BROKER_URL="memory://",
        GRPO_GC_FREEZE="false",
    )
    from cli.migrate import upgrade_head

    upgrade_head(url)
    base_url, server, thread = serve(url)
    reward_server = RewardServer(secret="").start()
    try:
        # The example OpenEnv environment (its own process, in this network namespace too), so that the
        # environment routes are fuzzed on a registered one.
        with calculator(workdir) as environment_url:
            key, ids = seed(base_url, reward_server, environment_url)
            status, seconds, report = fuzz(base_url, key, ids, workdir, args.max_examples)
    finally:
        reward_server.stop()
        server.should_exit = True
        thread.join(timeout=30)
    print(json.dumps({"status": status, "seconds": round(seconds, 1), **summary(report)}))
    return status


def summary(report: Path) -> dict[str, Any]:
    """The run's figures from schemathesis' JSON report ({} when it wrote none)."""
    if not report.exists():
        return {}
    data = json.loads(report.read_text())
    return {
        "operations": data["operations"]["tested"],
        "operations_total": data["operations"]["total"],
        "cases": data["test_cases"]["generated"],
        "cases_with_failures": data["test_cases"]["with_failures"],
        "errored": data["test_cases"]["errored"] + data["operations"]["errored"] + len(data["errors"]),
        "phases": {name: phase["status"] for name, phase in data["phases"].items()},
    }


if __name__ == "__main__":
    sys.exit(main())
