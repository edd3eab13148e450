"""The `grpo` command line. Each subcommand group lives in its own module and registers here."""

from __future__ import annotations

import os

import typer

from cli import (
    admin,
    checkpoints,
    datasets,
    demo,
    environments,
    evals,
    jobs,
    keys,
    migrate,
    primitives_worker,
    rewards,
    serve,
    train,
    usage,
    webhooks,
    worker,
)

app = typer.Typer(help="GRPO training service: run the engine locally, serve the API, drive jobs.", no_args_is_help=True)
app.add_typer(admin.app, name="admin")
admin.app.command("set-budget")(usage.set_budget)
app.add_typer(datasets.app, name="datasets")
app.add_typer(rewards.app, name="rewards")
app.add_typer(environments.app, name="envs")
app.add_typer(jobs.app, name="jobs")
app.add_typer(checkpoints.app, name="checkpoints")
app.add_typer(evals.app, name="evals")
app.add_typer(keys.app, name="keys")
app.add_typer(webhooks.app, name="webhooks")
app.command("train")(train.train)
app.command("migrate")(migrate.migrate)
app.command("serve")(serve.serve)
app.command("worker")(worker.worker)
app.command("primitives-worker")(primitives_worker.primitives_worker)
app.command("demo")(demo.demo)
app.command("usage")(usage.usage)


# Top-level modules of the `server` and `worker` extras: the operator commands (serve, worker, migrate, admin,
# train, demo) import them when they run; the default install (the client) has none of them.
OPERATOR_MODULES = frozenset(
    {
        "sqlalchemy", "alembic", "fastapi", "uvicorn", "celery", "redis", "grpc", "pydantic_settings", "psycopg",
        "asyncpg", "fsspec", "s3fs", "standardwebhooks", "prometheus_client", "matplotlib", "multipart",
        "torch", "transformers", "tokenizers", "safetensors", "peft", "numpy", "tensorboardX",
    }
)


def main() -> None:
    # Before torch is imported anywhere (workers, `grpo train`): OpenMP's default spin-waiting burns 5-20x the
    # CPU of the work itself when cores are shared (measured in bench/README.md). Users can still override it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        app()
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in OPERATOR_MODULES:
            raise
        typer.echo(
            f"error: this command runs the server or the worker, which this install lacks ({exc.name} is missing):"
            " pip install 'grpo-service[server,worker]'",
            err=True,
        )
        raise SystemExit(1) from exc
