"""Per-step usage records from the engine's usage metrics, with the device time between reports."""

from __future__ import annotations

import time
from collections.abc import Mapping

from service.execution.reporting import StepUsageIn


class UsageMeter:
    """Turns the engine's per-step usage metrics into a usage record, timing the device between reports:
    a step's device-seconds run from the end of the previous step's report (or the start of training in this
    attempt) to the end of this one's, so evaluation and checkpoint uploads are counted once, in the step
    that follows them. A GPU job counts wall-clock seconds (the GPU is held throughout); a CPU job counts the
    CPU-seconds its process used (cores shared with other work are not billed for the waits). A job on N devices
    holds all of them for the step: N times rank 0's seconds (its ranks run in lockstep)."""

    def __init__(
        self,
        *,
        tenant_id: str,
        num_sources: int,
        max_completion_length: int,
        num_iterations: int,
        parameters: int,
        cpu: bool,
        devices: int = 1,
    ) -> None:
        self.tenant_id = tenant_id
        self.num_sources = max(num_sources, 1)
        self.max_completion_length = max_completion_length
        self.num_iterations = num_iterations
        self.parameters = parameters
        self.devices = devices
        self._clock = time.process_time if cpu else time.monotonic
        self._since = self._clock()

    def take(self, metrics: Mapping[str, float]) -> StepUsageIn | None:
        """The usage of a training step's metrics; None for reports without usage (the step-0 evaluation)."""
        if "usage/tokens_generated" not in metrics:
            return None
        now = self._clock()
        seconds, self._since = now - self._since, now
        reward_calls = int(metrics["usage/reward_calls"])
        completions = reward_calls // self.num_sources
        return StepUsageIn(
            tokens_generated=int(metrics["usage/tokens_generated"]),
            tokens_trained=int(metrics["usage/tokens_trained"]),
            reward_calls=reward_calls,
            device_seconds=seconds * self.devices,
            completions=completions,
            completion_capacity=completions * self.max_completion_length,
            num_iterations=self.num_iterations,
            parameters=self.parameters,
        )
