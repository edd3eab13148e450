"""`test_endpoint`: call an endpoint once, now, for ``POST /v1/reward-functions/{id}/test``.

Same transport (HTTP or gRPC, by the URL's scheme), signing, SSRF policy and validation as a training
job, but a single attempt (no retries) so the caller sees the precise error at once, and no cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from contract.reward_types import RewardInput
from outbound.rewards.config import RemoteRewardConfig
from outbound.rewards.factory import build_remote_source
from outbound.rewards.protocol import RewardItem
from outbound.urlpolicy import Resolver


async def test_endpoint(
    config: RemoteRewardConfig, items: Sequence[RewardItem], *, resolver: Resolver | None = None
) -> tuple[list[float | None], float]:
    """(rewards, latency_ms) for `items`; raises the RewardError subclass that a job would have hit."""
    single = config.model_copy(update={"max_attempts": 1, "cache_max_entries": 0, "breaker_threshold": 1})
    source = build_remote_source(single, resolver=resolver)  # HTTP or gRPC, by the URL's scheme
    inputs = [
        RewardInput(
            prompt=item.prompt,
            completion=item.completion,
            completion_ids=[],
            extras=item.metadata,
            group_id=item.group_id,
            index=position,
        )
        for position, item in enumerate(items)
    ]
    started = time.perf_counter()
    try:
        rewards = await source(inputs, step=0)
    finally:
        await source.aclose()
    return rewards, (time.perf_counter() - started) * 1000.0


test_endpoint.__test__ = False  # type: ignore[attr-defined]  # not a pytest test despite the name
