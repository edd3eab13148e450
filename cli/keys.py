"""`grpo keys create|list|revoke`: your tenant's API keys, over the API (needs a key with the `admin` scope).

`grpo admin create-key|list-keys|revoke-key` do the same from the server's shell, on the database directly.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import typer

from cli.output import JsonOpt, api_client, emit

app = typer.Typer(help="API keys of your tenant (an admin-scoped key).", no_args_is_help=True)
COLUMNS = ["id", "name", "scopes", "prefix", "created_at", "expires_at", "last_used_at", "revoked_at"]
ScopeOpt = typer.Option(None, "--scope", help="read, write or admin; repeat for several (default: read, write).")


def expiry(days: float | None) -> datetime | None:
    return datetime.now(UTC) + timedelta(days=days) if days is not None else None


@app.command()
def create(
    name: str = typer.Argument(..., help="What the key is for."),
    scope: list[str] | None = ScopeOpt,
    expires_in_days: float | None = typer.Option(None, help="Days until the key stops working (default never)."),
    as_json: JsonOpt = False,
) -> None:
    """Create a key. Prints it: the only time it is shown."""
    with api_client() as client:
        created = client.create_api_key(name, scope or None, expiry(expires_in_days))
    emit(created, [*COLUMNS, "key"], as_json=as_json)


@app.command("list")
def list_(limit: int = 20, after: str | None = None, as_json: JsonOpt = False) -> None:
    """List your tenant's keys, revoked and expired ones included."""
    with api_client() as client:
        emit(client.list_api_keys(limit, after).data, COLUMNS, as_json=as_json)


@app.command()
def revoke(api_key_id: str) -> None:
    """Revoke a key (other API processes refuse it within GRPO_AUTH_CACHE_SECONDS)."""
    with api_client() as client:
        client.revoke_api_key(api_key_id)
    typer.echo(f"revoked {api_key_id}")
