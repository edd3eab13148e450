"""`ChatScoreSource`: a score_model grader, scored by a user's OpenAI-compatible chat endpoint.

The endpoint is a registered reward function whose URL is a chat completions URL (``.../v1/chat/completions``)
and whose headers carry its credentials (``Authorization: Bearer ...``). One completion per request; the
batching limits, retries with backoff, circuit breaker, step deadline, cache and the SSRF-checked pinned
transport are the reward endpoints' own (`EndpointRewardSource`, `EndpointCaller`). Requests are signed like
reward calls, which a plain chat server ignores.

The reply's text is read as a score: a JSON object with ``result`` (OpenAI's score_model output) or
``score``, else the first number in the text. No number, or one outside the grader's range, is an
abstention (the grader counts it as its lowest score).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from contract.graders import (
    MAX_RENDERED_CHARS,
    GraderInputTooLarge,
    MissingField,
    Sample,
    SampleNotJson,
    ScoreModelGrader,
    render,
)
from contract.reward_types import RewardInput
from outbound.rewards.client import HttpEndpointSource
from outbound.rewards.config import RemoteRewardConfig
from outbound.rewards.protocol import ResponseInvalid
from outbound.rewards.source import OnDegraded, OnRetry, Pending
from outbound.urlpolicy import Resolver

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def score_from_reply(text: str, low: float, high: float) -> float | None:
    """The score a grader model wrote, or None when it wrote none within [low, high]."""
    value: Any = None
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        value = parsed.get("result", parsed.get("score"))
    elif isinstance(parsed, int | float) and not isinstance(parsed, bool):
        value = parsed
    if value is None and (match := _NUMBER.search(text)) is not None:
        value = match.group()
    try:
        number = float(value) if value is not None and not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and low <= number <= high else None


def _parse_chat(low: float, high: float) -> Any:
    def parse(body: bytes, *, expected: int) -> list[float | None]:
        try:
            reply = json.loads(body)
            content = reply["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ResponseInvalid("not a chat completion (choices[0].message.content)") from exc
        if not isinstance(content, str):
            raise ResponseInvalid("choices[0].message.content is not text")
        return [score_from_reply(content, low, high)] * expected

    return parse


class ChatScoreSource(HttpEndpointSource):
    """Implements `contract.reward_types.RewardSource` for one score_model grader within one job."""

    def __init__(
        self,
        name: str,
        grader: ScoreModelGrader,
        config: RemoteRewardConfig,
        *,
        on_retry: OnRetry | None = None,
        on_degraded: OnDegraded | None = None,
        resolver: Resolver | None = None,
        max_rendered_chars: int = MAX_RENDERED_CHARS,
    ) -> None:
        config = config.model_copy(update={"max_batch_size": 1})  # one chat request scores one completion
        super().__init__(
            config, name=name, parse=_parse_chat(*grader.range),
            on_retry=on_retry, on_degraded=on_degraded, resolver=resolver,
        )
        self.name = name
        self.grader = grader
        self.max_rendered_chars = max_rendered_chars

    async def __call__(self, items: Sequence[RewardInput], *, step: int) -> list[float | None]:
        # A sample the messages cannot be rendered for (output_json of a non-JSON completion, a message over
        # the rendered-size limit) is not sent.
        sendable = [i for i, item in enumerate(items) if self._messages(item) is not None]
        answers = await super().__call__([items[i] for i in sendable], step=step) if sendable else []
        results: list[float | None] = [None] * len(items)
        for i, value in zip(sendable, answers, strict=True):
            results[i] = value
        return results

    def _messages(self, item: RewardInput) -> list[dict[str, str]] | None:
        try:
            return [
                {"role": m.role, "content": render(m.content, item.extras, Sample(item.completion),
                                                   max_chars=self.max_rendered_chars)}
                for m in self.grader.input
            ]
        except (SampleNotJson, MissingField, GraderInputTooLarge):
            return None

    def _encode(self, batch: Sequence[Pending], step: int) -> bytes:
        params = self.grader.sampling_params
        body: dict[str, Any] = {"model": self.grader.chat_model, "messages": self._messages(batch[0].item)}
        optional = {
            "temperature": params.temperature, "top_p": params.top_p, "seed": params.seed,
            "max_tokens": params.max_completions_tokens, "reasoning_effort": params.reasoning_effort,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        return json.dumps(body, ensure_ascii=False).encode()
