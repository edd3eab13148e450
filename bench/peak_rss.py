"""Run a module as `python -m MODULE ARGS...` would, then write this process's peak RSS (bench/distributed.py).

    python -m bench.peak_rss RESULT_DIR MODULE ARGS...

Writes RESULT_DIR/rank-<RANK>.json ({"peak_rss_mib": ...}; RANK from the launcher's environment, 0 without
one): the process's own high-water mark (getrusage), whatever the module does, exit included."""

from __future__ import annotations

import json
import os
import resource
import runpy
import sys
from pathlib import Path


def main() -> None:
    results, module, *args = sys.argv[1:]
    sys.argv = [module, *args]
    code: int | str | None = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        rank = os.environ.get("RANK", "0")
        (Path(results) / f"rank-{rank}.json").write_text(json.dumps({"peak_rss_mib": peak_kib / 1024}))
    sys.exit(code)


if __name__ == "__main__":
    main()
