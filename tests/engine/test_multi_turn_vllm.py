"""Multi-turn rollouts through vLLM (its CPU build, in process) and through the policy give the same episodes
where the sampler is deterministic: greedy decoding (top_k 1) of the warm tool model, float32 on both sides.

Sampled decoding cannot be compared token for token: vLLM draws from its own generator, ours from torch's, so
the same seed gives different (equally distributed) tokens.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from tests.engine.test_multi_turn import Adder
from tests.engine.trainer_helpers import shared_model_cache, small_config
from worker.grpo.data import PromptRow
from worker.grpo.environment import LocalEnvironment, MultiTurnSettings
from worker.grpo.modeling import build_model_bundle
from worker.grpo.multi_turn import MultiTurnRollout
from worker.grpo.rollout import eos_token_ids, sample_continuations
from worker.grpo.tool_tasks import split
from worker.grpo.vllm_rollout import VLLMRollout


class Calculator(Adder):
    def multiply(self, a: float, b: float) -> float:
        """Multiply two numbers."""
        return float(a) * float(b)


def test_vllm_and_native_multi_turn_rollouts_give_the_same_greedy_episodes(tmp_path: Path) -> None:
    config = small_config(use_vllm=True, top_k=1, max_completion_length=160, num_generations=2, prompts_per_step=3)
    models = build_model_bundle("builtin:tiny-tools", config, cache_dir=shared_model_cache(), total_updates=1,
                                device="cpu")
    rows = [PromptRow(item.row()["prompt"], {"answer": item.answer}) for item in split()[1][:3]]
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def rollout_with(sample: Any, with_logprobs: bool) -> Any:
        environment = LocalEnvironment(Calculator, settings=MultiTurnSettings(max_turns=3))
        engine = MultiTurnRollout(models.tokenizer, config, environment, sample, run,
                                  eos_token_ids(models.policy, models.tokenizer), with_logprobs=with_logprobs)
        return engine.generate(rows, [11, 12, 13])[0]

    try:
        engine = VLLMRollout(models, config, tmp_path)
        try:
            by_vllm = rollout_with(engine.continue_sequences, True)
        finally:
            engine.close()
        native = rollout_with(
            lambda s, b, seeds: sample_continuations(models.policy, models.tokenizer, s, b, seeds, config), False)
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert torch.equal(by_vllm.completion_ids, native.completion_ids)
    assert torch.equal(by_vllm.tool_mask, native.tool_mask)
    assert by_vllm.episodes == native.episodes
    assert max(len(e["turns"]) for e in native.episodes) >= 2  # the tool was called: more than one turn
    assert by_vllm.sampler_logps is not None and native.sampler_logps is None
    assert float(by_vllm.sampler_logps[by_vllm.tool_mask == 0].abs().sum()) == 0.0  # no log-prob on tool tokens
