"""graders/validate and graders/run: the grader checks and evaluation training uses, on one sample.

score_model graders call the tenant's registered chat endpoint (`outbound.rewards.chat`) with the client
configuration a job would use (`service.rewards.dry_run.endpoint_config`), one attempt, as the reward dry run
does: the caller sees a failing endpoint at once (by its error code; the endpoint's words stay in the log).

The rule graders score in a child process of the API's grading pool (`service.openai.grading`), under the
limits of `Settings.grader_limits`: a template that renders past them is refused (400 naming the field and the
limit) before any endpoint is called.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy.orm import Session

from contract.graders import Grader, GraderInputTooLarge, ScoreModelGrader, sub_graders
from contract.reward_types import RewardSource
from outbound.graders import run_grader
from outbound.rewards.chat import ChatScoreSource
from outbound.rewards.config import RemoteRewardConfig
from service.kit.config import get_settings
from service.kit.errors import NotFound
from service.openai.errors import OpenAIInvalid
from service.openai.grading import GradingPool, local_runner
from service.rewards.dry_run import endpoint_config


def _model_params(grader: Grader) -> dict[str, ScoreModelGrader]:
    """score_model parts by the param that names their `model`."""
    parts = sub_graders(grader)
    if len(parts) == 1 and isinstance(grader, ScoreModelGrader):
        return {"grader.model": grader}
    return {f"grader.graders.{key}.model": sub for key, sub in parts.items() if isinstance(sub, ScoreModelGrader)}


def chat_configs(session: Session, tenant_id: str, grader: Grader) -> dict[str, RemoteRewardConfig]:
    """The client configuration of each score_model's endpoint, by reward function id (sub-graders' names need
    not differ); unknown ids name the param. One attempt, no retry of a failed call, no cache, as the dry run."""
    configs: dict[str, RemoteRewardConfig] = {}
    for param, sub in _model_params(grader).items():
        try:
            config = endpoint_config(session, tenant_id, sub.reward_function_id)
        except NotFound as exc:
            raise OpenAIInvalid(
                param, f"reward function {sub.reward_function_id!r} not found: register the chat endpoint "
                "(POST /v1/reward-functions, its chat completions URL) and name it as <id>/<model>"
            ) from exc
        configs[sub.reward_function_id] = config.model_copy(
            update={"max_attempts": 1, "breaker_threshold": 1, "cache_max_entries": 0}
        )
    return configs


def check_endpoints(session: Session, tenant_id: str, grader: Grader) -> None:
    chat_configs(session, tenant_id, grader)


async def run(
    grader: Grader, item: dict[str, Any], model_sample: str, chats: dict[str, RemoteRewardConfig], pool: GradingPool
) -> dict[str, Any]:
    """OpenAI's GraderRunResponse for one sample."""
    settings = get_settings()
    limits = settings.grader_limits()
    sources: list[ChatScoreSource] = []

    def chat(sub: ScoreModelGrader) -> RewardSource:
        sources.append(ChatScoreSource(f"score_model:{sub.name}", sub, chats[sub.reward_function_id],
                                       max_rendered_chars=limits.max_rendered_chars))
        return sources[-1]

    started = time.perf_counter()
    try:
        outcome = await run_grader(
            grader, item, model_sample, chat=chat, limits=limits, local=local_runner(pool),
            timeout_s=settings.grader_timeout_seconds,
        )
    except GraderInputTooLarge as exc:
        raise OpenAIInvalid(f"grader.{exc.field}", exc.reason, code="grader_input_too_large") from exc
    finally:
        for source in sources:  # their HTTP clients hold connections open until closed
            await source.aclose()
    errors: dict[str, Any] = {
        "formula_parse_error": False, "invalid_variable_error": False, "model_grader_parse_error": False,
        "model_grader_refusal_error": False, "model_grader_server_error": False,
        "model_grader_server_error_details": None, "other_error": False, "python_grader_runtime_error": False,
        "python_grader_runtime_error_details": None, "python_grader_server_error": False,
        "python_grader_server_error_type": None, "sample_parse_error": False, "truncated_observation_error": False,
        "unresponsive_reward_error": False,
    }
    for key, value in outcome.errors.items():
        errors[key] = bool(value) if key == "other_error" else value
    return {
        "reward": outcome.reward,
        "sub_rewards": outcome.sub_rewards,
        "model_grader_token_usage_per_model": {},
        "metadata": {
            "name": grader.name,
            "type": grader.type,
            "errors": errors,
            "execution_time": time.perf_counter() - started,
            "scores": outcome.sub_rewards,
            "token_usage": None,
            "sampled_model_name": None,
        },
    }
