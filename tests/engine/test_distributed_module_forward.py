"""A model only the hf backend serves (a tiny Phi-3), on 1 or 2 ranks through the library wrappers,
DistributedDataParallel and per-layer FSDP2: the same weights and metrics.

Apart from tests/engine/test_distributed.py (whose helpers it uses) so that pytest-xdist hands the two files
to different workers: each launches ranks for minutes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.preloaded import Preloaded
from tests.engine.test_distributed import (
    Runs,
    _spec,
    assert_same_metrics,
    grpo_train,
    history,
    max_abs_diff,
    run_env,
    weights,
)
from tests.engine.test_hf_architectures import build
from worker.grpo.local import RANK_MODULE

pytestmark = pytest.mark.slow  # each test launches ranks in child processes


class ModuleForwardRuns(Runs):
    """Runs of the Phi-3 model (hf backend): "single-full", "ddp-lora", ..."""

    def __init__(self, root: Path, model: Path, python: Preloaded) -> None:
        super().__init__(root, python=python)
        self.model = model

    def __missing__(self, name: str) -> Path:
        scheme, kind = name.split("-")
        devices, parallelism = (1, "auto") if scheme == "single" else (2, scheme)
        spec = _spec(devices, parallelism, kind == "lora")
        spec["base_model"] = str(self.model)
        self[name] = grpo_train(self.root, name, spec, python=self.python)
        return self[name]


@pytest.fixture(scope="module")
def module_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleForwardRuns]:
    root = tmp_path_factory.mktemp("dist-hf")
    # The `grpo train` children are forked from a process that imported the engine once (grpo_train).
    with Preloaded([RANK_MODULE], run_env()) as python:
        # A tiny Phi-3: the fused backend does not cover it, so its jobs train through the module forward (the
        # hf backend) and the library wrappers, DistributedDataParallel and per-layer FSDP2.
        yield ModuleForwardRuns(root, build("phi3", root / "phi3", layers=4), python)


@pytest.mark.parametrize(
    ("parallelism", "kind"), [("ddp", "full"), ("ddp", "lora"), ("fsdp", "full"), ("fsdp", "lora")]
)
def test_the_library_wrappers_over_the_module_forward_give_the_same_weights_and_metrics(
    module_runs: ModuleForwardRuns, parallelism: str, kind: str
) -> None:
    """A model only the hf backend serves, on 2 ranks through DistributedDataParallel or FSDP2 with a unit per
    decoder layer: after one step and after three, the weights and metrics of one process."""
    lora = kind == "lora"
    for step, tolerance in ((1, 1e-5), (3, 1e-4)):
        one = module_runs[f"single-{kind}"] / f"checkpoint-{step}"
        two = module_runs[f"{parallelism}-{kind}"] / f"checkpoint-{step}"
        diff = max_abs_diff(weights(one, lora), weights(two, lora))
        print(f"phi3 {parallelism} {kind}, step {step}: max abs difference {diff:.3g}")
        assert diff <= tolerance, step
        assert_same_metrics(history(one), history(two))
    assert history(module_runs[f"single-{kind}"] / "checkpoint-1")[0]["grad_norm"] > 0.1  # a step with a gradient
    # The wrappers that ran (as built): DDP's own, or a unit per decoder layer (4) and the root.
    expected = "DistributedDataParallel over the module forward" if parallelism == "ddp" else "5 FSDP units"
    assert expected in (module_runs[f"{parallelism}-{kind}"] / "grpo-train.log").read_text()
