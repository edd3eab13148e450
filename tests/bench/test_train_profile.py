"""bench/train_profile.py: the categories it puts operators in, and a short run of our trainer under it.

Nothing here checks a timing; the run checks that each category of the tiny preset's training phase is found.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import train_profile  # noqa: E402
from grpo_step import Case  # noqa: E402


@pytest.mark.parametrize(
    ("name", "ancestors", "expected"),
    [
        ("aten::mm", ["ProfilerStep", "_HeadLogprobs"], "LM head matmuls"),
        ("aten::addmm_", ["autograd::engine::evaluate_function: _HeadLogprobsBackward", "_HeadLogprobsBackward"], "LM head matmuls"),
        ("aten::exp_", ["_HeadLogprobs"], "LM head softmax"),
        ("aten::mm", ["autograd::engine::evaluate_function: MmBackward0", "MmBackward0"], "layer matmuls"),
        ("aten::addmm", [], "layer matmuls"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", [], "attention"),
        ("aten::empty_like", ["aten::_scaled_dot_product_flash_attention_for_cpu_backward"], "attention"),
        ("aten::_fused_adamw_", ["optimizer_update"], "optimiser"),
        ("aten::copy_", ["optimizer_update", "aten::_foreach_norm"], "optimiser"),
        ("aten::mm", ["reference_logps", "_HeadLogprobs"], "reference forward"),
        ("aten::mul", [], "other"),
    ],
)
def test_categories(name: str, ancestors: list[str], expected: str) -> None:
    assert train_profile.category(name, ancestors) == expected


@pytest.fixture
def keeps_thread_count() -> Iterator[None]:
    """profile_case sets the bench's thread count, as in its own process: tests after this one (the
    engine's resume test among them) must keep the suite's."""
    previous = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def test_profiles_the_tiny_presets_training_phase(tmp_path: Path, keeps_thread_count: None) -> None:
    result = train_profile.profile_case(Case("tiny"), 2, tmp_path)
    seconds = result["seconds"]
    for name in ("LM head matmuls", "LM head softmax", "layer matmuls", "attention", "optimiser", "other"):
        assert seconds[name] > 0, name
    assert result["flops"]["layer matmuls"] > result["flops"]["LM head matmuls"] > 0  # a 101-token head
    assert result["train_s"] > 0
