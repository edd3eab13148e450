"""OpenAI fine-tuning requests to our job spec, and our rows to OpenAI's objects. Pure functions.

Hyperparameters (docs/openai.md has the table; ``auto`` is our default):

| OpenAI (method.reinforcement.hyperparameters) | ours (GRPOConfig)                        |
| n_epochs                 | num_epochs (auto: 1)                                         |
| batch_size               | prompts_per_step (auto: 4)                                   |
| learning_rate_multiplier | learning_rate = multiplier x 1e-6 (auto: 1e-6)               |
| compute_multiplier       | num_generations = round(multiplier x 8), 2..256 (auto: 8)    |
| eval_interval            | eval_every, needs validation_file (auto: none)               |
| eval_samples             | eval_samples (auto: 32)                                      |
| reasoning_effort         | only "default": our models have no reasoning-effort setting  |
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contract.api.jobs import EventOut, JobOut
from contract.config import GRPOConfig
from contract.graders import GraderInvalid, grader_dump, parse_grader
from contract.spec import GraderRewardSpec, JobSpec
from service.openai.errors import OpenAIInvalid, loc_param, openai_param

DEFAULT_LEARNING_RATE = 1e-6
DEFAULT_GENERATIONS = 8
HYPER = "method.reinforcement.hyperparameters"
GRADER = "method.reinforcement.grader"
Auto = Literal["auto"]
# OpenAI's file ids begin with "file-" and client code checks the prefix. A file here is one of our datasets:
# "file-<body>" names the dataset "ds_<body>" (one ULID body, so either id finds the same rows).
FILE_PREFIX = "file-"
DATASET_PREFIX = "ds_"


def file_id(dataset_id: str) -> str:
    """The OpenAI file id of a dataset id; any other dataset reference (a name) is shown as it is."""
    return FILE_PREFIX + dataset_id.removeprefix(DATASET_PREFIX) if dataset_id.startswith(DATASET_PREFIX) else dataset_id


def dataset_id(file_id: str) -> str:
    """The dataset a file id names; our own ids and dataset names are accepted as they are."""
    return DATASET_PREFIX + file_id.removeprefix(FILE_PREFIX) if file_id.startswith(FILE_PREFIX) else file_id


class Hyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    n_epochs: Auto | Annotated[int, Field(ge=1, le=1000)] = "auto"
    batch_size: Auto | Annotated[int, Field(ge=1, le=4096)] = "auto"
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0)] = "auto"
    compute_multiplier: Auto | Annotated[float, Field(gt=0)] = "auto"
    eval_interval: Auto | Annotated[int, Field(ge=1, le=2**31 - 1)] = "auto"
    eval_samples: Auto | Annotated[int, Field(ge=1, le=100_000)] = "auto"
    reasoning_effort: Literal["default", "low", "medium", "high"] = "default"


class Reinforcement(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: dict[str, Any]
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)


class Method(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["supervised", "dpo", "reinforcement"]
    reinforcement: Reinforcement | None = None
    supervised: dict[str, Any] | None = None
    dpo: dict[str, Any] | None = None


class JobCreate(BaseModel):
    """The body of POST /fine_tuning/jobs, as the openai SDK sends it."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=512)
    training_file: str = Field(min_length=1, max_length=1024)
    validation_file: str | None = Field(None, min_length=1, max_length=1024)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    suffix: str | None = Field(None, min_length=1, max_length=64)
    metadata: dict[str, str] | None = None
    method: Method | None = None
    hyperparameters: dict[str, Any] | None = None
    integrations: list[dict[str, Any]] | None = None


def _value(hyper: Hyperparameters, name: str, auto: Any) -> Any:
    value = getattr(hyper, name)
    return auto if value == "auto" else value


def to_job_spec(body: JobCreate) -> JobSpec:
    """Our spec for an OpenAI reinforcement job; OpenAIInvalid names the `param` we cannot honour."""
    if body.integrations:
        raise OpenAIInvalid("integrations", "integrations (wandb) are not supported; follow the job's events instead")
    if body.hyperparameters:
        raise OpenAIInvalid("hyperparameters", f"give hyperparameters in {HYPER} (the top-level field is deprecated)")
    if body.method is None or body.method.type != "reinforcement":
        kind = body.method.type if body.method else "supervised (the default without method)"
        raise OpenAIInvalid(
            "method.type", f"{kind} fine-tuning is not supported; this service runs reinforcement (GRPO) jobs",
            code="unsupported_method",
        )
    if body.method.reinforcement is None:
        raise OpenAIInvalid("method.reinforcement", "required when method.type is reinforcement")
    try:
        grader = parse_grader(body.method.reinforcement.grader, GRADER)
    except GraderInvalid as exc:
        raise OpenAIInvalid(exc.param, exc.message) from exc
    hyper = body.method.reinforcement.hyperparameters
    if hyper.reasoning_effort != "default":
        raise OpenAIInvalid(f"{HYPER}.reasoning_effort", "only 'default': the models trained here have no "
                            "reasoning-effort setting")
    if hyper.eval_interval != "auto" and body.validation_file is None:
        raise OpenAIInvalid(f"{HYPER}.eval_interval", "needs a validation_file to evaluate on")
    generations = round(_value(hyper, "compute_multiplier", 1.0) * DEFAULT_GENERATIONS)
    if not 2 <= generations <= 256:
        raise OpenAIInvalid(f"{HYPER}.compute_multiplier", f"gives {generations} completions per prompt "
                            f"(multiplier x {DEFAULT_GENERATIONS}); it must give 2 to 256")
    learning_rate = _value(hyper, "learning_rate_multiplier", 1.0) * DEFAULT_LEARNING_RATE
    if not learning_rate < 1:
        raise OpenAIInvalid(f"{HYPER}.learning_rate_multiplier", f"gives a learning rate of {learning_rate:g}; it "
                            f"must be below 1 (multiplier x {DEFAULT_LEARNING_RATE:g})")
    config: dict[str, Any] = {
        "num_epochs": _value(hyper, "n_epochs", 1),
        "prompts_per_step": _value(hyper, "batch_size", 4),
        "learning_rate": learning_rate,
        "num_generations": generations,
        "eval_every": _value(hyper, "eval_interval", None),
    }
    if hyper.eval_samples != "auto":
        config["eval_samples"] = hyper.eval_samples
    if body.seed is not None:
        config["seed"] = body.seed
    values = {
        "name": body.suffix,
        "base_model": body.model,
        "train_dataset": dataset_id(body.training_file),
        "eval_dataset": dataset_id(body.validation_file) if body.validation_file is not None else None,
        "rewards": [{"type": "grader", "grader": grader_dump(grader)}],
        "hyperparameters": config,
        "metadata": body.metadata or {},
    }
    try:
        return JobSpec.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = openai_param(loc_param(error["loc"]))
        raise OpenAIInvalid(param, str(error["msg"])) from exc


# --- our objects in OpenAI's shapes ---------------------------------------------------------------------


def unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def hyperparameters_of(config: GRPOConfig) -> dict[str, Any]:
    """OpenAI's hyperparameters for any job (also one created with our own API)."""
    return {
        "n_epochs": int(config.num_epochs) if config.num_epochs is not None else "auto",
        "batch_size": config.prompts_per_step,
        "learning_rate_multiplier": config.learning_rate / DEFAULT_LEARNING_RATE,
        "compute_multiplier": config.num_generations / DEFAULT_GENERATIONS,
        "eval_interval": config.eval_every if config.eval_every is not None else "auto",
        "eval_samples": config.eval_samples,
        "reasoning_effort": "default",
    }


# Our states OpenAI has no name for are passed through: "paused" (OpenAI's paused jobs too), "cancelling".
_STATUS = {"queued": "queued", "running": "running", "succeeded": "succeeded", "failed": "failed",
           "cancelled": "cancelled"}


def job_object(job: JobOut, fine_tuned_model: str | None, organization_id: str) -> dict[str, Any]:
    spec = job.spec
    grader = next((r.grader for r in spec.rewards if isinstance(r, GraderRewardSpec)), None)
    hyper = hyperparameters_of(spec.hyperparameters)
    error = None
    if job.error is not None:
        error = {"code": job.error.code, "message": job.error.message, "param": None}
    return {
        "object": "fine_tuning.job",
        "id": job.id,
        "created_at": unix(job.created_at),
        "finished_at": unix(job.finished_at),
        "model": job.base_model,
        "fine_tuned_model": fine_tuned_model,
        "organization_id": organization_id,
        "status": _STATUS.get(job.status.value, job.status.value),
        "training_file": file_id(job.train_dataset),
        "validation_file": file_id(job.eval_dataset) if job.eval_dataset is not None else None,
        "result_files": [],
        "trained_tokens": None,
        "estimated_finish": None,
        "seed": spec.hyperparameters.seed,
        "error": error,
        "user_provided_suffix": job.name,
        "metadata": job.metadata or None,
        "integrations": [],
        "hyperparameters": {k: hyper[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier")},
        "method": {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": hyper}},
    }


_WARN = ("reward_retry", "reward_degraded", "health", "pause_requested")


def event_object(event: EventOut) -> dict[str, Any]:
    failed = event.type == "status" and event.data.get("to") == "failed"
    level = "error" if failed else "warn" if event.type.startswith(_WARN) else "info"
    data = dict(event.data)
    if event.step is not None:
        data.setdefault("step", event.step)
    return {
        "object": "fine_tuning.job.event",
        "id": str(event.id),
        "created_at": unix(event.created_at),
        "level": level,
        "message": event.message,
        "type": "metrics" if event.type == "metrics" else "message",
        "data": {"event_type": event.type, **data},
    }


def checkpoint_object(checkpoint: Any) -> dict[str, Any]:
    metrics = {k: v for k, v in dict(checkpoint.metrics).items() if v is not None}
    return {
        "object": "fine_tuning.job.checkpoint",
        "id": checkpoint.id,
        "created_at": unix(checkpoint.created_at),
        "fine_tuned_model_checkpoint": f"checkpoint:{checkpoint.id}",
        "fine_tuning_job_id": checkpoint.job_id,
        "step_number": checkpoint.step,
        "metrics": {"step": float(checkpoint.step), "train_loss": metrics.get("loss"), **metrics},
    }


def file_object(dataset: Any) -> dict[str, Any]:
    return {
        "object": "file",
        "id": file_id(dataset.id),
        "bytes": dataset.bytes,
        "created_at": unix(dataset.created_at),
        "filename": dataset.name,
        "purpose": "fine-tune",
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }
