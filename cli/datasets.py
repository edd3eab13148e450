"""`grpo datasets upload|list|get|delete`."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.output import JsonOpt, api_client, emit

app = typer.Typer(help="Prompt datasets (JSONL).", no_args_is_help=True)
COLUMNS = ["id", "name", "num_rows", "bytes", "sha256", "columns", "created_at"]
LIST_COLUMNS = ["id", "name", "num_rows", "bytes", "created_at"]


@app.command()
def upload(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="JSONL file: one {\"prompt\": ...} per line."),
    name: str | None = typer.Option(None, help="Dataset name (default: the file name)."),
    as_json: JsonOpt = False,
) -> None:
    """Upload and validate a dataset."""
    with api_client() as client:
        emit(client.upload_dataset(file, name), COLUMNS, as_json=as_json)


@app.command("list")
def list_(limit: int = 20, after: str | None = None, as_json: JsonOpt = False) -> None:
    """List your datasets, newest first."""
    with api_client() as client:
        emit(client.list_datasets(limit, after).data, LIST_COLUMNS, as_json=as_json)


@app.command()
def get(dataset_id: str, as_json: JsonOpt = False) -> None:
    """Show one dataset."""
    with api_client() as client:
        emit(client.get_dataset(dataset_id), COLUMNS, as_json=as_json)


@app.command()
def delete(dataset_id: str) -> None:
    """Delete a dataset (refused while an unfinished job uses it)."""
    with api_client() as client:
        client.delete_dataset(dataset_id)
    typer.echo(f"deleted {dataset_id}")
