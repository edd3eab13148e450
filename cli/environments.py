"""`grpo envs register|list|get|check|rotate-secret|delete`: user-hosted OpenEnv environment servers; `grpo envs
serve`: host a Python environment class as one."""

from __future__ import annotations

import typer

from cli.output import JsonOpt, api_client, emit
from contract.environment_factory import load_class, public_tools

app = typer.Typer(help="Environments: OpenEnv servers that multi-turn jobs run episodes on.", no_args_is_help=True)
COLUMNS = ["id", "name", "url", "max_concurrency", "health", "created_at"]


@app.command()
def register(
    name: str = typer.Argument(..., help="A name for the environment."),
    url: str = typer.Argument(..., help="Base URL of the OpenEnv server (/health, /schema, WS /ws below it)."),
    max_concurrency: int | None = typer.Option(None, help="Most episodes a job runs on it at once."),
    step_timeout_s: float | None = typer.Option(None, help="Per-message timeout."),
    episode_timeout_s: float | None = typer.Option(None, help="Most wall time of one episode."),
    as_json: JsonOpt = False,
) -> None:
    """Register a server (its /health and /schema are read now). Prints its signing secret: the only time it is
    shown."""
    options = {"max_concurrency": max_concurrency, "step_timeout_s": step_timeout_s,
               "episode_timeout_s": episode_timeout_s}
    with api_client() as client:
        created = client.register_environment(name, url, **{k: v for k, v in options.items() if v is not None})
    emit(created, [*COLUMNS, "signing_secret"], as_json=as_json)


@app.command("list")
def list_(limit: int = 20, after: str | None = None, as_json: JsonOpt = False) -> None:
    """List your environments."""
    with api_client() as client:
        emit(client.list_environments(limit, after).data, COLUMNS, as_json=as_json)


@app.command()
def get(environment_id: str, as_json: JsonOpt = False) -> None:
    """Show one environment, with the schemas its server published (never its secret)."""
    with api_client() as client:
        emit(client.get_environment(environment_id), [*COLUMNS, "schemas"], as_json=as_json)


@app.command()
def check(environment_id: str, as_json: JsonOpt = False) -> None:
    """Read the server's /health and /schema again, signed, as a job would reach it."""
    with api_client() as client:
        emit(client.check_environment(environment_id), COLUMNS, as_json=as_json)


@app.command("rotate-secret")
def rotate_secret(environment_id: str, as_json: JsonOpt = False) -> None:
    """Issue a new signing secret (printed once); requests are signed with both until the overlap ends."""
    with api_client() as client:
        emit(client.rotate_environment_secret(environment_id), ["id", "signing_secret", "previous_secret_expires_at"],
             as_json=as_json)


@app.command()
def delete(environment_id: str) -> None:
    """Delete an environment (jobs that name it keep using it)."""
    with api_client() as client:
        client.delete_environment(environment_id)
    typer.echo(f"deleted {environment_id}")


@app.command()
def serve(
    target: str = typer.Argument(..., help="module:Class, a TRL-style environment class (cli/env_host.py)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback unless you say otherwise)."),
    port: int = typer.Option(8010, help="Port to listen on."),
    max_sessions: int = typer.Option(8, min=1, help="Episodes served at once (OpenEnv's max_concurrent_envs)."),
) -> None:
    """Serve an environment class over OpenEnv's protocol: its public methods are tools, one instance a session."""
    try:
        cls = load_class(target)
        public_tools(cls)
    except (ValueError, ImportError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    # OpenEnv and uvicorn are the `env` extra's: imported when the command runs, not with the CLI. A class that
    # cannot be served is refused above, before OpenEnv's import (gradio with it) costs seconds.
    import uvicorn

    from cli.env_host import hosted_app

    uvicorn.run(hosted_app(cls, max_sessions), host=host, port=port)
