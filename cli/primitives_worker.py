"""`grpo primitives-worker`: the worker behind the primitive training API (the Tinker door, docs/tinker.md).

It keeps each base model of GRPO_PRIMITIVES_BASE_MODELS resident and runs every tenant's training and sampling
calls on it (worker/primitives_worker.py) until interrupted. Run one per GPU (CUDA_VISIBLE_DEVICES); a
worker that stops is noticed by the others, which take its clients over.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType

import typer


def primitives_worker(
    device: str | None = typer.Option(None, "--device", help="torch device (default: cuda if present, else cpu)."),
    loglevel: str = typer.Option("INFO", "--loglevel", "-l", help="Log level."),
) -> None:
    """Serve the primitive training API's calls on resident base models (GRPO_PRIMITIVES_BASE_MODELS)."""
    # Operator commands import the service and the worker only when run: the client install has neither.
    from service.execution.runtime import get_settings, get_storage, prepare_worker_process
    from worker.primitives_worker import PrimitivesWorker, prepare_process

    logging.basicConfig(level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prepare_worker_process()
    prepare_process()
    settings = get_settings()
    stop = threading.Event()

    def _stop(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    worker = PrimitivesWorker(settings, get_storage(), cache_dir=Path(settings.data_dir) / "models", device=device)
    try:
        worker.run(stop)
    finally:
        worker.close()
