"""Optional TensorBoard event files for a job (setting GRPO_TENSORBOARD): one scalar per metric per step.

Written locally by the job's process and uploaded to storage next to the checkpoints each time one is saved,
so `tensorboard --logdir` over a downloaded copy (or an s3:// prefix) shows the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tensorboardX import SummaryWriter


class TensorBoardLog:
    """Scalars for every finite metric; `files()` lists the event files to upload (relative to `root`)."""

    def __init__(self, root: Path, run_name: str) -> None:
        self.root = root
        self._writer = SummaryWriter(logdir=str(root / run_name))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            if isinstance(value, int | float) and value == value and abs(value) != float("inf"):
                self._writer.add_scalar(name, float(value), step)
        self._writer.flush()

    def files(self) -> list[Path]:
        return sorted(p.relative_to(self.root) for p in self.root.rglob("events.out.tfevents.*"))

    def close(self) -> None:
        self._writer.close()
