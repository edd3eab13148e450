"""Converters between grpo.v1 messages and the pydantic schemas of the REST API (the one place they meet).

Inbound: the typed JobSpec and EvaluationSpec messages become the plain dicts that `contract.spec.JobSpec` and
`contract.evaluation.EvaluationSpec` validate, so gRPC and REST run the very same validation (and report the same
field paths, prefixed with "spec.").
Only fields the client set are passed on (proto3 `optional` presence, enum `*_UNSPECIFIED`), so the
pydantic defaults stay the single source of defaults.

Outbound: REST's response models (`JobOut`, `DatasetOut`, ...) become messages, so both transports render
the same domain rows the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from google.protobuf import struct_pb2, timestamp_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from pydantic import ValidationError

from contract.api.checkpoints import CheckpointOut
from contract.api.datasets import DatasetOut
from contract.api.environments import EnvironmentOut
from contract.api.evaluations import (
    ComparisonOut,
    EvaluationItemOut,
    EvaluationOut,
    EvaluationResults,
    Interval,
)
from contract.api.jobs import EpisodeOut, EventOut, JobOut, SampleOut
from contract.api.rewards import RewardFunctionOut, RewardTestResult
from contract.evaluation import EvaluationSpec
from contract.gen.grpo.v1 import (
    checkpoints_pb2,
    common_pb2,
    datasets_pb2,
    environments_pb2,
    evaluations_pb2,
    job_spec_pb2,
    jobs_pb2,
    reward_functions_pb2,
    reward_pb2,
)
from contract.spec import JobSpec
from service.environments.schemas import EnvironmentCreate
from service.grpc.errors import from_validation_error
from service.jobs.states import JobStatus
from service.kit.errors import ValidationFailed
from service.rewards.schemas import RewardFunctionCreate, RewardTestItem, RewardTestRequest

# Hyperparameters whose `None` means something other than "default": proto flag -> GRPOConfig field.
NONE_FLAGS = {
    "disable_grad_clipping": "max_grad_norm",
    "unlimited_prompt_length": "max_prompt_length",
    "keep_all_checkpoints": "save_total_limit",
    "vllm_importance_sampling_no_clip_max": "vllm_importance_sampling_clip_max",
    "no_sync_check": "sync_check_every",
}
ALL_LINEAR = "all-linear"
BUILTIN_REWARDS = ("boxed_answer", "exact_match", "regex_match", "length_penalty")


# --- enums -------------------------------------------------------------------------------------------


# Enum descriptors are typed `Any`: the upb and pure-Python descriptor classes are distinct types to mypy.
def _enum_prefix(enum: Any) -> str:
    """Buf's value prefix of an enum: "LossType" -> "LOSS_TYPE_"."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", enum.name).upper() + "_"


def enum_to_str(enum: Any, number: int) -> str:
    """LOSS_TYPE_DR_GRPO -> "dr_grpo" (the Literal value of the pydantic model)."""
    return enum.values_by_number[number].name.removeprefix(_enum_prefix(enum)).lower()


def str_to_enum(enum: Any, value: str) -> int:
    """"dr_grpo" -> LOSS_TYPE_DR_GRPO's number."""
    return enum.values_by_name[_enum_prefix(enum) + value.upper().replace("-", "_")].number


# --- generic message <-> dict -----------------------------------------------------------------------


def _set_fields(message: Message) -> dict[str, Any]:
    """The fields the client set, as plain values (enums as their pydantic strings, maps as dicts)."""
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE and field.is_repeated:
            out[field.name] = [_set_fields(item) for item in value]
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            out[field.name] = _set_fields(value)
        elif field.enum_type is not None:
            out[field.name] = enum_to_str(field.enum_type, value)
        elif field.is_repeated:
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def _fill(message: Message, values: Mapping[str, Any]) -> None:
    """Set `message` fields from a pydantic dump; None values and unknown keys are left out."""
    descriptor = message.DESCRIPTOR
    for name, value in values.items():
        field = descriptor.fields_by_name.get(name)
        if field is None or value is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            getattr(message, name).update(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE and field.is_repeated:
            for item in value:
                _fill(getattr(message, name).add(), item)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            _fill(getattr(message, name), value)
        elif field.enum_type is not None:
            setattr(message, name, str_to_enum(field.enum_type, value))
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)


# --- job spec ----------------------------------------------------------------------------------------


def _lora_in(values: dict[str, Any]) -> dict[str, Any]:
    modules = values.pop("target_modules", None)
    if modules and modules != [ALL_LINEAR]:
        values["target_modules"] = modules
    return values


def _hyperparameters_in(message: job_spec_pb2.Hyperparameters) -> dict[str, Any]:
    values = _set_fields(message)
    for flag, field in NONE_FLAGS.items():
        if values.pop(flag, False):
            if field in values:
                raise ValidationFailed(
                    f"spec.hyperparameters.{flag}: set either {flag} or {field}, not both",
                    details=[{"field": f"spec.hyperparameters.{flag}", "message": f"conflicts with {field}"}],
                )
            values[field] = None
    if "lora" in values:
        values["lora"] = _lora_in(values["lora"])
    return values


def _reward_in(index: int, message: job_spec_pb2.RewardSpec, where: str = "spec.rewards") -> dict[str, Any]:
    source = message.WhichOneof("source")
    if source is None:
        field = f"{where}[{index}]"
        raise ValidationFailed(
            f"{field}: set one reward source ({', '.join(BUILTIN_REWARDS)}, remote or model)",
            details=[{"field": field, "message": "no reward source set"}],
        )
    values = _set_fields(getattr(message, source))
    reward: dict[str, Any]
    if source == "grader":
        reward = {"type": "grader", "grader": _grader_json(f"{where}[{index}].grader.json", message.grader.json)}
    elif source in BUILTIN_REWARDS:
        reward = {"type": "builtin", "name": source, "params": values}
    else:
        reward = {"type": source, **values}
    if message.HasField("weight"):
        reward["weight"] = message.weight
    return reward


def _grader_json(field: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValidationFailed(
            f"{field}: not valid JSON ({exc})", details=[{"field": field, "message": "not valid JSON"}]
        ) from exc


def job_spec_from_proto(message: job_spec_pb2.JobSpec) -> JobSpec:
    """Validate a JobSpec message with the shared pydantic model. Errors name fields as "spec.<path>"."""
    values = _set_fields(message)
    values["rewards"] = [_reward_in(i, r) for i, r in enumerate(message.rewards)]
    if message.HasField("hyperparameters"):
        values["hyperparameters"] = _hyperparameters_in(message.hyperparameters)
    if message.HasField("lora"):
        values["lora"] = _lora_in(values["lora"])
    if message.HasField("eval_checkpoints"):
        plan = message.eval_checkpoints
        values["eval_checkpoints"]["rewards"] = [
            _reward_in(i, r, "spec.eval_checkpoints.rewards") for i, r in enumerate(plan.rewards)
        ] or None  # none listed: the job's own
    try:
        return JobSpec.model_validate(values)
    except ValidationError as exc:
        raise from_validation_error(exc, prefix="spec") from exc


def job_spec_to_proto(spec: JobSpec) -> job_spec_pb2.JobSpec:
    """The validated spec (defaults filled in) as a message."""
    dumped = spec.model_dump(mode="json")
    message = job_spec_pb2.JobSpec()
    _fill(message, {k: v for k, v in dumped.items()
                    if k not in ("rewards", "hyperparameters", "lora", "eval_checkpoints")})
    hyper = dumped["hyperparameters"]
    for flag, field in NONE_FLAGS.items():
        setattr(message.hyperparameters, flag, hyper[field] is None)
    _fill(message.hyperparameters, {k: v for k, v in hyper.items() if k != "lora"})
    if hyper["lora"] is not None:
        _lora_out(message.hyperparameters.lora, hyper["lora"])
    if dumped["lora"] is not None:
        _lora_out(message.lora, dumped["lora"])
    _rewards_out(message.rewards, dumped["rewards"])
    plan = dumped["eval_checkpoints"]
    if plan is not None:
        _fill(message.eval_checkpoints, {k: v for k, v in plan.items() if k != "rewards"})
        _rewards_out(message.eval_checkpoints.rewards, plan["rewards"] or [])
    return message


def _rewards_out(rewards: Any, dumped: list[dict[str, Any]]) -> None:
    """Append the dumped reward sources to a repeated RewardSpec field."""
    for reward in dumped:
        out = rewards.add(weight=reward["weight"])
        if reward["type"] == "builtin":
            _fill(getattr(out, reward["name"]), reward["params"])
        elif reward["type"] == "grader":
            out.grader.json = json.dumps(reward["grader"], ensure_ascii=False)
        else:
            source = getattr(out, reward["type"])
            source.SetInParent()  # a source without fields (environment) is set by being present
            _fill(source, {k: v for k, v in reward.items() if k not in ("type", "weight")})


def _lora_out(message: job_spec_pb2.LoraConfig, values: dict[str, Any]) -> None:
    modules = values["target_modules"]
    _fill(message, {**values, "target_modules": [] if modules == ALL_LINEAR else modules})


# --- outbound: jobs ----------------------------------------------------------------------------------


def timestamp(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    message = timestamp_pb2.Timestamp()
    message.FromDatetime(value)
    return message


def _finite_values(values: Mapping[str, float | None]) -> dict[str, float]:
    return {name: value for name, value in values.items() if value is not None}


def job_state(status: JobStatus) -> jobs_pb2.JobState.ValueType:
    return jobs_pb2.JobState.Value(f"JOB_STATE_{status.value.upper()}")


def job_status(state: jobs_pb2.JobState.ValueType) -> JobStatus | None:
    """The REST status filter for a JobState (None for UNSPECIFIED = every state)."""
    if state == jobs_pb2.JOB_STATE_UNSPECIFIED:
        return None
    return JobStatus(enum_to_str(jobs_pb2.JobState.DESCRIPTOR, state))


def job_to_proto(job: JobOut) -> jobs_pb2.Job:
    message = jobs_pb2.Job(
        id=job.id,
        spec=job_spec_to_proto(job.spec),
        state=job_state(job.status),
        current_step=job.progress.step,
        total_steps=job.progress.total_steps,
        attempt=job.attempt,
        max_attempts=job.max_attempts,
        queue=job.queue,
        error_code=job.error.code if job.error else "",
        error_message=job.error.message if job.error else "",
        created_at=timestamp(job.created_at),
        started_at=timestamp(job.started_at),
        finished_at=timestamp(job.finished_at),
        resume_checkpoint_id=job.resume_checkpoint_id,
        pause_requested=job.pause_requested,
        latest_metrics=_finite_values(job.metrics),
        updated_at=timestamp(job.updated_at),
    )
    return message


def event_to_proto(event: EventOut) -> jobs_pb2.JobEvent:
    data = struct_pb2.Struct()
    data.update(event.data)
    return jobs_pb2.JobEvent(
        id=event.id,
        job_id=event.job_id,
        type=event.type,
        message=event.message,
        data=data,
        created_at=timestamp(event.created_at),
        attempt=event.attempt,
        step=event.step,
        superseded=event.superseded,
    )


def sample_to_proto(sample: SampleOut) -> jobs_pb2.JobSample:
    return jobs_pb2.JobSample(
        id=sample.id,
        step=sample.step,
        prompt=sample.prompt,
        completion=sample.completion,
        reward=sample.reward,
        rewards=_finite_values(sample.rewards),
        created_at=timestamp(sample.created_at),
        policy_version=sample.policy_version,
        episode=None if sample.episode is None else _episode_out(sample.episode),
    )


def _episode_out(episode: EpisodeOut) -> jobs_pb2.Episode:
    turns = [
        jobs_pb2.Turn(
            role=turn.role, text=turn.text, tokens=turn.tokens, masked=turn.masked, name=turn.name,
            error=turn.error, reward=turn.reward,
            tool_calls=[jobs_pb2.ToolCall(name=c.name, arguments_json=json.dumps(c.arguments)) for c in turn.tool_calls],
        )
        for turn in episode.turns
    ]
    return jobs_pb2.Episode(turns=turns, error=episode.error, reward=episode.reward, reward_mode=episode.reward_mode)


def metrics_by_step(series: Mapping[str, tuple[list[int], list[float]]]) -> list[jobs_pb2.StepMetrics]:
    """Per-name series (REST's shape) regrouped per step, in increasing step order."""
    steps: dict[int, dict[str, float]] = {}
    for name, (step_list, values) in series.items():
        for step, value in zip(step_list, values, strict=True):
            steps.setdefault(step, {})[name] = value
    return [jobs_pb2.StepMetrics(step=step, values=steps[step]) for step in sorted(steps)]


# --- outbound: datasets, checkpoints -----------------------------------------------------------------


def dataset_to_proto(dataset: DatasetOut) -> datasets_pb2.Dataset:
    return datasets_pb2.Dataset(
        id=dataset.id,
        name=dataset.name,
        num_rows=dataset.num_rows,
        size_bytes=dataset.bytes,
        sha256=dataset.sha256,
        columns=dataset.columns,
        created_at=timestamp(dataset.created_at),
    )


def checkpoint_to_proto(checkpoint: CheckpointOut) -> checkpoints_pb2.Checkpoint:
    return checkpoints_pb2.Checkpoint(
        id=checkpoint.id,
        job_id=checkpoint.job_id or "",
        tinker_path=checkpoint.tinker_path or "",
        step=checkpoint.step,
        files=[common_pb2.FileInfo(path=f.path, size_bytes=f.size, sha256=f.sha256) for f in checkpoint.files],
        metrics=_finite_values(checkpoint.metrics),
        created_at=timestamp(checkpoint.created_at),
        total_bytes=checkpoint.total_bytes,
    )


# --- evaluations -------------------------------------------------------------------------------------


def evaluation_spec_from_proto(message: evaluations_pb2.EvaluationSpec) -> EvaluationSpec:
    """Validate an EvaluationSpec message with the shared pydantic model (the REST body's). Errors name fields as
    "spec.<path>", like a JobSpec's."""
    values = _set_fields(message)
    values["rewards"] = [_reward_in(i, r) for i, r in enumerate(message.rewards)]
    try:
        return EvaluationSpec.model_validate(values)
    except ValidationError as exc:
        raise from_validation_error(exc, prefix="spec") from exc


def evaluation_spec_to_proto(spec: EvaluationSpec) -> evaluations_pb2.EvaluationSpec:
    """The validated spec (defaults filled in) as a message."""
    dumped = spec.model_dump(mode="json")
    message = evaluations_pb2.EvaluationSpec()
    _fill(message, {k: v for k, v in dumped.items() if k != "rewards"})
    _rewards_out(message.rewards, dumped["rewards"])
    return message


def _interval(interval: Interval | None) -> evaluations_pb2.ConfidenceInterval | None:
    return None if interval is None else evaluations_pb2.ConfidenceInterval(low=interval.low, high=interval.high)


def _results_to_proto(results: EvaluationResults) -> evaluations_pb2.EvaluationResults:
    return evaluations_pb2.EvaluationResults(
        items=results.items,
        samples=results.samples,
        abstained=results.abstained,
        mean_reward=results.mean_reward,
        mean_reward_interval=_interval(results.mean_reward_interval),
        binary=results.binary,
        accuracy=results.accuracy,
        accuracy_interval=_interval(results.accuracy_interval),
        k=results.k,
        pass_at_k=results.pass_at_k,
        pass_at_k_interval=_interval(results.pass_at_k_interval),
        tokens_generated=results.tokens_generated,
        device_seconds=results.device_seconds,
    )


def evaluation_to_proto(evaluation: EvaluationOut) -> evaluations_pb2.Evaluation:
    return evaluations_pb2.Evaluation(
        id=evaluation.id,
        name=evaluation.name,
        state=job_state(evaluation.status),
        model=evaluation.model,
        dataset=evaluation.dataset,
        samples_per_item=evaluation.samples_per_item,
        progress=evaluations_pb2.EvaluationProgress(
            items_done=evaluation.progress.items_done, items_total=evaluation.progress.items_total
        ),
        results=None if evaluation.results is None else _results_to_proto(evaluation.results),
        error_code=evaluation.error.code if evaluation.error else "",
        error_message=evaluation.error.message if evaluation.error else "",
        attempt=evaluation.attempt,
        spec=evaluation_spec_to_proto(evaluation.spec),
        metadata=evaluation.metadata,
        created_at=timestamp(evaluation.created_at),
        started_at=timestamp(evaluation.started_at),
        finished_at=timestamp(evaluation.finished_at),
    )


def evaluation_item_to_proto(item: EvaluationItemOut) -> evaluations_pb2.EvaluationItem:
    return evaluations_pb2.EvaluationItem(
        index=item.index,
        prompt=item.prompt,
        completions=item.completions,
        rewards=[reward_pb2.Reward() if r is None else reward_pb2.Reward(value=r) for r in item.rewards],
        sources=[evaluations_pb2.SourceRewards(values=_finite_values(s)) for s in item.sources],
        score=item.score,
    )


def comparison_to_proto(comparison: ComparisonOut) -> evaluations_pb2.EvaluationComparison:
    return evaluations_pb2.EvaluationComparison(
        evaluation_a=comparison.evaluation_a,
        evaluation_b=comparison.evaluation_b,
        metric=evaluations_pb2.ComparisonMetric.Value(f"COMPARISON_METRIC_{comparison.metric.upper()}"),
        items=comparison.items,
        mean_a=comparison.mean_a,
        mean_b=comparison.mean_b,
        difference=comparison.difference,
        interval=_interval(comparison.interval),
        test=evaluations_pb2.ComparisonTest.Value(f"COMPARISON_TEST_{comparison.test.upper()}"),
        p_value=comparison.p_value,
        b_better=comparison.b_better,
        a_better=comparison.a_better,
        flipped=[
            evaluations_pb2.FlippedItem(index=f.index, prompt=f.prompt, score_a=f.score_a, score_b=f.score_b)
            for f in comparison.flipped
        ],
    )


# --- reward functions --------------------------------------------------------------------------------


def reward_function_create_from_proto(message: reward_functions_pb2.RegisterRewardFunctionRequest) -> RewardFunctionCreate:
    """The REST create body from the request (only the fields the client set); errors name the field."""
    try:
        return RewardFunctionCreate.model_validate(_set_fields(message))
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def reward_function_to_proto(row: RewardFunctionOut) -> reward_functions_pb2.RewardFunction:
    return reward_functions_pb2.RewardFunction(
        id=row.id,
        name=row.name,
        url=row.url,
        timeout_s=row.timeout_s,
        max_batch_size=row.max_batch_size,
        max_concurrency=row.max_concurrency,
        headers=row.headers,
        created_at=timestamp(row.created_at),
        updated_at=timestamp(row.updated_at),
        previous_secret_expires_at=timestamp(row.previous_secret_expires_at),
        max_attempts=row.max_attempts,
        backoff_s=row.backoff_s,
        breaker_threshold=row.breaker_threshold,
        step_deadline_s=row.step_deadline_s,
        max_abstain_fraction=row.max_abstain_fraction,
    )


def environment_create_from_proto(message: environments_pb2.RegisterEnvironmentRequest) -> EnvironmentCreate:
    """The REST create body from the request (only the fields the client set); errors name the field."""
    try:
        return EnvironmentCreate.model_validate(_set_fields(message))
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _struct(value: dict[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


def environment_to_proto(row: EnvironmentOut) -> environments_pb2.Environment:
    return environments_pb2.Environment(
        id=row.id, name=row.name, url=row.url, max_concurrency=row.max_concurrency,
        step_timeout_s=row.step_timeout_s, episode_timeout_s=row.episode_timeout_s, max_attempts=row.max_attempts,
        backoff_s=row.backoff_s, breaker_threshold=row.breaker_threshold, headers=row.headers,
        health_status=row.health.status, health_latency_ms=row.health.latency_ms,
        session_status=row.health.session_status,
        checked_at=timestamp(row.health.checked_at), action_schema=_struct(row.schemas.action),
        observation_schema=_struct(row.schemas.observation), state_schema=_struct(row.schemas.state),
        created_at=timestamp(row.created_at), updated_at=timestamp(row.updated_at),
        previous_secret_expires_at=timestamp(row.previous_secret_expires_at),
    )


def reward_test_items_from_proto(message: reward_functions_pb2.TestRewardFunctionRequest) -> list[RewardTestItem]:
    """The REST dry-run items from the samples; metadata values are JSON-decoded; errors name the field."""
    items: list[dict[str, Any]] = []
    for index, sample in enumerate(message.samples):
        metadata: dict[str, Any] = {}
        for key, raw in sample.metadata_json.items():
            try:
                metadata[key] = json.loads(raw)
            except ValueError as exc:
                field = f"samples.{index}.metadata_json.{key}"
                raise ValidationFailed(
                    f"{field}: not valid JSON ({exc})", details=[{"field": field, "message": str(exc)}]
                ) from exc
        items.append(
            {"prompt": sample.prompt, "completion": sample.completion, "metadata": metadata, "group_id": sample.group_id}
        )
    try:
        return RewardTestRequest.model_validate({"items": items}).items
    except ValidationError as exc:
        raise _as_samples(from_validation_error(exc)) from exc


def _as_samples(exc: ValidationFailed) -> ValidationFailed:
    """REST calls the list `items`, the RPC `samples`: name the RPC's field in the error."""
    details = [
        {**d, "field": "samples" + str(d["field"]).removeprefix("items")} if isinstance(d, dict) else d
        for d in (exc.details or [])
    ]
    return ValidationFailed("samples" + exc.message.removeprefix("items"), details=details)


def reward_test_result_to_proto(result: RewardTestResult) -> reward_functions_pb2.TestRewardFunctionResponse:
    return reward_functions_pb2.TestRewardFunctionResponse(
        latency_ms=result.latency_ms,
        rewards=[reward_pb2.Reward() if r is None else reward_pb2.Reward(value=r) for r in result.rewards],
    )
