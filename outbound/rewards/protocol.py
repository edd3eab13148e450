"""The wire protocol users implement: request and response models, encoding and strict response parsing.

Request:  ``{"job_id", "step", "items": [{"id", "prompt", "completion", "metadata", "group_id", "turns"?}]}``
(``turns``: multi-turn jobs only, the episode's turns)
Response: ``{"rewards": [number | null, ...]}`` of the same length as ``items`` (null = abstain).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# Strict: a bool or a numeric string is not a reward; NaN and infinities are refused.
Reward = Annotated[float, Field(strict=True, allow_inf_nan=False)] | None


class RewardItem(BaseModel):
    """One completion to score."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=128, description="Unique within the request.")
    prompt: str
    completion: str
    metadata: dict[str, Any] = Field(default_factory=dict, description="The dataset row's other columns.")
    group_id: int = Field(0, ge=0, description="Completions of the same prompt share a group id.")
    turns: list[dict[str, Any]] | None = Field(
        None, description="Multi-turn jobs: the episode's turns (docs/environments.md); left out for single turns."
    )


class RewardRequest(BaseModel):
    """The body the worker POSTs to a reward endpoint."""

    model_config = ConfigDict(extra="forbid")
    job_id: str
    step: int = Field(ge=0)
    items: list[RewardItem] = Field(min_length=1)


class RewardResponse(BaseModel):
    """What the endpoint must answer. Extra keys are ignored so servers can add diagnostics."""

    model_config = ConfigDict(extra="ignore")
    rewards: list[Reward]


def encode_request(request: RewardRequest) -> bytes:
    """Compact UTF-8 JSON; these exact bytes are signed and sent. `turns` is left out of single-turn items, whose
    body is as it always was."""
    body = request.model_dump(mode="json")
    for item in body["items"]:
        if item["turns"] is None:
            del item["turns"]
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def encode_response(rewards: list[float | None]) -> bytes:
    """The response body for `rewards` (refuses NaN/inf so a server cannot emit an invalid answer)."""
    return json.dumps(RewardResponse(rewards=rewards).model_dump(mode="json"), allow_nan=False).encode()


class ResponseInvalid(ValueError):
    """The response body is not a valid reward response; the message says what was wrong."""


def _refuse_constant(name: str) -> float:
    raise ResponseInvalid(f"response JSON contains {name}, which is not a valid reward")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise ResponseInvalid(f"response JSON contains {text}, which overflows to infinity")
    return value


def parse_response(body: bytes, *, expected: int) -> list[float | None]:
    """Parse and validate a response body for a request of `expected` items. Raises ResponseInvalid."""
    try:
        # Python's json accepts NaN/Infinity by default; the protocol does not.
        data = json.loads(body, parse_constant=_refuse_constant, parse_float=_parse_float)
    except ResponseInvalid:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        excerpt = body[:80].decode("utf-8", "replace")
        raise ResponseInvalid(f"response is not valid JSON ({exc}); body starts {excerpt!r}") from exc
    if not isinstance(data, dict) or "rewards" not in data:
        raise ResponseInvalid(f'response must be a JSON object with a "rewards" list, got {_shape(data)}')
    return check_rewards(data, expected=expected)


def check_rewards(data: dict[str, Any], *, expected: int) -> list[float | None]:
    """Validate a decoded ``{"rewards": [...]}`` for a request of `expected` items (any transport).

    Each value must be a finite number or None, and there must be exactly `expected` of them.
    Raises ResponseInvalid naming the first offending value.
    """
    try:
        rewards = RewardResponse.model_validate(data).rewards
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
        shown = repr(first["input"])
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ResponseInvalid(f"{where} is {shown}: {first['msg']}") from exc
    if len(rewards) != expected:
        raise ResponseInvalid(f"rewards has {len(rewards)} values for {expected} items")
    return rewards


def _shape(data: Any) -> str:
    if isinstance(data, dict):
        return f"an object with keys {sorted(data)[:5]}"
    return type(data).__name__
