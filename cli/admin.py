"""`grpo admin ...`: tenants, API keys and quotas (on an already migrated database: run `grpo migrate` first).

The same operations as /v1/api-keys, from the server's shell: for the first key of a tenant, and for when no
admin key is at hand. Keys made here have every scope unless `--scope` says otherwise. Each command imports
the service when it runs: the client-only install has none of it.
"""

from __future__ import annotations

import typer
from pydantic import ValidationError

from cli.keys import COLUMNS, expiry
from cli.output import JsonOpt, emit
from contract.api.quotas import QUOTA_NAMES, QuotaLimits

app = typer.Typer(help="Administration: tenants, API keys and quotas.", no_args_is_help=True)
ScopeOpt = typer.Option(None, "--scope", help="read, write or admin; repeat for several (default: all three).")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


@app.command("create-tenant")
def create_tenant(name: str = typer.Argument(..., help="Unique tenant name.")) -> None:
    """Create a tenant and print its id and a first API key, with every scope (shown once)."""
    # Operator commands import the service only when run: the client install has none of it (import-linter).
    from service.kit.db import session_scope
    from service.kit.errors import DomainError
    from service.tenants import service as tenants

    try:
        with session_scope() as session:
            tenant = tenants.create_tenant(session, name)
            _key, token = tenants.create_api_key(session, tenant, name="created with the tenant")
    except DomainError as exc:
        raise _fail(exc.message) from exc
    typer.echo(f"tenant: {tenant.id} ({tenant.name})", err=True)
    typer.echo("api key (shown once, store it now):", err=True)
    typer.echo(token)


@app.command("create-key")
def create_key(
    tenant: str = typer.Argument(..., help="Tenant name or id."),
    scope: list[str] | None = ScopeOpt,
    name: str = typer.Option("", help="What the key is for."),
    expires_in_days: float | None = typer.Option(None, help="Days until the key stops working (default never)."),
    as_json: JsonOpt = False,
) -> None:
    """Create a new API key for an existing tenant and print it (shown once)."""
    # Operator commands import the service only when run: the client install has none of it (import-linter).
    from service.kit.db import session_scope
    from service.kit.errors import DomainError
    from service.tenants import service as tenants
    from service.tenants.schemas import api_key_with_secret
    from service.tenants.scopes import ALL_SCOPES

    try:
        with session_scope() as session:
            row = tenants.find_tenant(session, tenant)
            key, token = tenants.create_api_key(
                session, row, scopes=scope or ALL_SCOPES, name=name, expires_at=expiry(expires_in_days)
            )
            created = api_key_with_secret(key, token)
    except DomainError as exc:
        raise _fail(exc.message) from exc
    if as_json:
        emit(created, [*COLUMNS, "key"], as_json=True)
        return
    typer.echo(f"api key {created.id} for {row.name}, scopes {' '.join(created.scopes)} (shown once, store it now):",
               err=True)
    typer.echo(token)


@app.command("list-keys")
def list_keys(
    tenant: str = typer.Argument(..., help="Tenant name or id."), limit: int = 100, as_json: JsonOpt = False
) -> None:
    """List a tenant's API keys, revoked and expired ones included."""
    # Operator commands import the service only when run: the client install has none of it (import-linter).
    from service.kit.db import session_scope
    from service.kit.errors import DomainError
    from service.tenants import service as tenants
    from service.tenants.schemas import api_key_out

    try:
        with session_scope() as session:
            row = tenants.find_tenant(session, tenant)
            keys, _more = tenants.list_api_keys(session, row.id, limit=limit, after=None)
            listed = [api_key_out(k) for k in keys]
    except DomainError as exc:
        raise _fail(exc.message) from exc
    emit(listed, COLUMNS, as_json=as_json)


@app.command("revoke-key")
def revoke_key(
    tenant: str = typer.Argument(..., help="Tenant name or id."), api_key_id: str = typer.Argument(..., help="key_...")
) -> None:
    """Revoke a key. API processes refuse it within GRPO_AUTH_CACHE_SECONDS."""
    # Operator commands import the service only when run: the client install has none of it (import-linter).
    from service.kit.db import session_scope
    from service.kit.errors import DomainError
    from service.tenants import service as tenants

    try:
        with session_scope() as session:
            row = tenants.find_tenant(session, tenant)
            tenants.revoke_api_key(session, row.id, api_key_id)
    except DomainError as exc:
        raise _fail(exc.message) from exc
    typer.echo(f"revoked {api_key_id}")


_QUOTA_HELP = "A number, or 'default' for the service default (settings quota_*). Unchanged if not given."


def _quota_value(option: str, value: str | None, current: int | None) -> int | None:
    if value is None:
        return current
    if value == "default":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise typer.BadParameter(f"{value!r} is neither a number nor 'default'", param_hint=option) from exc


@app.command("quotas")
def quotas_command(
    tenant: str = typer.Argument(..., help="Tenant name or id."),
    max_running_jobs: str | None = typer.Option(None, help=f"Jobs running at once. {_QUOTA_HELP}"),
    max_queued_jobs: str | None = typer.Option(None, help=f"Jobs waiting, queued or paused. {_QUOTA_HELP}"),
    max_devices: str | None = typer.Option(None, help=f"Devices of the running jobs together. {_QUOTA_HELP}"),
    max_dataset_storage_bytes: str | None = typer.Option(None, help=f"Total dataset bytes. {_QUOTA_HELP}"),
) -> None:
    """Show a tenant's quotas (limits, overrides, use); with options, change its overrides first."""
    # Operator commands import the service only when run: the client install has none of it (import-linter).
    from service.admin import quotas as quota_admin
    from service.grpc.errors import from_validation_error
    from service.kit.db import session_scope
    from service.kit.errors import DomainError
    from service.kit.queue import get_job_queue
    from service.tenants import service as tenants

    changes = {
        "max_running_jobs": max_running_jobs,
        "max_queued_jobs": max_queued_jobs,
        "max_devices": max_devices,
        "max_dataset_storage_bytes": max_dataset_storage_bytes,
    }
    try:
        with session_scope() as session:
            row = tenants.find_tenant(session, tenant)
            result = quota_admin.quotas_of(session, row.id)
            if any(value is not None for value in changes.values()):
                current = result.overrides.model_dump()
                values = {
                    name: _quota_value(f"--{name.replace('_', '-')}", value, current[name])
                    for name, value in changes.items()
                }
                try:
                    overrides = QuotaLimits.model_validate(values)
                except ValidationError as exc:
                    raise from_validation_error(exc) from exc
                result = quota_admin.write_quotas(session, None, row.id, overrides, get_job_queue())
    except DomainError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"quotas of {row.name} ({row.id}):")
    usage = result.usage.model_dump()
    in_use = dict(zip(QUOTA_NAMES, usage.values(), strict=True))
    for name in QUOTA_NAMES:
        limit = getattr(result.limits, name)
        source = "override" if getattr(result.overrides, name) is not None else "default"
        shown = "no limit" if limit is None else str(limit)
        typer.echo(f"  {name:<27} {shown:>14} {'(' + source + ')':<10}  in use: {in_use[name]}")
