"""How an attempt's failures read to the tenant: a stable code and a message that names no worker path."""

from __future__ import annotations


class JobFailure(Exception):
    """A failure with a stable error code for the job row."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def training_error_message(exc: Exception) -> str:
    """The tenant's view of an unexpected failure: type and message, except for filesystem errors, whose
    text names the worker's paths (the log has it)."""
    if isinstance(exc, OSError):
        return f"{type(exc).__name__} (details in the worker's log)"
    return f"{type(exc).__name__}: {exc}"


def checkpoint_problem(exc: Exception) -> str:
    """What a tenant may read about a checkpoint that failed to download or verify: the manifest's finding
    (file names relative to the checkpoint), never an exception text naming the worker's or storage's paths."""
    # worker.grpo.checkpoint imports torch: only the job's process may (the Celery parent forks children).
    from worker.grpo.checkpoint import CheckpointCorrupt

    if isinstance(exc, CheckpointCorrupt):
        return f"corrupt: {exc.problem}"
    return "could not be downloaded"
