"""A worker process's own scratch folder, which outlives no process.

A primitives worker keeps files under its data directory for as long as it serves: idle clients' offloaded
states, the adapters its vLLM engine reads lazily. A worker that exits cleanly removes them; one that is killed
(SIGKILL, OOM, a lost machine) cannot. So each folder holds an exclusive `flock` on a lock file inside it for the
life of its process: the kernel drops that lock when the process dies, however it dies, and the next worker to
claim a folder under the same root removes every folder whose lock it can take.

The lock is taken before the folder gets its final name (it is created as `.claiming-<name>` and renamed), so a
sweep never sees a live worker's folder unlocked; a `.claiming-` folder is swept only once it is a minute old.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import time
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

LOCK_FILE = ".owner.lock"
_CLAIMING = ".claiming-"
_CLAIMING_GRACE_S = 60.0  # a `.claiming-` folder younger than this may be between its mkdir and its flock
# The open lock files of this process's folders: closing one (or the process exiting) releases its folder.
_held: dict[Path, IO[str]] = {}


def claim_scratch(root: Path, name: str) -> Path:
    """`root/name`, empty and locked by this process until it exits, after removing the folders under `root`
    that dead processes left."""
    root.mkdir(parents=True, exist_ok=True)
    sweep_dead(root)
    folder = root / name
    claiming = root / f"{_CLAIMING}{name}"
    shutil.rmtree(claiming, ignore_errors=True)
    claiming.mkdir()
    lock = (claiming / LOCK_FILE).open("w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else holds it
    shutil.rmtree(folder, ignore_errors=True)
    claiming.rename(folder)
    _held[folder] = lock
    return folder


def release_scratch(folder: Path) -> None:
    """Remove a folder this process claimed (its clean exit)."""
    shutil.rmtree(folder, ignore_errors=True)
    lock = _held.pop(folder, None)
    if lock is not None:
        lock.close()


def sweep_dead(root: Path) -> list[Path]:
    """Remove the folders under `root` whose owner is gone (their lock is free); the ones removed."""
    removed: list[Path] = []
    for folder in sorted(root.iterdir()):
        if not folder.is_dir() or folder in _held:
            continue
        if folder.name.startswith(_CLAIMING) and time.time() - folder.stat().st_mtime < _CLAIMING_GRACE_S:
            continue
        lock_path = folder / LOCK_FILE
        if not lock_path.is_file():
            continue  # not a claimed folder: left alone
        with lock_path.open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its process is alive
            shutil.rmtree(folder, ignore_errors=True)
        log.info("removed %s, left by a worker process that is gone", folder)
        removed.append(folder)
    return removed
