"""`grpo admin ...`: tenants, API keys and quotas (on an already migrated database: run `grpo migrate` first)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Administration: tenants, API keys and quotas.", no_args_is_help=True)


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
    max_queued_jobs: str | None = typer.Option(None, help=f"Jobs waiting queued. {_QUOTA_HELP}"),
    max_devices: str | None = typer.Option(None, help=f"Devices of the running jobs together. {_QUOTA_HELP}"),
    max_dataset_storage_bytes: str | None = typer.Option(None, help=f"Total dataset bytes. {_QUOTA_HELP}"),
) -> None:
    """Show a tenant's quotas (limits, overrides, use); with options, change its overrides first."""
    from pydantic import ValidationError

    from service.grpc.errors import from_validation_error
    from service.kit.db import session_scope
    from service.kit.errors import DomainError
    from service.kit.queue import get_job_queue
    from service.quotas import admin as quota_admin
    from service.quotas import service as quota_service
    from service.quotas.schemas import QUOTA_NAMES, QuotaLimits
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
            result = quota_service.get_quotas(session, row.id)
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
