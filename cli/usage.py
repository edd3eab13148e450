"""`grpo usage` (your usage by day or job) and `grpo admin set-budget` (a tenant's monthly caps)."""

from __future__ import annotations

from datetime import datetime

import typer

from cli.output import JsonOpt, api_client, console, emit
from contract.api.usage import TenantBudgetOut

TOTAL_COLUMNS = ["steps", "tokens_generated", "tokens_trained", "tokens", "reward_calls", "device_seconds"]


def usage(
    start: datetime | None = typer.Option(None, help="Inclusive start, ISO 8601 (default: this month's start, UTC)."),
    end: datetime | None = typer.Option(None, help="Exclusive end, ISO 8601 (default: now)."),
    group_by: str = typer.Option("day", "--group-by", help="day (UTC) or job."),
    as_json: JsonOpt = False,
) -> None:
    """Your usage: tokens generated and trained, reward calls and device-seconds, by day or by job."""
    with api_client() as client:
        report = client.get_usage(start, end, group_by)
    if as_json:
        emit(report, [], as_json=True)
        return
    console.print(f"{report.start.isoformat()} .. {report.end.isoformat()}")
    emit(report.data, ["key", *TOTAL_COLUMNS], as_json=False)
    emit(report.totals, TOTAL_COLUMNS, as_json=False)


def set_budget(
    tenant: str = typer.Argument(..., help="Tenant name or id."),
    monthly_max_tokens: int | None = typer.Option(None, min=1, help="Tokens (generated + trained) per UTC month."),
    monthly_max_device_seconds: float | None = typer.Option(None, min=0.001, help="Device-seconds per UTC month."),
) -> None:
    """Set a tenant's monthly caps (an option left out: the GRPO_MONTHLY_MAX_* default applies)."""
    # Operator commands import the service only when run: the client install has none of it (import-linter).
    from service.kit.db import session_scope
    from service.kit.errors import DomainError
    from service.tenants import service as tenants
    from service.usage import repository

    try:
        with session_scope() as session:
            row = tenants.find_tenant(session, tenant)
            budget = repository.set_tenant_budget(
                session, row.id, monthly_max_device_seconds=monthly_max_device_seconds,
                monthly_max_tokens=monthly_max_tokens,
            )
            out = TenantBudgetOut(tenant_id=row.id, monthly_max_device_seconds=budget.monthly_max_device_seconds,
                                  monthly_max_tokens=budget.monthly_max_tokens)
    except DomainError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(out.model_dump_json())
