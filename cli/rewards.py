"""`grpo rewards register|list|get|test|rotate-secret|delete`: remote reward endpoints."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from cli.output import JsonOpt, api_client, emit

app = typer.Typer(help="Remote reward endpoints.", no_args_is_help=True)
COLUMNS = ["id", "name", "url", "timeout_s", "max_batch_size", "max_concurrency", "created_at"]


@app.command()
def register(
    name: str = typer.Argument(..., help="A name for the endpoint."),
    url: str = typer.Argument(..., help="https URL receiving signed scoring requests."),
    timeout_s: float | None = typer.Option(None, help="Per-request timeout."),
    max_batch_size: int | None = typer.Option(None, help="Most completions per request."),
    max_concurrency: int | None = typer.Option(None, help="Most requests in flight."),
    as_json: JsonOpt = False,
) -> None:
    """Register an endpoint. Prints its signing secret: the only time it is shown."""
    with api_client() as client:
        created = client.register_reward_function(
            name, url, timeout_s=timeout_s, max_batch_size=max_batch_size, max_concurrency=max_concurrency
        )
    emit(created, [*COLUMNS, "signing_secret"], as_json=as_json)


@app.command("list")
def list_(limit: int = 20, after: str | None = None, as_json: JsonOpt = False) -> None:
    """List your reward endpoints."""
    with api_client() as client:
        emit(client.list_reward_functions(limit, after).data, COLUMNS, as_json=as_json)


@app.command()
def get(reward_function_id: str, as_json: JsonOpt = False) -> None:
    """Show one reward endpoint (never its secret)."""
    with api_client() as client:
        emit(client.get_reward_function(reward_function_id), COLUMNS, as_json=as_json)


@app.command()
def test(
    reward_function_id: str,
    items: Path = typer.Option(..., "--items", exists=True, help="JSON file: a list of {prompt, completion, ...}."),
    as_json: JsonOpt = False,
) -> None:
    """Call the endpoint now, with real signing and validation."""
    with api_client() as client:
        result = client.test_reward_function(reward_function_id, json.loads(items.read_text()))
    emit(result, list(type(result).model_fields), as_json=as_json)


@app.command("rotate-secret")
def rotate_secret(reward_function_id: str, as_json: JsonOpt = False) -> None:
    """Issue a new signing secret (printed once); requests are signed with both until the overlap ends."""
    with api_client() as client:
        emit(
            client.rotate_reward_secret(reward_function_id),
            ["id", "signing_secret", "previous_secret_expires_at"],
            as_json=as_json,
        )


@app.command()
def delete(reward_function_id: str) -> None:
    """Delete a reward endpoint."""
    with api_client() as client:
        client.delete_reward_function(reward_function_id)
    typer.echo(f"deleted {reward_function_id}")
