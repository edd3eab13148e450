"""A rank for tests/engine/test_launch.py: `python -m tests.engine.launch_probe OUT_DIR CODES`.

It writes what it sees to OUT_DIR/rank-N.json and, at exit, OUT_DIR/atexit-N; then it exits with the N-th of the
comma-separated CODES, where "sleep" means: wait until stopped."""

from __future__ import annotations

import sys

PRELOADED = "torch" in sys.modules  # before this module's own imports: imported by a fork server already

import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


def main(out_dir: Path, codes: list[str]) -> int:
    rank = int(os.environ["RANK"])
    seen = {
        "name": __name__,
        "argv": sys.argv[1:],
        "pid": os.getpid(),
        "preloaded": PRELOADED,
        "threads": torch.get_num_threads(),
        "env": {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GRPO_RUN_ID")},
    }
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(seen))
    atexit.register(lambda: (out_dir / f"atexit-{rank}").touch())
    if codes[rank] == "sleep":
        time.sleep(120)
    return int(codes[rank]) if codes[rank] != "sleep" else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2].split(",")))
