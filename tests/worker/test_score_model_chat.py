"""The worker's score_model path: a grader reward built by `build_reward_sources` with the worker's chat factory
(`ChatScoreSource`, as worker.runner builds it) scores a batch against a real OpenAI-compatible chat endpoint."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from contract.graders import ScoreModelGrader
from contract.reward_types import RewardInput, RewardUnavailable
from contract.spec import GraderRewardSpec
from outbound.rewards.chat import ChatScoreSource
from outbound.rewards.config import RemoteRewardConfig
from tests.worker.chat_servers import Answer, ChatServer, chat_server, judge, user_text
from tests.worker.reward_servers import new_secret
from worker.grpo.rewards import CompositeReward, build_reward_sources

PROMPT = "Question: {{item.question}}\nAnswer: {{sample.output_text}}\nReference: {{item.answer}}"


def grader(**fields: Any) -> dict[str, Any]:
    return {"type": "score_model", "name": "judge", "model": "rf_judge/judge-7b", "range": [-1, 1],
            "input": [{"role": "user", "content": PROMPT}], **fields}


def composite(server: ChatServer, spec: dict[str, Any], **config: Any) -> CompositeReward:
    def chat(sub: ScoreModelGrader) -> ChatScoreSource:
        settings = RemoteRewardConfig(
            reward_function_id=sub.reward_function_id, url=server.url, secret=new_secret(), job_id="job_1",
            headers={"Authorization": "Bearer sk-judge"}, allow_private=True, **config,
        )
        return ChatScoreSource(f"score_model:{sub.name}", sub, settings)

    return build_reward_sources([GraderRewardSpec(grader=spec)], chat=chat)


def batch(completions: list[str]) -> list[RewardInput]:
    rows = [{"question": "6 x 7?", "answer": "42"}, {"question": "2 + 2?", "answer": "4"}]
    return [RewardInput(prompt=f"p{i // 2}", completion=c, completion_ids=[], extras=rows[i // 2], group_id=i // 2,
                        index=i) for i, c in enumerate(completions)]


def test_batch_is_scored_one_request_per_completion() -> None:
    with chat_server(judge) as server:
        reward = composite(server, grader(sampling_params={"temperature": 0.5}))
        result = asyncio.run(reward.score(batch(["42", "41", "4", "{{item.answer}}"]), step=3))
    assert result.per_source == {"grader:judge": [0.9, 0.2, 0.9, -1.0]}, result.per_source
    assert result.total == [0.9, 0.2, 0.9, -1.0]
    prompts = sorted(user_text(s.body) for s in server.seen)
    assert prompts == sorted([
        "Question: 6 x 7?\nAnswer: 42\nReference: 42",
        "Question: 6 x 7?\nAnswer: 41\nReference: 42",
        "Question: 2 + 2?\nAnswer: 4\nReference: 4",
        # A completion is data, not a template: its braces reach the model as written.
        "Question: 2 + 2?\nAnswer: {{item.answer}}\nReference: 4",
    ])
    assert {s.body["model"] for s in server.seen} == {"judge-7b"}
    assert all(s.body["temperature"] == 0.5 and s.headers["authorization"] == "Bearer sk-judge" for s in server.seen)
    assert all("webhook-signature" in s.headers for s in server.seen)


def test_multi_formula_over_model_and_string_check() -> None:
    exact = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
             "reference": "{{item.answer}}", "operation": "eq"}
    spec = {"type": "multi", "name": "both", "calculate_output": "exact + 10 * judge",
            "graders": {"judge": grader(range=[0, 1]), "exact": exact}}
    with chat_server(judge) as server:
        result = asyncio.run(composite(server, spec).score(batch(["42", "41", "4", "five"]), step=0))
    assert result.per_source["grader:both"] == pytest.approx([10.0, 2.0, 10.0, 2.0])
    assert len(server.seen) == 4


def test_unanswering_endpoint_makes_the_reward_unavailable() -> None:
    with chat_server(lambda body: Answer(503, json.dumps({"error": "overloaded"}).encode())) as server:
        reward = composite(server, grader(), max_attempts=2, backoff_base_s=0.01, breaker_threshold=1)
        with pytest.raises(RewardUnavailable, match="HTTP 503"):
            asyncio.run(reward.score(batch(["42", "41"]), step=0))
    assert 2 <= len(server.seen) <= 4  # two attempts per request, then the circuit opens
