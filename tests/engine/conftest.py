"""Engine test fixtures: one tiny model per session, and few threads (the CI machine has 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.grpo.tiny import build_tiny_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset saved once per session; load it with from_pretrained(path)."""
    return build_tiny_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)
