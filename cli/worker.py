"""`grpo worker`: a Celery worker running `grpo.run_job` (see worker/celery_app.py for why it is set up so).

One job at a time: start one worker per GPU with CUDA_VISIBLE_DEVICES, or one worker for several devices
(`--devices N`, settings.worker_devices): it then also takes jobs needing up to N devices, whose ranks it
launches (worker/runner.py). The
service package never imports torch; the worker modules are imported only when this command runs, and
torch only inside the child process that runs a job.
"""

from __future__ import annotations

import typer

VALID_QUEUES = ("gpu", "cpu")
POOLS = ("prefork", "solo")


def parse_queues(value: str) -> list[str]:
    """"gpu,cpu" -> ["gpu", "cpu"]; an unknown or empty name is an error naming it."""
    names = [name.strip() for name in value.split(",")]
    for name in names:
        if name not in VALID_QUEUES:
            raise typer.BadParameter(f"unknown queue {name!r}; choose from {', '.join(VALID_QUEUES)}",
                                     param_hint="--queues")
    return names


def worker_argv(queues: list[str], pool: str, loglevel: str, hostname: str | None) -> list[str]:
    """The `celery worker` command line: one process slot, no gossip/mingle/event heartbeats (unused)."""
    argv = [
        "worker", "--queues", ",".join(queues), "--concurrency", "1", "--pool", pool,
        "--prefetch-multiplier", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
        "--loglevel", loglevel,
    ]
    if hostname:
        argv += ["--hostname", hostname]
    return argv


def worker(
    queues: str = typer.Option("gpu,cpu", "--queues", "-Q", help="Comma-separated queues to consume: gpu, cpu."),
    devices: int | None = typer.Option(
        None, "--devices", min=1, help="Devices of this worker (default GRPO_WORKER_DEVICES, 1): it also consumes "
        "the gpu-N / cpu-N queues of jobs needing up to that many.",
    ),
    pool: str = typer.Option("prefork", "--pool", "-P",
                             help="prefork: each job in a fresh child process (default); solo: in this process."),
    loglevel: str = typer.Option("INFO", "--loglevel", "-l", help="Log level."),
    hostname: str | None = typer.Option(None, "--hostname", "-n", help="Celery node name (default celery@host)."),
) -> None:
    """Run a worker that trains queued jobs (broker: GRPO_BROKER_URL; embedded SQLite broker by default)."""
    if pool not in POOLS:
        raise typer.BadParameter(f"unknown pool {pool!r}; choose from {', '.join(POOLS)}", param_hint="--pool")
    # Operator commands import the service and the worker only when run: the client install has neither
    # (import-linter).
    from service.kit.config import get_settings
    from service.kit.queue import queues_for_devices

    argv = worker_argv(
        queues_for_devices(parse_queues(queues), devices or get_settings().worker_devices), pool, loglevel, hostname
    )
    _observability()
    from worker.celery_app import app as celery_app  # Celery and the worker: only when run, as above

    celery_app.worker_main(argv)


def _observability() -> None:
    """JSON logs with job id/attempt (GRPO_LOG_JSON) and the /metrics server (GRPO_WORKER_METRICS_PORT).

    Must run before the pool forks: the children inherit the metrics directory and logging hooks.
    """
    # Only `grpo worker` runs this: the service's modules load then, not with the CLI (import-linter).
    from service.kit.config import get_settings
    from service.observability.logs import install_celery_logging

    settings = get_settings()
    install_celery_logging(json_logs=settings.log_json)
    if settings.worker_metrics_port:
        from worker.metrics import start_for_celery_worker  # only with a metrics port

        start_for_celery_worker(settings.worker_metrics_port, settings.data_dir, settings.worker_metrics_host)
