"""A small circuit breaker: after `threshold` consecutive failed calls the endpoint is considered down.

While open, calls fail fast (no network) until `reset_after_s` has passed; then one trial call is let
through (half-open): its success closes the breaker, its failure re-opens it for another period.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self, *, threshold: int, reset_after_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if threshold < 1:
            raise ValueError("threshold must be >= 1")
        self.threshold = threshold
        self.reset_after_s = reset_after_s
        self._clock = clock
        self._consecutive_failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive_failures

    def allow(self) -> bool:
        """Whether a call may go out now. In half-open state only one trial call is allowed at a time."""
        if self._opened_at is None:
            return True
        if self._clock() - self._opened_at < self.reset_after_s or self._trial_in_flight:
            return False
        self._trial_in_flight = True
        return True

    def record_success(self) -> None:
        self._consecutive_failures = 0
        self._opened_at = None
        self._trial_in_flight = False

    def record_failure(self) -> None:
        self._consecutive_failures += 1
        self._trial_in_flight = False
        if self._opened_at is not None or self._consecutive_failures >= self.threshold:
            self._opened_at = self._clock()
