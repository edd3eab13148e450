"""`grpo train --config job.yaml`: run the engine locally (imports torch lazily: the service never does)."""

from __future__ import annotations

from pathlib import Path

import typer


def train(
    config: Path = typer.Option(..., "--config", "-c", exists=True, dir_okay=False, help="Job spec YAML."),
    output_dir: Path | None = typer.Option(None, "--output-dir", "-o", help="Where checkpoints go."),
) -> None:
    """Train locally on a JSONL dataset with built-in rewards, showing reward/KL per step."""
    from worker.grpo.local import run_local  # torch is imported here, never at service import time

    raise typer.Exit(run_local(config, output_dir))
