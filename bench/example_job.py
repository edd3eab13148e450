"""A user's run of an example under examples/: its data written fresh and its job.yaml with overrides, in a work
folder, for `grpo train` (bench/learning_smollm2.py, bench/multi_turn.py)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

GRPO = Path(sys.executable).parent / "grpo"  # the console script of this virtualenv


def prepare_job(example: Path, work: Path, overrides: dict[str, Any], write_data: Callable[[Path], None]) -> Path:
    """`example`'s job.yaml in `work` with hyperparameter overrides, and its data written by `write_data` into
    `work/data` (where job.yaml names it); the example's output_dir is dropped (the caller names one)."""
    write_data(work / "data")
    spec = yaml.safe_load((example / "job.yaml").read_text(encoding="utf-8"))
    spec.pop("output_dir", None)
    spec["hyperparameters"].update(overrides)
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


def load_make_data(example: Path) -> ModuleType:
    """`example`'s make_data.py as a module of its own name: every example has a `make_data.py`, so a plain
    `import make_data` would return whichever example's was imported first in the process."""
    name = f"{example.name}_make_data"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, example / "make_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_folder(workdir: Path | None, prefix: str) -> Path:
    """`workdir` emptied (or a new temporary folder): where the data, checkpoints and log go."""
    work = workdir or Path(tempfile.mkdtemp(prefix=prefix))
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def run_overrides(seed: int | None, max_steps: int | None) -> dict[str, Any]:
    """The hyperparameters a benchmark's --seed and --max-steps change (a shorter run evaluates at its end)."""
    overrides: dict[str, Any] = {} if seed is None else {"seed": seed}
    if max_steps is not None:
        overrides |= {"max_steps": max_steps, "eval_every": max_steps}
    return overrides
