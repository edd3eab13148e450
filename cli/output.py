"""Rendering for the CLI: rich tables for people, `--json` for scripts; API errors as one clear line."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from client.sdk import APIError, GRPOClient
from contract.api.jobs import Progress

console = Console()
err_console = Console(stderr=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
F = TypeVar("F", bound=Callable[..., Any])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Progress):
        return f"{value.step}/{'?' if value.total_steps is None else value.total_steps}"
    if isinstance(value, BaseModel):
        return json.dumps(value.model_dump(mode="json"))
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    if isinstance(value, dict):  # e.g. a sample's reward per source: one `name=value` line each
        return "\n".join(f"{key}={_cell(item)}" for key, item in value.items()) or "-"
    return str(value)


SHORT = 8  # values up to this wide are not wrapped while there is room for them


def _is_id(column: str) -> bool:
    return column == "id" or column.endswith("_id")


def _table(columns: Sequence[str], rows: list[list[str]], width: int) -> Table:
    """Ids are never cut (users copy them): their columns keep their full width, on one line. The other
    columns share what is left of the terminal's `width`, wrapping and folding long words, each at least
    as wide as its header where the headers fit."""
    natural = [
        max(len(line) for text in (column, *(row[index] for row in rows)) for line in text.splitlines() or [""])
        for index, column in enumerate(columns)
    ]
    ids = [index for index, column in enumerate(columns) if _is_id(column)]
    others = [index for index in range(len(columns)) if index not in ids]
    room = width - sum(natural[index] for index in ids) - (3 * len(columns) + 1)  # padding 1 + 1, borders
    widths: dict[int, int] = {}
    if sum(natural[index] for index in others) > room:
        # Short values (a status, a count) stay whole; then whole headers; then anything that fits.
        for floor in (
            {index: max(len(columns[index]), min(natural[index], SHORT)) for index in others},
            {index: len(columns[index]) for index in others},
            dict.fromkeys(others, 1),
        ):
            if sum(floor.values()) <= room:
                break
        spare = max(room - sum(floor.values()), 0)
        wants = {index: natural[index] - floor[index] for index in others}
        total = sum(wants.values()) or 1
        widths = {index: floor[index] + spare * wants[index] // total for index in others}
    table = Table()
    for index, column in enumerate(columns):
        if index in ids:
            table.add_column(column, no_wrap=True, min_width=natural[index])
        else:
            table.add_column(column, overflow="fold", width=widths.get(index))
    for row in rows:
        table.add_row(*row)
    return table


def emit(obj: BaseModel | Sequence[BaseModel], columns: Sequence[str], *, as_json: bool) -> None:
    """Print one object (key/value table) or a list (one row each), or their JSON."""
    if as_json:
        data: Any = [o.model_dump(mode="json") for o in obj] if isinstance(obj, Sequence) else obj.model_dump(
            mode="json"
        )
        typer.echo(json.dumps(data, indent=2))
        return
    if isinstance(obj, Sequence):
        rows = [[_cell(getattr(item, c, None)) for c in columns] for item in obj]
        table = _table(columns, rows, console.width)
    else:
        table = Table("field", "value", show_header=False)
        table.columns[1].overflow = "fold"
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
