"""The checkpoints API's responses (shapes in contract.api.checkpoints) built from rows."""

from __future__ import annotations

from contract.api.checkpoints import CheckpointFile, CheckpointOut
from service.checkpoints.models import Checkpoint


def checkpoint_out(checkpoint: Checkpoint) -> CheckpointOut:
    return CheckpointOut(
        id=checkpoint.id,
        job_id=checkpoint.job_id,
        tinker_path=checkpoint.tinker_path,
        step=checkpoint.step,
        files=[CheckpointFile.model_validate(entry) for entry in checkpoint.downloadable],
        total_bytes=checkpoint.total_bytes,
        metrics=checkpoint.metrics,
        created_at=checkpoint.created_at,
    )
