"""`grpo webhooks list|get|rotate-secret|delete`: webhook endpoints receiving job events."""

from __future__ import annotations

import typer

from cli.output import JsonOpt, api_client, emit

app = typer.Typer(help="Webhook endpoints.", no_args_is_help=True)
COLUMNS = ["id", "url", "description", "created_at", "previous_secret_expires_at"]


@app.command()
def create(url: str, description: str | None = None, as_json: JsonOpt = False) -> None:
    """Register a URL for every job event. Prints its signing secret: the only time it is shown."""
    with api_client() as client:
        emit(client.create_webhook(url, description), [*COLUMNS, "secret"], as_json=as_json)


@app.command("list")
def list_(limit: int = 20, after: str | None = None, as_json: JsonOpt = False) -> None:
    """List your webhooks."""
    with api_client() as client:
        emit(client.list_webhooks(limit, after).data, COLUMNS, as_json=as_json)


@app.command("rotate-secret")
def rotate_secret(webhook_id: str, as_json: JsonOpt = False) -> None:
    """Issue a new signing secret (printed once); deliveries are signed with both until the overlap ends."""
    with api_client() as client:
        emit(client.rotate_webhook_secret(webhook_id), ["id", "secret", "previous_secret_expires_at"], as_json=as_json)


@app.command()
def delete(webhook_id: str) -> None:
    """Delete a webhook (pending deliveries are dropped)."""
    with api_client() as client:
        client.delete_webhook(webhook_id)
    typer.echo(f"deleted {webhook_id}")
