"""What a job spec refers to must exist and be the caller's: checked once the spec itself is valid
(contract.spec) and before anything is written, when a job is created or estimated.

One pass down, each reference resolved once by the domain that owns it:

1. `Named.of`: what the spec names, read off it once (datasets by field, reward function ids, the graders,
   models by field);
2. datasets (service.datasets.service): the tenant's and not deleted; the steps num_epochs makes fit the jobs'
   step counter; every row has the fields a grader reads as ``{{item.*}}``;
3. reward functions (service.rewards.service) and the environment (service.environments.service): the tenant's
   and not deleted;
4. models (service.jobs.model_sources): accepted sources, and a `checkpoint:<id>` one of the tenant's
   checkpoints (service.checkpoints.repository).

ValidationFailed (422) names every offending field, e.g. `rewards[1].reward_function_id`, in the order: missing
datasets and num_epochs, reward functions, the graders' fields, models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from contract.fields import INT32_MAX
from contract.graders import Grader
from contract.spec import GraderRewardSpec, JobSpec, ModelRewardSpec, reward_function_refs
from service.checkpoints import repository as checkpoints_repository
from service.datasets import service as datasets
from service.datasets.models import Dataset
from service.environments import service as environments
from service.jobs import model_sources
from service.jobs.model_sources import ModelSourceKind, ModelSourcePolicy, ModelSourceRefused
from service.kit.config import get_settings
from service.kit.errors import ValidationFailed
from service.rewards import service as rewards

Error = dict[str, Any]
# The datasets a grader's fields are checked in (not retain_dataset: graders never score it).
_GRADED = ("train_dataset", "eval_dataset")


@dataclass(frozen=True)
class Named:
    """What a spec refers to."""

    datasets: dict[str, str]  # field -> dataset id, for the fields that are set
    reward_functions: list[tuple[str, str]]  # (field, reward function id): remote rewards, score_model graders
    graders: list[tuple[int, Grader]]  # (index in rewards, the parsed grader)
    models: dict[str, str]  # field -> model source: base_model, then every reward model

    @classmethod
    def of(cls, spec: JobSpec) -> Named:
        plan = spec.eval_checkpoints
        datasets = {
            "train_dataset": spec.train_dataset,
            "eval_dataset": spec.eval_dataset,
            "retain_dataset": spec.retain_dataset,
            "eval_checkpoints.dataset": plan.dataset if plan is not None else None,
        }
        models = {"base_model": spec.base_model}
        models.update(
            {f"rewards[{i}].model": r.model for i, r in enumerate(spec.rewards) if isinstance(r, ModelRewardSpec)}
        )
        reward_functions = reward_function_refs(spec.rewards)
        if plan is not None and plan.rewards is not None:
            # The checkpoints' evaluations call these when they run: checked now, not at each checkpoint.
            models.update({f"eval_checkpoints.rewards[{i}].model": r.model for i, r in enumerate(plan.rewards)
                           if isinstance(r, ModelRewardSpec)})
            reward_functions += [(f"eval_checkpoints.{field}", rf_id)
                                 for field, rf_id in reward_function_refs(plan.rewards)]
        return cls(
            datasets={field: dataset_id for field, dataset_id in datasets.items() if dataset_id is not None},
            reward_functions=reward_functions,
            graders=[(i, r.parsed) for i, r in enumerate(spec.rewards) if isinstance(r, GraderRewardSpec)],
            models=models,
        )


@dataclass(frozen=True)
class Resolved:
    """The references of a spec that passed: the tenant's live datasets it names, by id."""

    datasets: dict[str, Dataset]


def check_references(
    session: Session, tenant_id: str, spec: JobSpec, *, fields: Mapping[str, str] | None = None
) -> Resolved:
    """Raises ValidationFailed naming every offending field (see the module docstring). `fields` renames the
    job spec's top-level fields for a spec that calls them otherwise (an evaluation's `model`, `dataset`)."""
    named = Named.of(spec)
    found = datasets.live_datasets(session, tenant_id, list(named.datasets.values()))
    errors = _dataset_errors(spec, named, found)
    errors += _reward_function_errors(session, tenant_id, named)
    errors += _environment_errors(session, tenant_id, spec)
    errors += _grader_field_errors(named, found)
    errors += _model_errors(session, tenant_id, named)
    for error in errors:
        error["field"] = (fields or {}).get(error["field"], error["field"])
    if errors:
        raise ValidationFailed(f"{errors[0]['field']}: {errors[0]['message']}", details=errors)
    return Resolved(found)


def _dataset_errors(spec: JobSpec, named: Named, found: dict[str, Dataset]) -> list[Error]:
    errors = [
        _missing(field, f"dataset {dataset_id!r} not found")
        for field, dataset_id in named.datasets.items()
        if dataset_id not in found
    ]
    config = spec.hyperparameters
    train = found.get(spec.train_dataset)
    # The steps column is an INTEGER; float arithmetic, since a huge num_epochs overflows int().
    if config.num_epochs is not None and config.max_steps is None and train is not None:
        if config.num_epochs * train.num_rows / config.prompts_per_step > INT32_MAX:
            errors.append({
                "field": "hyperparameters.num_epochs",
                "message": f"{config.num_epochs} epochs of {train.num_rows} prompts make more than {INT32_MAX} steps",
                "type": "value_error",
            })
    return errors


def _reward_function_errors(session: Session, tenant_id: str, named: Named) -> list[Error]:
    found = rewards.live_reward_function_ids(session, tenant_id, [rf_id for _, rf_id in named.reward_functions])
    return [
        _missing(field, f"reward function {rf_id!r} not found")
        for field, rf_id in named.reward_functions
        if rf_id not in found
    ]


def _environment_errors(session: Session, tenant_id: str, spec: JobSpec) -> list[Error]:
    if spec.environment is None:
        return []
    env_id = spec.environment.environment_id
    if environments.is_live(session, tenant_id, env_id):
        return []
    return [_missing("environment.environment_id", f"environment {env_id!r} not found")]


def _grader_field_errors(named: Named, found: dict[str, Dataset]) -> list[Error]:
    """A grader's ``{{item.*}}`` references must be in every row of the datasets it grades."""
    errors: list[Error] = []
    for index, grader in named.graders:
        for field in _GRADED:
            dataset = found.get(named.datasets.get(field, ""))
            if dataset is None:
                continue
            missing = datasets.first_row_missing(dataset, grader)
            if missing is not None:
                line, what = missing
                errors.append({
                    "field": field,
                    "message": f"line {line} of dataset {dataset.id!r} has no field {what.at!r}, which "
                    f"rewards[{index}].grader reads as {what.reference}",
                    "type": "grader_field_missing",
                    "line": line,
                })
    return errors


def _model_errors(session: Session, tenant_id: str, named: Named) -> list[Error]:
    errors: list[Error] = []
    policy = ModelSourcePolicy.from_settings(get_settings())
    for field, value in named.models.items():
        try:
            source = model_sources.classify(value, policy)
        except ModelSourceRefused as exc:
            errors.append({"field": field, "message": str(exc), "type": "model_source_refused"})
            continue
        # Another tenant's checkpoint reads exactly like an unknown id: no existence oracle.
        if source.kind is ModelSourceKind.checkpoint and not checkpoints_repository.tenant_has_checkpoint(
            session, tenant_id, source.value
        ):
            errors.append(_missing(field, f"checkpoint {source.value!r} not found"))
    return errors


def _missing(field: str, message: str) -> Error:
    return {"field": field, "message": message, "type": "not_found"}
