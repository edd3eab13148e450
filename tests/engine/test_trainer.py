"""GRPOTrainer on the tiny model: parameters move, LoRA and the reference behave, hooks and metrics work."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from contract.reward_types import RewardInput
from tests.engine.trainer_helpers import (
    char_count_reward,
    small_config,
    spread_reward,
    trainer_kwargs,
    word_rows,
)
from worker.grpo.batch import loss_mask_for
from worker.grpo.checkpoint import verify_manifest
from worker.grpo.data import PromptRow
from worker.grpo.logprobs import completion_logprobs
from worker.grpo.rewards import CompositeReward, FunctionSource
from worker.grpo.rollout import Rollout, generate_rollout
from worker.grpo.trainer import GRPOTrainer

EXPECTED_METRICS = {
    "reward/mean",
    "reward/std",
    "reward/spread/mean",
    "frac_zero_std_groups",
    "groups/dominated_frac",
    "advantage/abs_mean",
    "loss",
    "kl",
    "clip_ratio/low",
    "clip_ratio/high",
    "clip_ratio/region",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "entropy",
    "completion_length/mean",
    "completion_length/min",
    "completion_length/max",
    "truncated_fraction",
    "learning_rate",
    "grad_norm",
    "time/generate_s",
    "time/reward_s",
    "time/train_s",
    "time/step_s",
    "tokens_per_s",
    "usage/tokens_generated",
    "usage/tokens_trained",
    "usage/reward_calls",
}


@pytest.fixture
def models_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir.parent  # resolve_model_path("builtin:tiny", models_dir) finds the built model


def _snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class TestParametersMove:
    def test_one_step_changes_every_trainable_parameter(self, tmp_path: Path, models_dir: Path) -> None:
        trainer = GRPOTrainer(
            small_config(max_steps=1, beta=0.04),
            train_rows=word_rows(),
            reward=spread_reward(),
            **trainer_kwargs(tmp_path, models_dir),
        )
        before = _snapshot(trainer.models.policy)
        reference_before = _snapshot(trainer.models.reference)
        result = trainer.train()
        assert result.step == 1
        unchanged = [n for n, p in trainer.models.policy.named_parameters() if torch.equal(p, before[n])]
        assert unchanged == []
        # The frozen reference copy never moves.
        reference = trainer.models.reference
        assert reference is not None
        for name, param in reference.named_parameters():
            assert torch.equal(param, reference_before[name]), name

    def test_lora_changes_only_adapters_and_reference_is_the_base_model(
        self, tmp_path: Path, models_dir: Path, tiny_model_dir: Path
    ) -> None:
        config = small_config(max_steps=2, beta=0.04, lora={"r": 4, "alpha": 8})
        trainer = GRPOTrainer(
            config, train_rows=word_rows(), reward=spread_reward(), **trainer_kwargs(tmp_path, models_dir)
        )
        assert trainer.models.reference is None  # no second copy with LoRA
        policy = trainer.models.policy
        before = _snapshot(policy)
        trainer.train()  # two steps: lora_B starts at 0, so lora_A only gets a gradient from step 2

        changed = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
        adapters = {n for n, _ in policy.named_parameters() if "lora_" in n}
        assert adapters and changed == adapters
        assert {n for n, p in policy.named_parameters() if p.requires_grad} == adapters

        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        rollout = generate_rollout(
            policy, trainer.models.tokenizer, ["cat: ", "dog: "], config, generator_seed=1
        )
        length = rollout.completion_ids.shape[1]
        expected, _ = completion_logprobs(
            base, rollout.input_ids, rollout.attention_mask, length, temperature=1.0
        )
        got = trainer.models.reference_logps(
            rollout.input_ids, rollout.attention_mask, length, temperature=1.0
        )
        mask = rollout.completion_mask.bool()
        assert torch.allclose(got[mask], expected[mask], atol=1e-6)
        with torch.no_grad():
            trained, _ = completion_logprobs(
                policy, rollout.input_ids, rollout.attention_mask, length, temperature=1.0
            )
        assert not torch.allclose(trained[mask], expected[mask], atol=1e-4)  # the adapters do matter

    def test_beta_zero_builds_no_reference(self, tmp_path: Path, models_dir: Path) -> None:
        trainer = GRPOTrainer(
            small_config(max_steps=1),
            train_rows=word_rows(),
            reward=spread_reward(),
            **trainer_kwargs(tmp_path, models_dir),
        )
        assert trainer.models.reference is None
        metrics = trainer.train().history[0]
        assert "kl" not in metrics


class TestMetricsAndHooks:
    def test_metrics_names_samples_and_checkpoint_hook(self, tmp_path: Path, models_dir: Path) -> None:
        seen: list[tuple[int, dict[str, float], list[dict[str, Any]]]] = []
        checkpoints: list[tuple[int, Path, dict[str, Any]]] = []
        config = small_config(
            max_steps=2,
            beta=0.04,
            checkpoint_every=1,
            log_completions_every=2,
            log_completions_count=3,
            num_iterations=2,
            mini_batch_size=4,
            loss_type="grpo",
        )
        GRPOTrainer(
            config,
            train_rows=word_rows(),
            reward=spread_reward(),
            on_metrics=lambda step, metrics, samples: seen.append((step, metrics, samples)),
            on_checkpoint=lambda step, path, manifest: checkpoints.append((step, path, manifest)),
            **trainer_kwargs(tmp_path, models_dir),
        ).train()
        assert [s for s, _, _ in seen] == [1, 2]
        for _, metrics, _ in seen:
            assert set(metrics) == EXPECTED_METRICS
            assert all(math.isfinite(v) for v in metrics.values())
            completions = config.prompts_per_step * config.num_generations
            assert metrics["usage/tokens_generated"] == round(metrics["completion_length/mean"] * completions)
            assert metrics["usage/reward_calls"] == completions  # one reward source
            assert metrics["usage/tokens_trained"] > metrics["usage/tokens_generated"]  # prompts too
        assert seen[0][2] == [] and len(seen[1][2]) == 3
        sample = seen[1][2][0]
        assert set(sample) == {
            "step", "group", "prompt", "completion", "reward", "rewards", "advantage", "policy_version"
        }
        assert sample["policy_version"] == 1  # step 2, sampled by the weights of step 1's update
        for logged in seen[1][2]:  # one source: its reward, by name, is the total
            assert logged["rewards"] == {"spread": logged["reward"]}
        assert [s for s, _, _ in checkpoints] == [1, 2]
        for _, path, manifest in checkpoints[1:]:
            assert verify_manifest(path) == manifest

    def test_should_stop_saves_and_returns_stopped(self, tmp_path: Path, models_dir: Path) -> None:
        calls = {"n": 0}

        def should_stop() -> bool:
            calls["n"] += 1
            return calls["n"] > 2  # polled before each step: stop before step 3

        result = GRPOTrainer(
            small_config(max_steps=10),
            train_rows=word_rows(),
            reward=spread_reward(),
            should_stop=should_stop,
            **trainer_kwargs(tmp_path, models_dir),
        ).train()
        assert result.stopped and result.step == 2
        assert result.last_checkpoint == tmp_path / "run" / "checkpoint-2"
        verify_manifest(result.last_checkpoint)

    def test_eval_reports_greedy_reward(self, tmp_path: Path, models_dir: Path) -> None:
        result = GRPOTrainer(
            small_config(max_steps=2, eval_every=2, eval_samples=3),
            train_rows=word_rows(),
            eval_rows=word_rows()[:5],
            reward=char_count_reward(),
            **trainer_kwargs(tmp_path, models_dir),
        ).train()
        assert "eval/reward/mean" not in result.history[0]
        assert 0.0 <= result.history[1]["eval/reward/mean"] <= 1.0
        assert "eval/reward/target/mean" in result.history[1]


class TestDynamicSampling:
    def test_zero_spread_groups_are_replaced_by_fresh_prompts(self, tmp_path: Path, models_dir: Path) -> None:
        rows = [PromptRow(f"flat {i}: ", {"flat": True}) for i in range(4)] + [
            PromptRow(f"live {i}: ", {"flat": False}) for i in range(4)
        ]

        def score(item: Any) -> float:
            return 1.0 if item.extras["flat"] else float(sum(item.completion_ids) % 17)

        samples: list[dict[str, Any]] = []
        config = small_config(
            max_steps=1,
            dynamic_sampling=True,
            max_resample_rounds=8,
            log_completions_every=1,
            log_completions_count=8,
        )
        result = GRPOTrainer(
            config,
            train_rows=rows,
            reward=CompositeReward([(FunctionSource("mixed", score), 1.0)]),
            on_metrics=lambda step, metrics, logged: samples.extend(logged),
            **trainer_kwargs(tmp_path, models_dir),
        ).train()
        # The trained batch holds only prompts whose completions disagree (enough live ones exist).
        assert {s["prompt"].split()[0] for s in samples} == {"live"}
        assert result.history[0]["advantage/abs_mean"] > 0


class TestGradientAccumulation:
    @pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
    @pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
    def test_mini_batches_give_the_same_update_as_one_batch(
        self, tmp_path: Path, models_dir: Path, loss_type: str
    ) -> None:
        """dapo divides by the whole step's tokens; grpo/dr_grpo average equal-sized mini-batches."""
        grads = []
        for mini_batch_size in (None, 2):
            trainer = GRPOTrainer(
                small_config(max_steps=1, loss_type=loss_type, mini_batch_size=mini_batch_size),
                train_rows=word_rows(),
                reward=spread_reward(),
                **trainer_kwargs(tmp_path / str(mini_batch_size), models_dir),
            )
            grads.append(_capture_gradients(trainer))
            trainer.train()
        assert grads[0] and grads[0].keys() == grads[1].keys()
        for name, value in grads[0].items():
            torch.testing.assert_close(grads[1][name], value, atol=1e-6, rtol=1e-4, msg=str(name))


def _capture_gradients(trainer: GRPOTrainer) -> dict[int, torch.Tensor]:
    """Record every parameter's (clipped) gradient when the optimiser steps (comparing weights after
    Adam's first step would amplify float noise in near-zero gradients)."""
    captured: dict[int, torch.Tensor] = {}
    optimizer = trainer.models.optimizer
    original_step = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        for index, param in enumerate(trainer.models.trainable_parameters):
            assert param.grad is not None
            captured[index] = param.grad.detach().clone()
        return original_step(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]
    return captured


class TestModelOptions:
    def test_gradient_checkpointing_runs_and_trains(self, tmp_path: Path, models_dir: Path) -> None:
        trainer = GRPOTrainer(
            small_config(max_steps=1, gradient_checkpointing=True),
            train_rows=word_rows(),
            reward=spread_reward(),
            **trainer_kwargs(tmp_path, models_dir),
        )
        before = _snapshot(trainer.models.policy)
        trainer.train()
        assert all(not torch.equal(p, before[n]) for n, p in trainer.models.policy.named_parameters())

    def test_bfloat16_weights(self, tmp_path: Path, models_dir: Path) -> None:
        trainer = GRPOTrainer(
            small_config(max_steps=1, dtype="bfloat16", beta=0.04),
            train_rows=word_rows(),
            reward=spread_reward(),
            **trainer_kwargs(tmp_path, models_dir),
        )
        assert next(trainer.models.policy.parameters()).dtype == torch.bfloat16
        metrics = trainer.train().history[0]
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["kl"])


    @pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
    def test_bf16_autocast_runs_every_forward_in_bf16_over_float32_weights(
        self, tmp_path: Path, models_dir: Path, lora: bool
    ) -> None:
        """bf16: the weights stay float32 and change; sampling, the reference and the policy's forwards all run
        their matmuls in bf16 (seen inside the model); the log-probs the loss gets are float32; the run takes
        the hf backend (the fast path does not go through the module forward)."""
        extra: dict[str, Any] = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}} if lora else {}
        trainer = GRPOTrainer(
            small_config(max_steps=1, bf16=True, beta=0.04, **extra),
            train_rows=word_rows(),
            reward=spread_reward(),
            **trainer_kwargs(tmp_path, models_dir),
        )
        assert trainer.backend.name == "hf"
        policy = trainer.models.policy
        projections = [m for n, m in policy.named_modules() if n.endswith("mlp.down_proj")]
        seen: list[tuple[bool, torch.dtype]] = []
        hooks = [
            module.register_forward_hook(
                lambda _m, _args, out: seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
            )
            for module in projections
        ]
        logps_dtypes: list[torch.dtype] = []
        original = trainer.backend.policy_forward

        def policy_forward(*args: Any, **kwargs: Any) -> Any:
            logps, entropy = original(*args, **kwargs)
            logps_dtypes.append(logps.dtype)
            return logps, entropy

        trainer.backend.policy_forward = policy_forward  # type: ignore[method-assign]
        before = _snapshot(policy)
        metrics = trainer.train().history[0]
        for hook in hooks:
            hook.remove()
        assert seen and set(seen) == {(True, torch.bfloat16)}
        assert logps_dtypes and set(logps_dtypes) == {torch.float32}
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["kl"])
        trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
        assert {p.dtype for p in policy.parameters()} == {torch.float32}
        changed = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
        # lora_B starts at 0, so lora_A only gets a gradient from the second step
        assert changed == ({n for n in trainable if "lora_B" in n} if lora else trainable)

    @pytest.mark.slow
    def test_torch_compile_compiles_each_decoder_layer_and_trains_the_same_step(
        self, tmp_path: Path, models_dir: Path
    ) -> None:
        """torch_compile: every decoder layer is compiled, the layers share their compiled graphs, the run takes
        the hf backend, and the step's samples, loss and gradients are those of the same run uncompiled."""
        runs = {}
        for compiled in (False, True):
            trainer = GRPOTrainer(
                small_config(max_steps=1, beta=0.04, torch_compile=compiled),
                train_rows=word_rows(),
                reward=spread_reward(),
                backend="hf",
                **trainer_kwargs(tmp_path / str(compiled), models_dir),
            )
            layers = trainer.models.policy.get_decoder().layers
            assert all(("forward" in vars(layer)) == compiled for layer in layers)  # the instance's own forward
            torch._dynamo.reset()
            counters.clear()
            grads = _capture_gradients(trainer)
            runs[compiled] = (trainer.train().history[0], grads)
            # The layers share their graphs (one per grad mode and shape class), however many layers there are;
            # compiling where each reads its own KV cache entry (decoding) would compile one per layer.
            graphs = counters["stats"]["unique_graphs"]
            assert (1 <= graphs < len(layers)) if compiled else graphs == 0, (graphs, len(layers))
        (plain, plain_grads), (compiled_metrics, compiled_grads) = runs[False], runs[True]
        assert compiled_metrics["completion_length/mean"] == plain["completion_length/mean"]
        assert compiled_metrics["reward/mean"] == plain["reward/mean"]
        assert compiled_metrics["loss"] == pytest.approx(plain["loss"], rel=1e-4, abs=1e-6)
        for index, grad in plain_grads.items():
            torch.testing.assert_close(compiled_grads[index], grad, atol=1e-5, rtol=1e-3, msg=str(index))

    def test_an_automatic_backend_never_takes_the_fast_path_with_compile_or_bf16(
        self, tmp_path: Path, models_dir: Path
    ) -> None:
        for index, option in enumerate(({"bf16": True}, {"torch_compile": True}, {})):
            trainer = GRPOTrainer(
                small_config(max_steps=1, **option),
                train_rows=word_rows(),
                reward=spread_reward(),
                **trainer_kwargs(tmp_path / str(index), models_dir),
            )
            assert trainer.backend.name == ("hf" if option else "fused"), option


def test_loss_mask_drops_truncated_completions_and_excluded_groups() -> None:
    rollout = Rollout(
        prompt_ids=torch.zeros((4, 1), dtype=torch.long),
        prompt_mask=torch.ones((4, 1), dtype=torch.long),
        completion_ids=torch.zeros((4, 3), dtype=torch.long),
        completion_mask=torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]),
        is_truncated=torch.tensor([False, True, False, True]),
        completion_texts=["", "", "", ""],
        group_size=2,
    )
    both_groups = torch.tensor([True, True])
    assert torch.equal(loss_mask_for(rollout, both_groups, mask_truncated=False), rollout.completion_mask)
    expected = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]])
    assert torch.equal(loss_mask_for(rollout, both_groups, mask_truncated=True), expected)
    first_only = loss_mask_for(rollout, torch.tensor([True, False]), mask_truncated=False)
    assert torch.equal(first_only, torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]))


class TestOverlap:
    def test_reward_scoring_overlaps_the_reference_forward_pass(
        self, tmp_path: Path, models_dir: Path
    ) -> None:
        events: dict[str, float] = {}

        class SlowSource:
            name = "slow"

            async def __call__(self, items: Any, *, step: int) -> list[float | None]:
                events["reward_start"] = time.perf_counter()
                await asyncio.sleep(0.5)  # a remote endpoint taking its time
                events["reward_end"] = time.perf_counter()
                return [float(i % 3) for i in range(len(items))]

        trainer = GRPOTrainer(
            small_config(max_steps=1, beta=0.04),
            train_rows=word_rows(),
            reward=CompositeReward([(SlowSource(), 1.0)]),
            **trainer_kwargs(tmp_path, models_dir),
        )
        reference_logps = trainer.models.reference_logps

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            events.setdefault("reference_start", time.perf_counter())
            result = reference_logps(*args, **kwargs)
            events["reference_end"] = time.perf_counter()
            return result

        trainer.models.reference_logps = timed  # type: ignore[method-assign]
        metrics = trainer.train().history[0]
        # The reference pass did not wait for the rewards: it finished while the source was still sleeping.
        assert events["reference_end"] < events["reward_end"]
        assert metrics["time/reward_s"] >= 0.5


class TestForwardWhileScoring:
    @pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
    def test_first_forward_runs_while_a_slow_reward_scores_and_changes_nothing(
        self, tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A slow reward: the policy's first forward runs before its scores arrive; the update is the
        one the forward after scoring gives (the same with fsdp's rule, where it must wait)."""
        events: list[str] = []

        def slow(item: RewardInput) -> float:
            time.sleep(0.01)
            events.append("scored")
            return float(sum(item.completion_ids) % 17)

        grads = []
        for early in (True, False):
            events.clear()
            trainer = GRPOTrainer(
                small_config(max_steps=1, mini_batch_size=4),
                train_rows=word_rows(),
                reward=CompositeReward([(FunctionSource("slow", slow), 1.0)]),
                **trainer_kwargs(tmp_path / str(early), models_dir),
            )
            monkeypatch.setattr(type(trainer.parallel), "local_forward", early)  # a class attribute for the run
            forward = trainer.backend.policy_forward

            def spy(*args: Any, forward: Any = forward, **kwargs: Any) -> Any:
                events.append("forward")
                return forward(*args, **kwargs)

            monkeypatch.setattr(trainer.backend, "policy_forward", spy)
            grads.append(_capture_gradients(trainer))
            trainer.train()
            first = events.index("forward")
            # 8 completions in two mini-batches: each forward once, the first before the last score when early
            assert events.count("forward") == 2
            assert (first < len(events) - 1 - events[::-1].index("scored")) is early
        for name, value in grads[0].items():
            torch.testing.assert_close(grads[1][name], value, atol=0, rtol=0, msg=str(name))
