"""The reward interface every source implements: built-ins, reward models and remote endpoints.

Torch-free so that the worker's remote client and the service can share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RewardInput:
    """One completion to score."""

    prompt: str  # the prompt as rendered for the model (chat template applied)
    completion: str  # decoded with skip_special_tokens=True
    completion_ids: list[int]  # the sampled ids, never re-tokenised
    extras: dict[str, Any] = field(default_factory=dict)  # the dataset row's other columns
    group_id: int = 0  # index of the prompt within the step; completions of a group share it
    index: int = 0  # position of the completion within the step's batch
    # Multi-turn jobs: the episode's turns (role, text, tool calls and results; see worker.grpo.multi_turn) and
    # the environment's reward for it (None: the episode failed). `completion` is then the whole trajectory's text.
    turns: list[dict[str, Any]] | None = None
    environment_reward: float | None = None


class RewardError(Exception):
    """A reward source failed or answered something unusable. Fails the job (code says why)."""

    code = "reward_invalid_response"

    def __init__(self, source: str, message: str) -> None:
        super().__init__(f"reward source {source!r}: {message}")
        self.source = source
        self.reason = message


class RewardModelLoadFailed(RewardError):
    """A reward model that from_pretrained could not load (the detail stays in the worker's log)."""

    code = "model_load_failed"


class RewardTimedOut(RewardError):
    """A local source (a built-in rule) exceeded its time limit for one batch."""

    code = "reward_timeout"


class RewardUnavailable(RewardError):
    """The source stayed unreachable after retries: the job is paused, not failed."""

    code = "reward_endpoint_unavailable"


class RewardSource(Protocol):
    """An async scorer. Returns one value per item; None means the source abstains for that item."""

    name: str

    async def __call__(self, items: Sequence[RewardInput], *, step: int) -> list[float | None]: ...
