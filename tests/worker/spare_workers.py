"""Workers handed from one test of a module to the next: a worker left idle and alive at the end of a test (the
one that took over a killed worker's job, say) becomes the next test's first worker, instead of that test
starting (and preloading the engine in) one more process. Only a test that passed hands its worker on; any
other stops it, so a broken worker never reaches the next test.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tests.worker.procs import Proc, Stack


class SpareWorkers:
    """At most one idle `grpo worker` of `stack`, kept between the tests of a module."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self._idle: Proc | None = None

    def take(self) -> Proc:
        """The idle worker if it still runs, else a new one."""
        idle, self._idle = self._idle, None
        if idle is not None and idle.popen.poll() is None:
            return idle
        return self.stack.start_worker()

    @contextmanager
    def lent(self, proc: Proc) -> Iterator[Proc]:
        """`proc` for the body of a test: kept as the spare if the body passes (replacing a spare kept before),
        stopped if it raises."""
        try:
            yield proc
        except BaseException:
            proc.stop()
            raise
        if self._idle is not None and self._idle is not proc:
            self._idle.stop()
        self._idle = proc
