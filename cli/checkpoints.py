"""`grpo checkpoints list|get|download`."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.output import JsonOpt, api_client, emit, err_console
from client.sdk import UnsafeCheckpointPath

app = typer.Typer(help="Checkpoints of jobs.", no_args_is_help=True)
COLUMNS = ["id", "job_id", "step", "total_bytes", "metrics", "created_at"]


@app.command("list")
def list_(job_id: str, as_json: JsonOpt = False) -> None:
    """List a job's checkpoints (oldest first)."""
    with api_client() as client:
        emit(client.list_checkpoints(job_id).data, ["id", "step", "total_bytes", "created_at"], as_json=as_json)


@app.command()
def get(checkpoint_id: str, as_json: JsonOpt = False) -> None:
    """Show a checkpoint with its files and metrics."""
    with api_client() as client:
        emit(client.get_checkpoint(checkpoint_id), [*COLUMNS, "files"], as_json=as_json)


@app.command()
def download(
    checkpoint_id: str,
    out: Path = typer.Option(..., "--out", "-o", help="Directory (files) or .tar path (--archive)."),
    archive: bool = typer.Option(False, "--archive", help="Download one streamed tar instead of the files."),
) -> None:
    """Download a checkpoint; the directory loads with from_pretrained."""
    with api_client() as client:
        try:
            path = client.download_checkpoint_archive(checkpoint_id, out) if archive else client.download_checkpoint(checkpoint_id, out)
        except UnsafeCheckpointPath as exc:
            err_console.print(f"[red]error[/red] {exc}")
            raise typer.Exit(1) from None
    typer.echo(str(path))
