"""`grpo admin ...`: tenants and API keys (on an already migrated database: run `grpo migrate` first)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Administration: tenants and API keys.", no_args_is_help=True)


@app.command("create-tenant")
def create_tenant(name: str = typer.Argument(..., help="Unique tenant name.")) -> None:
    """Create a tenant and print its id and a first API key (shown once)."""
    from service.kit.db import session_scope
    from service.kit.errors import DomainError
    from service.tenants import service as tenants

    try:
        with session_scope() as session:
            tenant = tenants.create_tenant(session, name)
            _key, token = tenants.create_api_key(session, tenant)
    except DomainError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"tenant: {tenant.id} ({tenant.name})", err=True)
    typer.echo("api key (shown once, store it now):", err=True)
    typer.echo(token)


@app.command("create-key")
def create_key(tenant: str = typer.Argument(..., help="Tenant name or id.")) -> None:
    """Create a new API key for an existing tenant and print it (shown once)."""
    from service.kit.db import session_scope
    from service.kit.errors import DomainError
    from service.tenants import service as tenants

    try:
        with session_scope() as session:
            row = tenants.find_tenant(session, tenant)
            _key, token = tenants.create_api_key(session, row)
    except DomainError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"api key for {row.name} (shown once, store it now):", err=True)
    typer.echo(token)
