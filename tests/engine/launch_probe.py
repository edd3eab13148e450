"""A rank for tests/engine/test_launch.py: `python -m tests.engine.launch_probe OUT_DIR CODES`.

It writes what it sees to OUT_DIR/rank-N.json and, at exit, OUT_DIR/atexit-N; then, once every rank has written its
file, it exits with the N-th of the comma-separated CODES, where "sleep" means: wait until stopped."""

from __future__ import annotations

import sys

PRELOADED = "torch" in sys.modules  # before this module's own imports: imported by the launcher it was forked from

import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402


def main(out_dir: Path, codes: list[str]) -> int:
    rank = int(os.environ["RANK"])
    seen = {
        "name": __name__,
        "argv": sys.argv[1:],
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "process_name": psutil.Process().name(),
        "launcher_name": psutil.Process(os.getppid()).name(),
        "preloaded": PRELOADED,
        "threads": torch.get_num_threads(),
        "listening": [c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN],
        "env": {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GRPO_RUN_ID")},
    }
    written = out_dir / f"rank-{rank}.json.tmp"
    written.write_text(json.dumps(seen))
    written.rename(out_dir / f"rank-{rank}.json")  # whole or absent: a rank may be stopped at any moment
    atexit.register(lambda: (out_dir / f"atexit-{rank}").touch())
    if codes[rank] == "sleep":
        time.sleep(120)
        return 0
    # No rank exits before every rank has written what it sees: the first to fail stops the others, and the tests
    # read what each saw (its pid among it), however slowly a busy machine starts them.
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + 60
    while not all((out_dir / f"rank-{r}.json").exists() for r in range(world)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(codes[rank])


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2].split(",")))
