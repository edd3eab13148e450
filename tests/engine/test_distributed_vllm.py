"""vLLM rollouts on 1 or 2 ranks (the vLLM CPU build, gloo, 2 ranks x 1 thread): one engine per rank, fed the
policy after every step (under fsdp gathered from the shards one layer at a time), gives the weights and metrics
of one process.

How close: each group is one vLLM request with the seed of its global position, so a group samples the same
tokens on 1 or 2 ranks as long as its logits are the same; an engine serving half the batch runs its kernels
over other row counts, which moves logits by float rounding. Over these runs the sampled tokens were identical,
so the weights agree as closely as the native rollout's (1e-4 after three steps). Should rounding ever flip a
sampled token, the runs would diverge from that step on: the test then reports which step's rewards differ.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engine.preloaded import Preloaded
from tests.engine.test_distributed import (
    TIMING,
    Runs,
    assert_same_metrics,
    history,
    max_abs_diff,
    run_env,
    weights,
)
from tests.engine.trainer_helpers import skip_module_without_vllm
from worker.grpo.local import RANK_MODULE

pytestmark = pytest.mark.slow  # each test launches ranks in child processes, each with a vLLM engine
skip_module_without_vllm()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """"single-full", "ddp-full", "hf-lora", "fsdp-lora": `grpo train` with use_vllm, made when first asked for,
    each forked from one process that imported the engine once (vLLM itself is imported by each run)."""
    # The last checkpoint is written after the loop, once the engines are closed (a collective under fsdp).
    with Preloaded([RANK_MODULE], run_env()) as python:
        yield Runs(tmp_path_factory.mktemp("dist-vllm"), python=python, use_vllm=True, checkpoint_every=2)


@pytest.mark.parametrize(("one", "two"), [("single-full", "ddp-full"), ("hf-lora", "fsdp-lora")])
def test_two_ranks_with_vllm_give_the_weights_and_metrics_of_one_process(runs: Runs, one: str, two: str) -> None:
    lora = one.endswith("lora")
    a, b = runs[one] / "checkpoint-3", runs[two] / "checkpoint-3"
    rewards = [(x["reward/mean"], y["reward/mean"]) for x, y in zip(history(a), history(b), strict=True)]
    diff = max_abs_diff(weights(a, lora), weights(b, lora))
    print(f"{two} with vLLM, three steps: max abs difference {diff:.3g}, mean reward per step {rewards}")
    assert diff <= 1e-4, rewards
    assert_same_metrics(history(a), history(b))
    # Steps with a gradient, so equal weights are not a vacuous match.
    assert max(step["grad_norm"] for step in history(a)) > 0.1


def test_two_ranks_report_the_sampling_correction_under_the_names_of_one_process(runs: Runs) -> None:
    """The importance-sampling correction between vLLM's sampler and the trainer runs on every rank and is
    reported for the global batch, under the same metric names as on one device."""
    one, two = history(runs["hf-lora"] / "checkpoint-3"), history(runs["fsdp-lora"] / "checkpoint-3")
    names = {key for key in one[-1] if not key.startswith(TIMING)}
    assert names == {key for key in two[-1] if not key.startswith(TIMING)}
    correction = {key for key in names if key.startswith("sampling/")}
    assert correction, sorted(names)
    assert "time/weight_sync_s" in two[-1]
    log = (runs["fsdp-lora"] / "grpo-train.log").read_text()
    assert "fsdp over 2 ranks" in log
