"""GRPO hyperparameters.

Field names follow TRL's `GRPOConfig` wherever the concept is the same, so users can carry
their settings over. This module must not import torch: the service validates submitted
hyperparameters with the very same model.

Where our default differs from TRL's it is said in the field's description.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from worker.grpo.health import HealthConfig

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
AdvantageStd = Literal["population", "unbiased"]
SchedulerType = Literal["constant", "linear", "cosine"]
GenerationMode = Literal["sample", "beam"]
DType = Literal["float32", "bfloat16", "float16", "auto"]


class LoraConfig(BaseModel):
    """Low-rank adapters (via `peft`). The reference policy is then the base model with adapters off."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1, le=1024, description="Adapter rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (lora_alpha).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt, or 'all-linear' for every linear layer except the LM head.",
    )


class GRPOConfig(BaseModel):
    """Every knob of a GRPO run. Validated with errors that name the field."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- batch shape -------------------------------------------------------------------------
    num_generations: int = Field(8, ge=2, le=256, description="G: completions sampled per prompt (>= 2).")
    prompts_per_step: int = Field(4, ge=1, le=4096, description="Prompts per optimiser step.")
    max_steps: int | None = Field(
        None, ge=1, description="Optimiser steps to run. If unset, derived from num_epochs and the dataset size."
    )
    num_epochs: float | None = Field(
        None, gt=0, description="Passes over the training prompts (used when max_steps is unset)."
    )
    mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="Completions per forward/backward pass; gradients are accumulated over the step. "
        "None = all completions of the step in one pass.",
    )
    num_iterations: int = Field(1, ge=1, le=64, description="mu: optimisation passes over each generated batch.")

    # --- optimiser -----------------------------------------------------------------------------
    learning_rate: float = Field(1e-6, gt=0, lt=1, description="Peak AdamW learning rate (TRL default 1e-6).")
    lr_scheduler: SchedulerType = Field("linear", description="Decay after warmup: constant, linear or cosine to 0.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps from 0 to learning_rate.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Global gradient-norm clip; None disables.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")

    # --- GRPO objective ------------------------------------------------------------------------
    beta: float = Field(
        0.0, ge=0, description="KL weight against the frozen reference (k3 estimator). 0 = no reference model."
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="Lower clip: ratio >= 1 - epsilon.")
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clip: ratio <= 1 + epsilon_high. None = same as epsilon (DAPO uses 0.28)."
    )
    loss_type: LossType = Field(
        "dapo",
        description="Aggregation of the per-token loss: grpo (per-sequence mean, then mean), bnpo (token "
        "mean per mini-batch), dr_grpo (sum / (sequences x max_completion_length)), dapo (token mean over "
        "the whole step).",
    )
    scale_rewards: ScaleRewards = Field(
        "group", description="Divide centred rewards by the group's std, the batch's std, or not at all."
    )
    advantage_std: AdvantageStd = Field(
        "population",
        description="Std used for scaling: 'population' (1/G, the GRPO paper's) or 'unbiased' (1/(G-1), TRL's).",
    )
    advantage_eps: float = Field(1e-4, gt=0, description="Added to the std before dividing.")
    mask_truncated_completions: bool = Field(
        False, description="Exclude completions that hit max_completion_length without EOS from the loss."
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: drop zero-spread groups and refill from further prompts "
        "(at most max_resample_rounds extra generation rounds per step).",
    )
    max_resample_rounds: int = Field(2, ge=0, le=16, description="Bound on dynamic-sampling refill rounds.")

    # --- generation ----------------------------------------------------------------------------
    generation: GenerationMode = Field(
        "sample", description="'sample' (nucleus/top-k sampling) or 'beam' (G distinct beams, seed 001)."
    )
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature; log-probs use logits / T.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables.")
    max_prompt_length: int | None = Field(
        512, ge=1, description="Prompts longer than this (tokens) are truncated from the left; None = no limit."
    )
    max_completion_length: int = Field(256, ge=1, le=32768, description="Max new tokens per completion.")

    # --- model ---------------------------------------------------------------------------------
    lora: LoraConfig | None = Field(None, description="LoRA adapters; None = full fine-tuning.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
    dtype: DType = Field("float32", description="Weights dtype. Log-probs are always computed in float32.")
    seed: int = Field(42, description="Seeds data order, sampling and initialisation.")

    # --- bookkeeping ---------------------------------------------------------------------------
    checkpoint_every: int = Field(50, ge=1, description="Save a checkpoint every N steps (and at the end).")
    save_total_limit: int | None = Field(3, ge=1, description="Keep at most this many checkpoints; None = all.")
    eval_every: int | None = Field(None, ge=1, description="Evaluate on the eval dataset every N steps.")
    eval_samples: int = Field(32, ge=1, description="Eval prompts per evaluation (one greedy completion each).")
    log_completions_every: int = Field(10, ge=1, description="Record sample completions every N steps.")
    log_completions_count: int = Field(8, ge=1, description="How many completions to record each time.")

    # --- training health (worker.grpo.health) ---------------------------------------------------
    on_unhealthy: Literal["warn", "pause"] = Field(
        "warn",
        description="What a health warning does: 'warn' records a health event, 'pause' also pauses the "
        "job (resumable) with the finding as its reason.",
    )
    health: HealthConfig = Field(default_factory=HealthConfig, description="Health detector thresholds.")

    @model_validator(mode="after")
    def _check_consistency(self) -> GRPOConfig:
        if self.max_steps is None and self.num_epochs is None:
            raise ValueError("set max_steps or num_epochs")
        if self.mini_batch_size is not None:
            completions = self.prompts_per_step * self.num_generations
            if completions % self.mini_batch_size != 0:
                raise ValueError(
                    f"mini_batch_size ({self.mini_batch_size}) must divide prompts_per_step x num_generations "
                    f"({completions})"
                )
        if self.warmup_steps and self.max_steps is not None and self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be < max_steps ({self.max_steps})")
        if self.generation == "beam" and self.temperature != 1.0 and self.top_p != 1.0:
            raise ValueError("beam generation ignores top_p; leave it at 1.0")
        return self

    @property
    def clip_high(self) -> float:
        """Upper clip offset, epsilon_high or epsilon."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    def total_steps(self, num_prompts: int) -> int:
        """Optimiser steps for a dataset of `num_prompts` rows."""
        if self.max_steps is not None:
            return self.max_steps
        assert self.num_epochs is not None  # guaranteed by the validator
        return max(1, int(self.num_epochs * num_prompts / self.prompts_per_step))
