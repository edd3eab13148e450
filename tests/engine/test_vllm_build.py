"""`build_llm` around vLLM's constructor (a stand-in `vllm` module: only the wrapping is under test): the heap it
freezes before the build stays frozen for the engine (vLLM unfreezes it at shutdown), and a build that fails
leaves nothing frozen and the trainer's thread count as it was."""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from worker.grpo.vllm_rollout import build_llm


@pytest.fixture
def vllm_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    module = types.ModuleType("vllm")
    monkeypatch.setitem(sys.modules, "vllm", module)
    yield module
    gc.unfreeze()


def test_a_failed_build_leaves_nothing_frozen(vllm_module: types.ModuleType) -> None:
    def failing(**_options: Any) -> None:
        torch.set_num_threads(1)  # as vLLM's CPU build binds its threads before it fails
        raise RuntimeError("no such model")

    vllm_module.LLM = failing  # type: ignore[attr-defined]
    threads, frozen = torch.get_num_threads(), gc.get_freeze_count()  # an earlier test may have frozen some
    with pytest.raises(RuntimeError, match="no such model"):
        build_llm({"model": "/nowhere"})
    assert gc.get_freeze_count() <= frozen
    assert torch.get_num_threads() == threads


def test_a_built_engine_keeps_the_heap_frozen_until_its_shutdown(vllm_module: types.ModuleType) -> None:
    vllm_module.LLM = lambda **options: options  # type: ignore[attr-defined]
    gc.unfreeze()
    assert build_llm({"model": "tiny"}) == {"model": "tiny"}
    assert gc.get_freeze_count() > 0
