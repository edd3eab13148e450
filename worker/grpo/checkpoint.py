"""Checkpoints: atomic, self-verifying directories a run can resume from exactly.

Layout of ``<output_dir>/checkpoint-<step>/``:
- model weights via ``save_pretrained`` as safetensors (only the adapter with LoRA: it loads with
  ``PeftModel.from_pretrained``);
- the tokenizer files;
- with LoRA, ``merged/``: the base model with the adapters added to its weights (W + s * B @ A) and
  the tokenizer, a plain model for ``AutoModelForCausalLM.from_pretrained``;
- ``grpo_config.json``: the run's GRPOConfig (plus any extra metadata the caller passes);
- ``trainer_state.pt``: step, optimiser, scheduler, Python/NumPy/torch RNG states, data cursor, metrics history;
- from a sharded (FSDP) run, ``distributed/``: model and optimiser shards (torch.distributed.checkpoint), read
  back by any number of ranks; the optimiser is then not in ``trainer_state.pt`` (worker.grpo.distributed);
- ``manifest.json``: every other file with its size and sha256.

The directory is written under a temporary hidden name next to its final place and renamed
when complete, so a reader never sees a partial checkpoint. `load_checkpoint` checks the
manifest first and refuses a checkpoint whose files were altered, truncated or added.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from contract.config import GRPOConfig

MANIFEST_NAME = "manifest.json"
STATE_NAME = "trainer_state.pt"
CONFIG_NAME = "grpo_config.json"
MERGED_DIR = "merged"
MANIFEST_FORMAT = 1
_DIR_PATTERN = re.compile(r"^checkpoint-(\d+)$")
_HASH_CHUNK = 1 << 20


class CheckpointCorrupt(Exception):
    """A checkpoint does not match its manifest (or has none). Names the offending file."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"checkpoint {path} is corrupt: {problem}")
        self.path = path
        self.problem = problem


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint: where it is, what it contains and the trainer state to restore."""

    path: Path
    step: int
    config: dict[str, Any]
    trainer_state: dict[str, Any]
    manifest: dict[str, Any]


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoint directories under ``output_dir``, oldest step first."""
    if not output_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in output_dir.iterdir() if (m := _DIR_PATTERN.match(p.name)) and p.is_dir()
    ]
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


# --- RNG state -------------------------------------------------------------------------------
# Stored with plain types and tensors only, so trainer_state.pt loads with torch.load(weights_only=True).


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) generator states."""
    version, mt_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- manifest --------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _payload_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def build_manifest(directory: Path, step: int) -> dict[str, Any]:
    """Describe every file of ``directory`` (except the manifest itself) by size and sha256."""
    files = {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in _payload_files(directory)
    }
    return {"format": MANIFEST_FORMAT, "step": step, "files": files}


def verify_manifest(directory: Path) -> dict[str, Any]:
    """Check every file against ``manifest.json``; returns the manifest or raises CheckpointCorrupt."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files: dict[str, dict[str, Any]] = manifest["files"]
    except FileNotFoundError as exc:
        raise CheckpointCorrupt(directory, f"{MANIFEST_NAME} is missing") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorrupt(directory, f"{MANIFEST_NAME} is unreadable ({exc})") from exc
    for name, expected in files.items():
        _verify_file(directory, name, expected)
    present = {p.relative_to(directory).as_posix() for p in _payload_files(directory)}
    unexpected = sorted(present - set(files))
    if unexpected:
        raise CheckpointCorrupt(directory, f"file {unexpected[0]} is not listed in {MANIFEST_NAME}")
    return dict(manifest)


def _verify_file(directory: Path, name: str, expected: dict[str, Any]) -> None:
    path = directory / name
    if not path.is_file():
        raise CheckpointCorrupt(directory, f"file {name} is missing")
    size = path.stat().st_size
    if size != expected["size"]:
        raise CheckpointCorrupt(
            directory, f"file {name} has {size} bytes, the manifest says {expected['size']}"
        )
    if _sha256(path) != expected["sha256"]:
        raise CheckpointCorrupt(directory, f"file {name} does not match its sha256 in {MANIFEST_NAME}")


# --- save / load -----------------------------------------------------------------------------


def save_checkpoint(
    output_dir: Path,
    *,
    step: int,
    model: Any,
    tokenizer: Any,
    config: GRPOConfig,
    trainer_state: dict[str, Any],
    save_total_limit: int | None = None,
    metadata: dict[str, Any] | None = None,
    extra_dirs: dict[str, Path] | None = None,
    model_files: Path | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Write ``checkpoint-<step>`` atomically and prune old ones; returns (path, manifest).

    ``extra_dirs`` (name -> a directory written beforehand, e.g. sharded state) are moved in under their
    names and listed in the manifest like every other file.

    ``model`` is a transformers model or a peft model (then the adapter is saved, and the merged model).
    Or, with ``model`` None, ``model_files``: a directory holding the model's files already (a sharded
    job's consolidated model, worker.grpo.consolidated), whose entries are moved in at the top.
    ``trainer_state`` must hold plain types and tensors (it is loaded with weights_only=True).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / checkpoint_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=output_dir))
    try:
        if model is not None:
            model.save_pretrained(tmp, safe_serialization=True)
            if _is_peft(model):
                save_merged(model, tmp / MERGED_DIR)
        elif model_files is not None:
            for entry in model_files.iterdir():
                os.rename(entry, tmp / entry.name)
            model_files.rmdir()
        tokenizer.save_pretrained(tmp)
        if (tmp / MERGED_DIR).is_dir():
            tokenizer.save_pretrained(tmp / MERGED_DIR)
        config_doc = {"step": step, "config": config.model_dump(mode="json"), "metadata": metadata or {}}
        (tmp / CONFIG_NAME).write_text(json.dumps(config_doc, indent=2, sort_keys=True), encoding="utf-8")
        torch.save({**trainer_state, "step": step}, tmp / STATE_NAME)
        for name, directory in (extra_dirs or {}).items():
            os.rename(directory, tmp / name)
        manifest = build_manifest(tmp, step)
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")
        _fsync_tree(tmp)
        _move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_checkpoints(output_dir, save_total_limit, keep=final)
    return final, manifest


def _is_peft(model: Any) -> bool:
    # peft imports transformers (seconds): grpo train and the worker import this module for its file helpers
    # (latest_checkpoint, verify_manifest, CheckpointCorrupt) before any model, so only a save pays for it.
    from peft import PeftModel

    return isinstance(model, PeftModel)


@torch.no_grad()
def save_merged(model: Any, directory: Path) -> None:
    """Save a peft LoRA model as the plain transformers model it computes (W + its adapter's delta for each
    adapted weight). `model` itself is left untouched (merging in place and back would round the base weights)."""
    # peft (through full_weights) imports transformers: only a LoRA save pays for it (see _is_peft).
    from worker.grpo.full_weights import merged_weights

    model.get_base_model().save_pretrained(directory, state_dict=merged_weights(model), safe_serialization=True)


def _fsync_tree(directory: Path) -> None:
    """Flush file contents before the rename makes the checkpoint visible."""
    for path in [*directory.rglob("*"), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (same step saved again) is replaced."""
    if final.exists():
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
        os.rename(final, stale)
        os.rename(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def prune_checkpoints(
    output_dir: Path, save_total_limit: int | None, *, keep: Path | None = None
) -> list[Path]:
    """Delete the oldest checkpoints beyond ``save_total_limit`` (never ``keep``); returns the deleted."""
    if save_total_limit is None:
        return []
    checkpoints = [p for p in list_checkpoints(output_dir) if p != keep]
    excess = len(checkpoints) + (1 if keep is not None else 0) - save_total_limit
    doomed = checkpoints[: max(0, excess)]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def load_checkpoint(directory: Path) -> LoadedCheckpoint:
    """Verify the manifest, then read the config and trainer state (weights are loaded by the trainer)."""
    directory = Path(directory)
    manifest = verify_manifest(directory)
    config_doc = json.loads((directory / CONFIG_NAME).read_text(encoding="utf-8"))
    state = torch.load(directory / STATE_NAME, map_location="cpu", weights_only=True)
    return LoadedCheckpoint(
        path=directory, step=int(state["step"]), config=config_doc, trainer_state=state, manifest=manifest
    )
