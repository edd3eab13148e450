"""Engine test fixtures: one tiny model per session, and few threads (the CI machine has 2 cores)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from worker.grpo.tiny import build_tiny_model

# One thread by default: on the shared 2-core machine, 2 OpenMP threads competing with other
# processes made a 16 x 40-token rollout 12x slower (1.3 s vs 15-20 s). GRPO_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("GRPO_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset saved once per session; load it with from_pretrained(path)."""
    return build_tiny_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)
