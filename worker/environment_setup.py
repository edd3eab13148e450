"""A multi-turn job's environment, as its attempt connects to it: the registered OpenEnv server with this worker's
URL policy, and the job's turn settings.

A registered URL this worker's policy refuses (registered in development, run by a production worker) fails the
job as `environment_url_rejected`, as reward endpoints do.
"""

from __future__ import annotations

from typing import Any

from contract.spec import JobSpec
from outbound.openenv_session import EnvironmentConfig
from outbound.urlpolicy import UrlRejected, check_url_syntax
from service.execution import reporting
from service.execution.lease import Claim
from service.execution.runtime import Settings
from worker.failures import JobFailure
from worker.grpo.environment import MultiTurnSettings, OpenEnvEnvironment

URL_REJECTED = "environment_url_rejected"
EPISODE_FAILED = "environment_episode_failed"
MAX_LISTED = 5  # reasons listed in one event


def environment_for(
    spec: JobSpec, fields: dict[str, Any] | None, settings: Settings, claim: Claim
) -> OpenEnvEnvironment | None:
    """The job's environment with its turn settings, reporting failed episodes as job events; None for a
    single-turn job."""
    if spec.environment is None or fields is None:
        return None
    allow_private = bool(settings.allow_private_reward_urls)
    try:
        check_url_syntax(fields["url"], allow_private=allow_private)
    except UrlRejected as exc:
        raise JobFailure(URL_REJECTED, f"environment {fields['environment_id']}: the registered url is refused "
                         f"by this worker's policy: {exc.message}") from exc
    values = {k: v for k, v in fields.items() if k != "max_sessions"}
    config = EnvironmentConfig.model_validate({**values, "allow_private": allow_private})
    turns = MultiTurnSettings(max_turns=spec.environment.max_turns, reward_mode=spec.environment.reward)
    return OpenEnvEnvironment(config, int(fields["max_sessions"]), turns, report=lambda errors: _failed(claim, errors))


def _failed(claim: Claim, errors: list[str]) -> None:
    """One event per batch with failed episodes: how many, and the first reasons (each already names why)."""
    message = f"{len(errors)} episode(s) failed: {errors[0]}"
    reporting.record_event(claim, EPISODE_FAILED, message, {"count": len(errors), "errors": errors[:MAX_LISTED]})
