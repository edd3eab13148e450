"""The typed proto spec stays in step with the pydantic contract (contract/spec.py, config.py)."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel

from contract.config import GRPOConfig, LoraConfig
from contract.gen.grpo.v1 import job_spec_pb2
from contract.spec import (
    BUILTIN_PARAMS,
    CheckpointEvaluations,
    JobSpec,
    ModelRewardSpec,
    RemoteRewardSpec,
    Resources,
)
from service.grpc.convert import (
    BUILTIN_REWARDS,
    NONE_FLAGS,
    _enum_prefix,
    enum_to_str,
    job_spec_from_proto,
    job_spec_to_proto,
    str_to_enum,
)
from service.kit.errors import ValidationFailed
from worker.grpo.health import HealthConfig

PAIRS: list[tuple[type[BaseModel], type[typing.Any]]] = [
    (GRPOConfig, job_spec_pb2.Hyperparameters),
    (LoraConfig, job_spec_pb2.LoraConfig),
    (HealthConfig, job_spec_pb2.HealthConfig),
    (JobSpec, job_spec_pb2.JobSpec),
    (Resources, job_spec_pb2.Resources),
    (CheckpointEvaluations, job_spec_pb2.CheckpointEvaluations),
    (RemoteRewardSpec, job_spec_pb2.RemoteReward),
    (ModelRewardSpec, job_spec_pb2.ModelReward),
    *((BUILTIN_PARAMS[name], getattr(job_spec_pb2, f"{name.title().replace('_', '')}Reward")) for name in BUILTIN_REWARDS),
]


@pytest.mark.parametrize(("model", "message"), PAIRS, ids=lambda p: p.__name__)
def test_every_pydantic_field_has_a_proto_field(model: type[BaseModel], message: type[typing.Any]) -> None:
    proto_fields = set(message.DESCRIPTOR.fields_by_name)
    missing = set(model.model_fields) - proto_fields - {"type", "weight"}
    assert not missing, f"{message.__name__} lacks {sorted(missing)}: update proto/grpo/v1/job_spec.proto"


@pytest.mark.parametrize("name", [n for n, f in GRPOConfig.model_fields.items() if typing.get_origin(f.annotation) is typing.Literal])
def test_every_literal_value_has_an_enum_value(name: str) -> None:
    """Each Literal value maps to its own, specified enum value and back; the enum has no other values."""
    enum = job_spec_pb2.Hyperparameters.DESCRIPTOR.fields_by_name[name].enum_type
    values = typing.get_args(GRPOConfig.model_fields[name].annotation)
    numbers = {}
    for value in values:
        assert _enum_prefix(enum) + value.upper().replace("-", "_") in enum.values_by_name, (enum.name, value)
        numbers[value] = str_to_enum(enum, value)
        assert numbers[value] != 0, f"{value!r} maps to {enum.name}'s UNSPECIFIED"
        assert enum_to_str(enum, numbers[value]) == value
    assert len(set(numbers.values())) == len(values)
    assert sorted(numbers.values()) == sorted(v.number for v in enum.values if v.number != 0), (
        f"{enum.name} has values no {name} literal maps to"
    )


def _roundtrip(values: dict[str, typing.Any]) -> None:
    spec = JobSpec.model_validate(values)
    assert job_spec_from_proto(job_spec_to_proto(spec)) == spec


def test_roundtrip_health_settings_and_retain_dataset() -> None:
    _roundtrip(
        {
            "base_model": "builtin:tiny-instruct",
            "train_dataset": "ds_1",
            "eval_dataset": "ds_2",
            "retain_dataset": "ds_3",
            "rewards": [{"type": "builtin", "name": "exact_match"}],
            "hyperparameters": {"max_steps": 3, "on_unhealthy": "pause", "health": {"kl_max": 5.0, "patience": 2}},
        }
    )


def test_roundtrip_resources_and_parallelism() -> None:
    _roundtrip(
        {
            "base_model": "builtin:tiny",
            "train_dataset": "ds_1",
            "rewards": [{"type": "builtin", "name": "exact_match"}],
            "hyperparameters": {"max_steps": 3, "parallelism": "fsdp"},
            "resources": {"devices": 2, "nodes": 1},
        }
    )


@pytest.mark.parametrize("rewards", [None, [{"type": "remote", "reward_function_id": "rf_1", "weight": 0.5}]])
def test_roundtrip_eval_checkpoints(rewards: list[dict[str, typing.Any]] | None) -> None:
    """Omitted rewards stay omitted (the job's own), listed ones come back as listed; defaults are kept."""
    _roundtrip(
        {
            "base_model": "builtin:tiny",
            "train_dataset": "ds_1",
            "rewards": [{"type": "builtin", "name": "exact_match"}],
            "hyperparameters": {"max_steps": 3},
            "eval_checkpoints": {"dataset": "ds_2", "samples_per_item": 4, "rewards": rewards},
        }
    )


def test_a_bad_eval_checkpoints_reward_names_its_field() -> None:
    message = job_spec_to_proto(JobSpec.model_validate({
        "base_model": "builtin:tiny", "train_dataset": "ds_1", "rewards": [{"type": "builtin", "name": "exact_match"}],
        "hyperparameters": {"max_steps": 3}, "eval_checkpoints": {"dataset": "ds_2"},
    }))
    message.eval_checkpoints.rewards.add()  # no source set
    with pytest.raises(ValidationFailed) as refused:
        job_spec_from_proto(message)
    assert refused.value.details[0]["field"] == "spec.eval_checkpoints.rewards[0]"


def test_roundtrip_example() -> None:
    _roundtrip(JobSpec.model_config["json_schema_extra"]["examples"][0])  # type: ignore[index]


def test_roundtrip_nones_and_lists() -> None:
    _roundtrip(
        {
            "base_model": "builtin:tiny",
            "train_dataset": "ds_1",
            "eval_dataset": "ds_2",
            "rewards": [
                {"type": "builtin", "name": "regex_match", "params": {"pattern": "^a+$", "fullmatch": True}},
                {"type": "builtin", "name": "length_penalty", "params": {"unit": "chars"}, "weight": -0.5},
                {"type": "model", "model": "org/rm"},
            ],
            "hyperparameters": {
                "num_epochs": 1.5, "max_grad_norm": None, "max_prompt_length": None, "save_total_limit": None,
                "loss_type": "dr_grpo", "dtype": "bfloat16", "epsilon_high": 0.28,
                "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
            },
            "metadata": {"team": "rl"},
        }
    )
    message = job_spec_to_proto(JobSpec.model_validate({
        "base_model": "builtin:tiny", "train_dataset": "d", "rewards": [{"type": "builtin", "name": "exact_match"}],
        "hyperparameters": {"max_steps": 1, "max_grad_norm": None},
    }))
    assert message.hyperparameters.disable_grad_clipping and not message.hyperparameters.HasField("max_grad_norm")


def test_unset_fields_take_the_pydantic_defaults() -> None:
    message = job_spec_pb2.JobSpec(
        base_model="builtin:tiny", train_dataset="d",
        rewards=[job_spec_pb2.RewardSpec(boxed_answer=job_spec_pb2.BoxedAnswerReward())],
        hyperparameters=job_spec_pb2.Hyperparameters(max_steps=3),
    )
    spec = job_spec_from_proto(message)
    assert spec.hyperparameters == GRPOConfig(max_steps=3)
    assert spec.rewards[0].weight == 1.0 and spec.rewards[0].params["format_reward"] == 0.5  # type: ignore[union-attr]


@pytest.mark.parametrize("flag", sorted(NONE_FLAGS))
def test_flag_and_value_together_is_an_error(flag: str) -> None:
    hyper = job_spec_pb2.Hyperparameters(max_steps=3, **{flag: True, NONE_FLAGS[flag]: 1})
    message = job_spec_pb2.JobSpec(
        base_model="builtin:tiny", train_dataset="d",
        rewards=[job_spec_pb2.RewardSpec(exact_match=job_spec_pb2.ExactMatchReward())], hyperparameters=hyper,
    )
    with pytest.raises(ValidationFailed) as err:
        job_spec_from_proto(message)
    assert err.value.details[0]["field"] == f"spec.hyperparameters.{flag}"


def test_missing_hyperparameters_names_the_field() -> None:
    message = job_spec_pb2.JobSpec(
        base_model="builtin:tiny", train_dataset="d",
        rewards=[job_spec_pb2.RewardSpec(exact_match=job_spec_pb2.ExactMatchReward())],
    )
    with pytest.raises(ValidationFailed) as err:
        job_spec_from_proto(message)
    assert err.value.details[0]["field"] == "spec.hyperparameters"


def test_roundtrip_loss_options() -> None:
    _roundtrip(
        {
            "base_model": "builtin:tiny",
            "train_dataset": "d",
            "rewards": [{"type": "builtin", "name": "exact_match"}, {"type": "builtin", "name": "length_penalty"}],
            "hyperparameters": {
                "max_steps": 1, "loss_type": "luspo", "importance_sampling_level": "sequence", "delta": 2.5,
                "off_policy_mask_threshold": 0.5, "top_entropy_quantile": 0.2, "entropy_coef": 0.01,
                "use_adaptive_entropy": True, "entropy_target": 1.5, "entropy_coef_max": 0.1,
                "multi_objective_aggregation": "normalize_then_sum", "beta": 0.04, "use_bias_correction_kl": False,
            },
        }
    )
    _roundtrip(
        {
            "base_model": "builtin:tiny", "train_dataset": "d", "rewards": [{"type": "builtin", "name": "exact_match"}],
            "hyperparameters": {"max_steps": 1, "loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_neg": 0.5},
        }
    )


def test_inconsistent_loss_options_are_invalid_argument() -> None:
    message = job_spec_pb2.JobSpec(
        base_model="builtin:tiny", train_dataset="d",
        rewards=[job_spec_pb2.RewardSpec(exact_match=job_spec_pb2.ExactMatchReward())],
        hyperparameters=job_spec_pb2.Hyperparameters(
            max_steps=3, loss_type=job_spec_pb2.LOSS_TYPE_DAPO,
            importance_sampling_level=job_spec_pb2.IMPORTANCE_SAMPLING_LEVEL_SEQUENCE,
        ),
    )
    with pytest.raises(ValidationFailed) as err:
        job_spec_from_proto(message)
    assert err.value.details[0]["field"] == "spec.hyperparameters"
    assert "importance_sampling_level 'sequence' needs loss_type" in err.value.message


@pytest.mark.parametrize("clip_max", [None, 2.0])
def test_roundtrip_vllm_options(clip_max: float | None) -> None:
    _roundtrip(
        {
            "base_model": "builtin:tiny", "train_dataset": "d", "rewards": [{"type": "builtin", "name": "exact_match"}],
            "hyperparameters": {
                "max_steps": 1, "use_vllm": True, "vllm_gpu_memory_utilization": 0.5, "vllm_enable_sleep_mode": True,
                "vllm_max_model_length": 2048, "vllm_importance_sampling_correction": False,
                "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5,
                "vllm_importance_sampling_clip_max": clip_max,
            },
        }
    )
