"""One rank of a multi-device `grpo train` (worker.grpo.local launches `devices` of them).

The engine is imported here, at the top, on purpose: on machines without CUDA the launcher (the `grpo train`
command itself, worker.grpo.launch.run_ranks) imports this module and forks the ranks from itself
(worker.grpo.rank_fork), so torch, transformers and the trainer load once per run instead of once per rank.
worker.grpo.local keeps them out of its own import, so that bad input, which fails before any training, pays
nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import worker.grpo.distributed  # noqa: F401  (preloaded for the forked ranks, as the docstring says)
import worker.grpo.trainer  # noqa: F401
from worker.grpo.local import run_local

if __name__ == "__main__":
    sys.exit(run_local(Path(sys.argv[1]), Path(sys.argv[2])))
