"""Asynchronous generation and vLLM server mode in a job spec: what the producer or the server could not honour
is refused with an error naming the fields, before a job exists."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from contract.spec import JobSpec


def _spec(resources: dict[str, Any] | None = None, **hyper: Any) -> JobSpec:
    return JobSpec.model_validate({
        "base_model": "builtin:tiny", "train_dataset": "ds_1",
        "rewards": [{"type": "builtin", "name": "exact_match"}],
        "hyperparameters": {"max_steps": 2, "prompts_per_step": 2, **hyper},
        **({"resources": resources} if resources else {}),
    })


@pytest.mark.parametrize(("hyper", "resources", "names"), [
    ({"async_generation": True, "max_staleness": 1, "weight_sync_steps": 3}, None, ["weight_sync_steps", "max_staleness"]),
    ({"async_generation": True, "max_inflight_tasks": 4}, None, ["max_inflight_tasks"]),  # one step is 16
    ({"async_generation": True, "dynamic_sampling": True}, None, ["dynamic_sampling"]),
    ({"async_generation": True}, {"devices": 2}, ["async_generation", "devices"]),
    ({"vllm_mode": "server"}, None, ["vllm_mode", "use_vllm"]),
    ({"use_vllm": True, "vllm_mode": "server"}, {"devices": 2}, ["vllm_mode", "devices"]),
])
def test_refused_with_the_fields_named(hyper: dict[str, Any], resources: dict[str, Any] | None, names: list[str]) -> None:
    with pytest.raises(ValidationError) as raised:
        _spec(resources, **hyper)
    assert all(name in str(raised.value) for name in names), str(raised.value)


def test_async_defaults_the_correction_to_per_token_unless_chosen() -> None:
    assert _spec(async_generation=True).hyperparameters.vllm_importance_sampling_mode == "token_truncate"
    chosen = _spec(async_generation=True, vllm_importance_sampling_mode="sequence_mask")
    assert chosen.hyperparameters.vllm_importance_sampling_mode == "sequence_mask"
    assert _spec().hyperparameters.vllm_importance_sampling_mode == "sequence_mask"
    assert _spec(async_generation=True, max_staleness=2).hyperparameters.steps_ahead == 2
