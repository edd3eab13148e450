"""`grpo serve`: the API process. REST (uvicorn) and gRPC on one event loop, the reaper, and by default an
embedded worker.

- REST on settings.api_host:api_port, gRPC on settings.grpc_port (0 disables it). REST believes
  X-Forwarded-For only from GRPO_TRUSTED_PROXIES (none by default).
- The reaper (service/execution/reaper.py) runs as a thread here: it re-enqueues jobs whose worker lost its lease,
  re-sends jobs whose message was lost and deletes expired Idempotency-Key records. Several API processes
  may each run one; they do not conflict.
- `--worker` (default) starts `grpo worker` as a child process, so `grpo serve` alone is a complete
  single-machine install (embedded SQLite database and broker, local storage). Production runs
  `grpo serve --no-worker` and GPU workers elsewhere. The worker is a separate process (never a fork of
  this one) and is stopped when this process exits normally.
- With a SQLite database the schema is migrated at start-up (`--migrate` forces it for any database).

This module imports the worker's reaper, which is torch-free; torch is never imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

import typer

from cli.migrate import upgrade_head
from cli.worker import parse_queues

if TYPE_CHECKING:  # the server's modules are imported when the command runs: the client installs without them
    from service.kit.config import Settings

log = logging.getLogger("grpo.serve")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
WORKER_STOP_TIMEOUT_S = 30.0


def serve(
    worker: bool = typer.Option(True, "--worker/--no-worker", help="Also run an embedded worker process."),
    queues: str = typer.Option("gpu,cpu", "--queues", help="Queues the embedded worker consumes."),
    host: str | None = typer.Option(None, "--host", help="REST bind address (default GRPO_API_HOST)."),
    port: int | None = typer.Option(None, "--port", help="REST port (default GRPO_API_PORT)."),
    grpc_port: int | None = typer.Option(None, "--grpc-port", help="gRPC port, 0 = off (default GRPO_GRPC_PORT)."),
    migrate: bool | None = typer.Option(None, "--migrate/--no-migrate",
                                        help="Migrate the schema first (default: only for SQLite)."),
    reaper: bool = typer.Option(
        True, "--reaper/--no-reaper", help="Run the reaper (expired leases, lost messages, expired idempotency keys)."
    ),
) -> None:
    """Serve the REST and gRPC APIs (and, by default, run a worker next to them)."""
    # Operator commands import the service only when run: the client install has none of it (import-linter).
    from service.kit.config import get_settings
    from service.observability.logs import setup_logging

    settings = get_settings()
    setup_logging(json_logs=settings.log_json)
    worker_queues = parse_queues(queues)
    if migrate if migrate is not None else settings.database_url.startswith("sqlite"):
        upgrade_head(settings.database_url)
    if settings.allow_private_reward_urls:
        log.warning("reward endpoints on loopback/private addresses are ALLOWED (GRPO_ALLOW_PRIVATE_REWARD_URLS; "
                    "development default). Set GRPO_ENV=production to refuse them.")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with _reaper(settings, enabled=reaper), _webhooks(settings), _embedded_worker(worker_queues, enabled=worker):
        asyncio.run(_serve_apis(settings, host or settings.api_host, port or settings.api_port,
                                settings.grpc_port if grpc_port is None else grpc_port))


def _exit_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM ends `serve` as SystemExit (status 143), through its cleanups. uvicorn stops on it, then raises
    it again once it has shut down: with the default action this process would end right there, before it stops
    its embedded worker, reaper and webhook dispatcher, and the worker, left to its parent-death signal, can hang
    in Celery's cold shutdown for good (a pool child that the same SIGTERM, sent to the whole process group,
    ended while it held the pool's queue lock)."""
    raise SystemExit(128 + signum)


async def _serve_apis(settings: Settings, host: str, port: int, grpc_port: int) -> None:
    # The server's modules, as in `serve`: only when the command runs.
    import uvicorn

    from service.app import create_app

    proxy_headers, forwarded_allow_ips = forwarded_headers(settings)
    server = uvicorn.Server(uvicorn.Config(create_app(), host=host, port=port, log_level="info",
                                          proxy_headers=proxy_headers, forwarded_allow_ips=forwarded_allow_ips))
    grpc_task: asyncio.Task[None] | None = None
    if grpc_port:
        from service.grpc.server import serve_grpc  # grpc loads only when the gRPC port is on

        grpc_task = asyncio.create_task(serve_grpc(grpc_port, host))
    try:
        await server.serve()  # returns on SIGINT/SIGTERM (uvicorn's handlers)
    finally:
        if grpc_task is not None:
            grpc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await grpc_task


def forwarded_headers(settings: Settings) -> tuple[bool, list[str] | None]:
    """uvicorn's `proxy_headers` and `forwarded_allow_ips` from GRPO_TRUSTED_PROXIES. uvicorn's own default
    trusts X-Forwarded-For from 127.0.0.1 (or $FORWARDED_ALLOW_IPS), so a local client could pick the address
    the failed-login throttle counts against; with no trusted proxy the headers are ignored and the TCP peer
    is the client."""
    if not settings.trusted_proxies:
        return False, None
    return True, list(settings.trusted_proxies)


@contextlib.contextmanager
def _reaper(settings: Settings, *, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    # The server's modules, as in `serve`: only when the command runs.
    from service.execution.reaper import start_reaper_thread
    from service.kit.queue import get_job_queue

    thread, stop = start_reaper_thread(get_job_queue(), settings)
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


@contextlib.contextmanager
def _webhooks(settings: Settings) -> Iterator[None]:
    """The webhook dispatcher (service/webhooks/delivery.py): sends the outbox, with retries."""
    from service.webhooks.delivery import start_dispatcher_thread  # the server's, as in `serve`

    thread, stop = start_dispatcher_thread(settings)
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


@contextlib.contextmanager
def _embedded_worker(queues: list[str], *, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    # A fresh interpreter (not a fork of this process): same environment, so the same settings.
    command = [sys.executable, "-c", "from cli import main; main()", "worker", "--queues", ",".join(queues)]
    process = subprocess.Popen(command, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    log.info("embedded worker started (pid %d, queues %s)", process.pid, ",".join(queues))
    try:
        yield
    finally:
        _stop(process)


def _die_with_parent() -> None:
    """In the embedded worker, before exec (Linux): SIGQUIT, Celery's cold shutdown, when `grpo serve` dies,
    even by SIGKILL, so no orphaned worker keeps polling. Its running job's lease then expires and resumes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGQUIT)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Cold-stop the worker: SIGQUIT makes Celery terminate at once; a running job's lease then expires
    and the job resumes from its last checkpoint on the next worker."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGQUIT)
    try:
        process.wait(timeout=WORKER_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log.info("embedded worker stopped (exit code %d)", process.returncode)
