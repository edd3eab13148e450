"""The evaluation spec: score a model on a dataset with the jobs' reward sources (REST, gRPC, SDK, CLI).

An evaluation samples `samples_per_item` completions of every item of `dataset` (its first `max_items` rows
when set) and scores them with `rewards`, the same sources a job trains on (built-ins, graders, reward models,
signed remote endpoints). It runs on the workers like a job (queue, lease, usage, quotas, cancel); the service
stores each item's completions and rewards and, at the end, the summary (service.evaluations.stats).

Torch-free on purpose: the service validates submitted specs with these models.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from contract.config import GRPOConfig
from contract.fields import INT32_MAX, Int64, Text
from contract.spec import (
    METADATA_DESCRIPTION,
    NAME_PATTERN,
    JobSpec,
    Metadata,
    RewardSpec,
    check_builtin_model,
    check_reward_sources,
)

# Bounds: k samples of every item are generated in one batch per item group; past 64 the unbiased pass@k
# estimator gains little and one evaluation would rival a training job's cost.
MAX_SAMPLES_PER_ITEM = 64
MAX_EVAL_TOKENS = 32768


class EvaluationSpec(BaseModel):
    """One evaluation of `model` on `dataset`."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "examples": [
                {
                    "model": "checkpoint:ckpt_01J9Z3K2Q8",
                    "dataset": "ds_01J9Z3K2Q9",
                    "rewards": [{"type": "builtin", "name": "exact_match"}],
                    "samples_per_item": 4,
                    "temperature": 1.0,
                    "max_tokens": 64,
                    "seed": 0,
                }
            ]
        },
    )

    name: str | None = Field(None, pattern=NAME_PATTERN, description="Optional human-readable name.")
    model: Text = Field(
        min_length=1,
        max_length=512,
        description="checkpoint:<id> (one of your checkpoints), builtin:<preset>, an allowed Hugging Face id or a "
        "local path under the service's model roots: the same sources as a job's base_model.",
    )
    dataset: Text = Field(min_length=1, max_length=1024, description="Id of the dataset to evaluate on.")
    rewards: list[RewardSpec] = Field(min_length=1, max_length=16, description="Reward sources, as in a job.")
    samples_per_item: int = Field(
        1, ge=1, le=MAX_SAMPLES_PER_ITEM, description="k: completions sampled per item (pass@k uses all k)."
    )
    temperature: float = Field(
        1.0, ge=0, le=10, description="Sampling temperature; 0 decodes greedily (then samples_per_item must be 1)."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest set of this mass.")
    max_tokens: int = Field(256, ge=1, le=MAX_EVAL_TOKENS, description="Most new tokens per completion.")
    max_items: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Evaluate only the dataset's first max_items rows (default: all)."
    )
    seed: Int64 = Field(0, description="Seeds sampling (each item's samples depend on it and the item's index "
                        "only) and the bootstrap intervals: the same spec gives the same results.")
    metadata: Metadata = Field(default_factory=dict, description=METADATA_DESCRIPTION)

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        return check_builtin_model(value)

    @model_validator(mode="after")
    def _check(self) -> EvaluationSpec:
        if self.temperature == 0 and self.samples_per_item > 1:
            raise ValueError("temperature 0 decodes greedily: every sample would be the same; set samples_per_item "
                             "to 1 or a temperature above 0")
        check_reward_sources(self.rewards)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generation_config(self) -> GRPOConfig:
        """The sampling settings as the engine's generation reads them."""
        return GRPOConfig(
            num_generations=max(2, self.samples_per_item),
            prompts_per_step=1,
            max_steps=1,
            temperature=self.temperature or 1.0,
            top_p=self.top_p,
            max_completion_length=self.max_tokens,
            seed=self.seed,
            beta=0.0,
        )

    def as_job_spec(self) -> JobSpec:
        """The job that runs this evaluation, for what jobs and evaluations share: the model source, the
        dataset and reward-function references (checked per tenant at submission), the queue and the worker's
        input loading. Its hyperparameters only carry the generation settings."""
        return JobSpec(
            name=self.name,
            base_model=self.model,
            train_dataset=self.dataset,
            rewards=self.rewards,
            hyperparameters=self.generation_config(),
            metadata=self.metadata,
        )
