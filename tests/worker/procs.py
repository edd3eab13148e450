"""Real processes for the worker's end-to-end tests: the API (`grpo serve`), workers (`grpo worker`), a private
redis-server, a private PostgreSQL cluster, and an HTTP client driving the API like a user would.

Every process runs in its own session (process group) so a test can SIGKILL/SIGSTOP a worker with all its
children (the Celery parent and the child running the job), like a machine dying or freezing.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import redis

from service.kit import db as kit_db
from service.kit.config import get_settings
from tests.forked_processes import fork_process
from tests.service.factories import create_tenant

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
GRPO = [sys.executable, "-c", "from cli import main; main()"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(
    predicate: Callable[[], T | None], *, timeout: float, interval: float = 0.2, what: str = "condition"
) -> T:
    """Poll until `predicate()` returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)



def _broker_databases() -> list[int]:
    """Databases 1-13 of the shared Redis, split between pytest-xdist workers: two workers never share a broker
    (db 0 is left to health checks, 14 to the rate limiter's tests, whose keys are unique per test)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if count > 13:
        raise RuntimeError(f"{count} pytest workers: the shared Redis has brokers for 13 at most")
    return [db for db in range(1, 14) if db % count == int(worker.removeprefix("gw")) % count]


# Handed out in turn, so that a test's broker is never one an earlier test of this session used moments ago.
_REDIS_DATABASES = itertools.cycle(_broker_databases())


def fresh_redis_database(base_url: str) -> str:
    """The URL of an emptied Redis database for one stack's broker: a message another test (or an interrupted
    run) left in it would otherwise be delivered before this test's own, or keep a queue from draining."""
    url = f"{base_url}/{next(_REDIS_DATABASES)}"
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    return url

class Child(Protocol):
    """What the tests use of a child process: a subprocess.Popen, or a worker forked from the zygote."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


@dataclass
class Proc:
    """A child process in its own process group, logging to a file."""

    name: str
    popen: Child
    log_path: Path

    def signal_group(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 15) -> None:
        if self.popen.poll() is not None:
            return
        self.signal_group(signal.SIGCONT)
        self.signal_group(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.popen.wait()

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)
        self.popen.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def spawn(name: str, args: list[str], env: dict[str, str], log_dir: Path, *, fork: str | None = None) -> Proc:
    """`args` in a process group of its own, logging to `log_dir/<name>.log`. With `fork` ("worker" for a `grpo
    worker` with the engine preloaded, "api" for `grpo serve`), forked from the zygote that has imported that
    command's modules (tests/zygote.py)."""
    log_path = log_dir / f"{name}.log"
    if fork is not None:
        forked = fork_process(fork, args, env, REPO, log_path)
        if forked is not None:
            return Proc(name, forked, log_path)
    with log_path.open("ab") as log_file:
        popen = subprocess.Popen(
            args, env=env, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Proc(name, popen, log_path)


class Stoppable(Protocol):
    def stop(self) -> None: ...


def stop_together(procs: Sequence[Stoppable]) -> None:
    """Stop every process at once: a Celery worker takes seconds to shut down (its pool's threads are joined one
    after the other), and waiting for each in turn made every test's teardown that many seconds longer."""
    with ThreadPoolExecutor(max_workers=max(1, len(procs))) as pool:
        for stopped in [pool.submit(proc.stop) for proc in procs]:
            stopped.result()


# --- the stack ------------------------------------------------------------------------------------


@dataclass
class Stack:
    """Environment shared by the API and the workers of one test (one database, broker and storage)."""

    database_url: str
    broker_url: str
    data_dir: Path
    lease_seconds: int = 5
    queued_resend_seconds: int = 5
    collective_timeout_seconds: int = 15  # multi-device jobs: a hung rank ends the attempt after this
    procs: list[Proc] = field(default_factory=list)
    api_port: int = 0
    grpc_port: int = 0  # 0 = no gRPC server
    extra_env: dict[str, str] = field(default_factory=dict)  # more GRPO_* settings for every process
    _worker_count: int = 0

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "GRPO_ENV": "development",
                "GRPO_DATABASE_URL": self.database_url,
                "GRPO_BROKER_URL": self.broker_url,
                "GRPO_DATA_DIR": str(self.data_dir),
                "GRPO_STORAGE_URL": str(self.data_dir / "storage"),
                "GRPO_LEASE_SECONDS": str(self.lease_seconds),
                "GRPO_QUEUED_RESEND_SECONDS": str(self.queued_resend_seconds),
                "GRPO_COLLECTIVE_TIMEOUT_SECONDS": str(self.collective_timeout_seconds),
                "GRPO_GRPC_PORT": str(self.grpc_port),
                # Two shared CPU cores: one thread per process keeps tests from starving each other.
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
                **self.extra_env,
            }
        )
        return env

    def start_api(self, *, worker: bool = False) -> Proc:
        self.api_port = free_port()
        args = [
            *GRPO,
            "serve",
            "--port",
            str(self.api_port),
            "--grpc-port",
            str(self.grpc_port),
            "--migrate",
            "--worker" if worker else "--no-worker",
        ]
        proc = spawn("api", args, self.env, self.data_dir, fork="api")
        self.procs.append(proc)
        wait_for(
            lambda: self._api_up(proc), timeout=90, what=f"the API on port {self.api_port}\n{proc.log()}"
        )
        return proc

    def _api_up(self, proc: Proc) -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"the API exited:\n{proc.log()}")
        try:
            return httpx.get(f"{self.base_url}/openapi.json", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start_worker(self, *, ready_timeout: float = 90, devices: int = 1, preload_engine: bool = True) -> Proc:
        """A `grpo worker`; by default with the engine preloaded in its parent (these are CPU-only workers): each
        job's child then starts without importing torch and transformers again."""
        self._worker_count += 1
        name = f"worker{self._worker_count}"
        proc = spawn(
            name,
            [*GRPO, "worker", "--queues", "gpu,cpu", "--devices", str(devices), "--hostname", f"{name}@%h"],
            {**self.env, "GRPO_WORKER_PRELOAD_ENGINE": "true" if preload_engine else "false"},
            self.data_dir,
            fork="worker" if preload_engine else None,
        )
        self.procs.append(proc)
        wait_for(lambda: self._worker_ready(proc), timeout=ready_timeout, what=f"{name} to be ready")
        return proc

    @staticmethod
    def _worker_ready(proc: Proc) -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.name} exited:\n{proc.log()}")
        return " ready." in proc.log()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def stop_all(self) -> None:
        stop_together(self.procs)

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} =====\n{p.log()[-6000:]}" for p in self.procs)

    def make_client(self) -> ApiClient:
        """A tenant with an API key, created directly in the database, and a client acting as it."""
        os.environ["GRPO_DATABASE_URL"] = self.database_url
        get_settings.cache_clear()
        kit_db._engine_for.cache_clear()
        kit_db._factory_for.cache_clear()
        engine = kit_db.make_engine(self.database_url)
        try:
            with kit_db.session_scope(engine) as session:
                _tenant, key = create_tenant(session, f"tenant-{os.urandom(4).hex()}")
        finally:
            engine.dispose()
        return ApiClient(
            httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        )


# --- a user of the API ----------------------------------------------------------------------------

TERMINAL = {"succeeded", "failed", "cancelled"}


@dataclass
class ApiClient:
    http: httpx.Client

    def upload_dataset(self, rows: list[dict[str, Any]]) -> str:
        body = "".join(json.dumps(row) + "\n" for row in rows).encode()
        response = self.http.post(
            "/v1/datasets", files={"file": ("prompts.jsonl", body, "application/jsonl")}
        )
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def submit(self, spec: dict[str, Any]) -> str:
        response = self.http.post("/v1/jobs", json=spec)
        assert response.status_code in (200, 201, 202), response.text
        return str(response.json()["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.http.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def post(self, path: str) -> dict[str, Any]:
        response = self.http.post(path)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def wait_status(self, job_id: str, statuses: set[str], *, timeout: float = 180) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            job = self.job(job_id)
            if job["status"] in statuses:
                return job
            if job["status"] in TERMINAL:
                raise AssertionError(
                    f"job ended {job['status']} while waiting for {statuses}: {job.get('error')}"
                )
            return None

        return wait_for(check, timeout=timeout, interval=0.3, what=f"job {job_id} to reach {statuses}")

    def wait_step(self, job_id: str, step: int, *, timeout: float = 180) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            job = self.job(job_id)
            if job["status"] in TERMINAL:
                raise AssertionError(f"job ended {job['status']} before step {step}: {job.get('error')}")
            return job if job["progress"]["step"] >= step else None

        return wait_for(check, timeout=timeout, interval=0.2, what=f"job {job_id} to reach step {step}")

    def events(self, job_id: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        after: int | None = None
        while True:
            params: dict[str, Any] = {"limit": 500} if after is None else {"limit": 500, "after": after}
            response = self.http.get(f"/v1/jobs/{job_id}/events", params=params)
            assert response.status_code == 200, response.text
            page = response.json()
            events += page["data"]
            if not page["has_more"]:
                return events
            after = page["next_after"]

    def resume_step(self, job_id: str, attempt: int) -> int:
        """The step attempt `attempt` resumed from, off its claim's event: `status` (-> running) when the job
        was queued (the reaper requeued it first), `lease_taken_over` when a redelivery found the previous
        attempt's lease lapsed first."""
        claims = [e for e in self.events(job_id) if "resume_step" in e["data"] and e["data"].get("attempt") == attempt]
        assert len(claims) == 1, claims
        return int(claims[0]["data"]["resume_step"])

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        response = self.http.get(f"/v1/jobs/{job_id}/checkpoints")
        assert response.status_code == 200, response.text
        return list(response.json()["data"])

    def metric_steps(self, job_id: str, name: str = "loss") -> list[int]:
        response = self.http.get(f"/v1/jobs/{job_id}/metrics")
        assert response.status_code == 200, response.text
        return list(response.json()["series"][name]["steps"])

    def download_checkpoint(self, checkpoint: dict[str, Any], target: Path) -> Path:
        for entry in checkpoint["files"]:
            response = self.http.get(f"/v1/checkpoints/{checkpoint['id']}/files/{entry['path']}")
            assert response.status_code == 200, response.text
            path = target / entry["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(response.content)
        return target


# --- private servers --------------------------------------------------------------------------------


@dataclass
class RedisServer:
    """A redis-server of our own (no persistence), so a test may shut it down and restart it."""

    port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for(self._pong, timeout=20, what=f"redis on {self.port}")

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.proc = None


@dataclass
class PostgresCluster:
    """A throwaway PostgreSQL cluster (initdb as the postgres user) that a test may restart."""

    port: int
    directory: Path

    def _run(self, *args: str) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", *args], check=True, capture_output=True, timeout=120
        )

    def init(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        shutil.chown(self.directory, "postgres", "postgres")
        self._run("initdb", "-D", str(self.directory / "data"), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "grpo")

    def start(self) -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.directory / "data"),
            "-l",
            str(self.directory / "pg.log"),
            "-w",
            "-o",
            f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.directory / "data"), "-m", mode, "-w", "stop")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/grpo"


def private_tmp(prefix: str) -> Path:
    """A temp dir the postgres user can enter (pytest's tmp_path lives under a 0700 root directory)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


class PeakMemory:
    """Samples `measure()` (bytes) every `interval_s` while in use; `.growth` is the peak over the starting value."""

    def __init__(self, measure: Callable[[], int], interval_s: float = 0.01) -> None:
        self.measure = measure
        self.interval_s = interval_s
        self.start = measure()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.measure())

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.measure())

    @property
    def growth(self) -> int:
        return self.peak - self.start
