"""The reward sources of an attempt: built-in rules and graders, reward models, and the tenant's remote endpoints
(HTTP or gRPC, and chat-completions score models) with their retries and degraded steps reported as job events.

A registered URL that this worker's policy refuses (e.g. registered in development, run by a worker in
production mode) fails the job as `reward_endpoint_url_rejected`, naming the source.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.graders import ScoreModelGrader
from contract.spec import BUILTIN_PREFIX, ModelRewardSpec, RemoteRewardSpec
from outbound.rewards import RemoteRewardConfig, RetryEvent, build_remote_source
from outbound.rewards.chat import ChatScoreSource
from outbound.rewards.errors import RewardEndpointRefused
from outbound.rewards.source import DegradedEvent, EndpointRewardSource
from outbound.urlpolicy import UrlRejected, check_url_syntax
from service.execution import reporting
from service.execution.inputs import JobInputs
from service.execution.lease import Claim, LeaseLost
from service.execution.runtime import Settings
from worker import metrics as worker_metrics
from worker.grpo.rewards import build_reward_sources
from worker.job_inputs import InputFetcher

if TYPE_CHECKING:
    from worker.grpo.rewards import CompositeReward

log = logging.getLogger(__name__)


@dataclass
class RewardSetup:
    """The job's reward, and what the other ranks of a multi-device job need to build the same: the endpoint
    configurations (by reward function id) and the local paths of reward models (by model source)."""

    reward: CompositeReward
    remote_configs: dict[str, RemoteRewardConfig] = field(default_factory=dict)
    model_paths: dict[str, str] = field(default_factory=dict)


def endpoint_config(inputs: JobInputs, source_name: str, rf_id: str, settings: Settings) -> RemoteRewardConfig:
    """The endpoint of a registered reward function, as this worker's URL policy allows it."""
    fields = inputs.reward_endpoints[rf_id]
    allow_private = bool(settings.allow_private_reward_urls)
    try:
        # E.g. registered in development, run by a worker in production mode.
        check_url_syntax(fields["url"], allow_private=allow_private)
    except UrlRejected as exc:
        raise RewardEndpointRefused(
            source_name, f"the registered url is refused by this worker's policy: {exc.message}"
        ) from exc
    return RemoteRewardConfig.model_validate({**fields, "allow_private": allow_private})


def build_rewards(
    claim: Claim, inputs: JobInputs, fetcher: InputFetcher, settings: Settings, models_dir: Path, *, device: str
) -> RewardSetup:
    """The job's reward sources, on `device` for reward models."""
    configs: dict[str, RemoteRewardConfig] = {}

    def config_of(source_name: str, rf_id: str) -> RemoteRewardConfig:
        configs[rf_id] = endpoint_config(inputs, source_name, rf_id, settings)
        return configs[rf_id]

    def remote(spec: RemoteRewardSpec) -> EndpointRewardSource[Any]:
        config = config_of(spec.source_name, spec.reward_function_id)
        # gRPC for grpc(s):// URLs, else HTTP
        return build_remote_source(config, on_retry=events.on_retry, on_degraded=events.on_degraded)

    def chat(grader: ScoreModelGrader) -> ChatScoreSource:
        name = f"score_model:{grader.name}"
        return ChatScoreSource(name, grader, config_of(name, grader.reward_function_id),
                               on_retry=events.on_retry, on_degraded=events.on_degraded)

    events = _EndpointEvents(claim)
    model_paths = _reward_model_paths(inputs, fetcher, settings, models_dir)
    reward = build_reward_sources(
        inputs.spec.rewards, remote=remote, device=device, model_paths=model_paths, chat=chat,
        grader_limits=settings.grader_limits(),
    )
    return RewardSetup(reward, configs, model_paths)


def _reward_model_paths(inputs: JobInputs, fetcher: InputFetcher, settings: Settings, models_dir: Path) -> dict[str, str]:
    """Where each reward model loads from (a tenant's checkpoint is downloaded and verified first)."""
    paths: dict[str, str] = {}
    for i, spec in enumerate(inputs.spec.rewards):
        if isinstance(spec, ModelRewardSpec):
            path = fetcher.resolve_model(inputs, f"rewards[{i}].model", spec.model, models_dir)
            if path.startswith(BUILTIN_PREFIX):
                # worker.grpo.model_paths imports torch: only the job's process may (the Celery parent forks children).
                from worker.grpo.model_paths import resolve_model_path

                path = resolve_model_path(path, Path(settings.data_dir) / "models")
            paths[spec.model] = path
    return paths


class _EndpointEvents:
    """Job events for an endpoint's retries and degraded steps, written off the event loop. A write refused
    because a newer attempt owns the job is only logged: the attempt stops at its next fenced report."""

    def __init__(self, claim: Claim) -> None:
        self.claim = claim

    async def on_retry(self, event: RetryEvent) -> None:
        worker_metrics.reward_retry(event.source, event.reason)
        message = f"{event.source}: attempt {event.attempt} failed ({event.reason}); retrying in {event.wait_s:.2f}s"
        data = {"source": event.source, "attempt": event.attempt, "reason": event.reason,
                "wait_s": event.wait_s, "message_id": event.message_id, "batch_size": event.batch_size}
        await self._record("reward_retry", message, data)

    async def on_degraded(self, event: DegradedEvent) -> None:
        message = (f"{event.source}: {event.abstained} of {event.items} completions abstain at step {event.step} "
                   f"(no answer within the step deadline: {event.reason})")
        data = {"source": event.source, "step": event.step, "abstained": event.abstained,
                "items": event.items, "reason": event.reason}
        await self._record("reward_degraded", message, data)

    async def _record(self, type_: str, message: str, data: dict[str, Any]) -> None:
        try:
            await asyncio.to_thread(reporting.record_event, self.claim, type_, message, data)
        except LeaseLost:
            log.info("job %s: %s event refused (lease lost)", self.claim.job_id, type_)
