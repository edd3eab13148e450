"""worker.scratch: a killed worker's scratch folder goes when the next worker claims one; a live one's stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from worker.scratch import LOCK_FILE, claim_scratch, release_scratch, sweep_dead

REPO_ROOT = Path(__file__).resolve().parents[2]
CLAIM_AND_WAIT = (
    "import sys, time; from pathlib import Path; from worker.scratch import claim_scratch; "
    "folder = claim_scratch(Path(sys.argv[1]), sys.argv[2]); (folder / 'state.bin').write_bytes(b'x'); "
    "print('ready', flush=True); time.sleep(600)"
)


def _claimer(root: Path, name: str) -> subprocess.Popen[str]:
    """A process that claims `root/name`, writes a file there and waits (as a worker serving)."""
    process = subprocess.Popen([sys.executable, "-c", CLAIM_AND_WAIT, str(root), name], stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


def test_a_killed_workers_folder_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    killed, alive = _claimer(tmp_path, "wrk_killed"), _claimer(tmp_path, "wrk_alive")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        mine = claim_scratch(tmp_path, "wrk_mine")
        assert not (tmp_path / "wrk_killed").exists()
        assert (tmp_path / "wrk_alive" / "state.bin").is_file()
        assert mine.is_dir() and (mine / LOCK_FILE).is_file()
        assert sweep_dead(tmp_path) == []  # its own folder is not swept either
        release_scratch(mine)
        assert not mine.exists()
    finally:
        alive.kill()
        alive.wait(timeout=30)
    assert sweep_dead(tmp_path) == [tmp_path / "wrk_alive"]


def test_folders_without_an_owner_lock_are_left_alone_and_a_stale_claim_is_removed(tmp_path: Path) -> None:
    (tmp_path / "someone-elses").mkdir()
    fresh, stale = tmp_path / ".claiming-wrk_a", tmp_path / ".claiming-wrk_b"
    for folder in (fresh, stale):
        folder.mkdir()
        (folder / LOCK_FILE).touch()
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    assert sweep_dead(tmp_path) == [stale]  # a fresh claim may be between its mkdir and its lock
    assert (tmp_path / "someone-elses").is_dir() and fresh.is_dir()
