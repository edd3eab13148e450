"""A multi-turn job spec (contract.spec): what it may combine with, refused at submission naming the reason."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from contract.spec import JobSpec


def spec(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "base_model": "builtin:tiny-tools",
        "train_dataset": "ds_1",
        "rewards": [{"type": "environment"}],
        "environment": {"environment_id": "env_1", "max_turns": 3},
        "hyperparameters": {"max_steps": 2},
    }
    return {**base, **changes}


def test_a_multi_turn_spec_validates_with_its_defaults() -> None:
    parsed = JobSpec.model_validate(spec())
    assert parsed.environment is not None
    assert (parsed.environment.max_turns, parsed.environment.reward, parsed.environment.max_sessions) == (3, "sum", None)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"environment": None}, "a reward of type 'environment' needs the job's environment"),
        ({"resources": {"devices": 2}, "hyperparameters": {"max_steps": 2, "prompts_per_step": 4}},
         "runs on one device"),
        ({"hyperparameters": {"max_steps": 2, "async_generation": True}}, "async_generation off"),
        ({"hyperparameters": {"max_steps": 2, "generation": "beam"}}, "generation 'sample'"),
        ({"eval_checkpoints": {"dataset": "ds_2"}}, "eval_checkpoints.rewards"),
        ({"environment": {"environment_id": "env_1", "max_turns": 0}}, "environment.max_turns"),
        ({"environment": {"environment_id": "env_1", "reward": "mean"}}, "environment.reward"),
    ],
)
def test_what_a_multi_turn_spec_cannot_combine_with_is_refused_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as raised:
        JobSpec.model_validate(spec(**changes))
    text = str(raised.value).replace("\n", " ")
    assert message in text or message.split(".")[-1] in text, text
