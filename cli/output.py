"""Rendering for the CLI: rich tables for people, `--json` for scripts; API errors as one clear line."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from client.sdk import APIError, GRPOClient

console = Console()
err_console = Console(stderr=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
F = TypeVar("F", bound=Callable[..., Any])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, BaseModel):
        return json.dumps(value.model_dump(mode="json"))
    return str(value)


def emit(obj: BaseModel | Sequence[BaseModel], columns: Sequence[str], *, as_json: bool) -> None:
    """Print one object (key/value table) or a list (one row each), or their JSON."""
    if as_json:
        data: Any = [o.model_dump(mode="json") for o in obj] if isinstance(obj, Sequence) else obj.model_dump(
            mode="json"
        )
        typer.echo(json.dumps(data, indent=2))
        return
    if isinstance(obj, Sequence):
        table = Table(*columns)
        for item in obj:
            table.add_row(*(_cell(getattr(item, c, None)) for c in columns))
    else:
        table = Table("field", "value", show_header=False)
        for column in columns:
            table.add_row(column, _cell(getattr(obj, column, None)))
    console.print(table)


@contextmanager
def api_client() -> Iterator[GRPOClient]:
    """A client from $GRPO_API_URL / $GRPO_API_KEY; API errors exit 1 with the error's code and message."""
    try:
        with GRPOClient() as client:
            yield client
    except APIError as exc:
        err_console.print(f"[red]error[/red] {exc.status} {exc.code}: {exc.message}")
        if exc.details:
            err_console.print_json(data=exc.details)
        raise typer.Exit(1) from None
