"""How a GRPO step runs work beside the training loop: reward scoring on an asyncio loop, torch
work on a second CPU lane, and torch's intra-op thread count while both run.

`StepLanes` is what the trainer uses; the rest are its parts (the rollout takes the side lane
directly, to decode half a batch on it).

Why a side lane: on a small CPU, splitting one op over the cores pays a wake-up and a join per
op (with OpenMP's passive waiting) and the GEMMs of small models scale poorly: a small model's forward
and backward gain little from a second thread. Two independent forwards, each on one thread on its own core,
finish sooner than the same two one after the other on both threads; so do a backward's two halves
(half the groups each, their gradients added after). The side thread is that second lane
(bench/README.md has the figures).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class StepLanes:
    """The trainer's background lanes for one `train()` run (a context manager):

    - `score(coro)` runs a reward coroutine on the event loop thread while torch works here;
    - `beside(fn)` runs torch work on the side thread when there is one, else here at once;
    - `own_core_while(pending)` drops this thread to one intra-op thread while `pending` side work
      still runs, so that each lane has a core.

    The side thread is started only on a CPU whose work would otherwise be split over two or more
    threads (`side_thread_helps`).
    """

    def __init__(self, device: torch.device, *, side: bool = True) -> None:
        self._device = device
        self._wants_side = side  # the fused backend's second CPU lane; the module backend has none
        self._loop: EventLoopThread | None = None
        self.side: SideThread | None = None

    def __enter__(self) -> StepLanes:
        self._loop = EventLoopThread()
        self.side = SideThread() if self._wants_side and side_thread_helps(self._device) else None
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self.side is not None:
            self.side.close()
            self.side = None

    def score(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self._loop is None:
            raise RuntimeError("StepLanes used outside its `with` block")
        return self._loop.submit(coro)

    def beside(self, fn: Callable[[], T]) -> Future[T]:
        return completed(fn()) if self.side is None else self.side.submit(fn)

    def own_core_while(self, pending: Future[Any] | None) -> AbstractContextManager[Any]:
        if pending is not None and not pending.done():
            return intra_op_threads(1)
        return nullcontext()


class EventLoopThread:
    """An asyncio loop on a daemon thread: reward scoring runs there while torch works here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpo-rewards", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Run the block with `threads` torch intra-op threads, then restore the previous count."""
    previous = torch.get_num_threads()
    if threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def side_thread_helps(device: torch.device) -> bool:
    """A side lane only pays on a CPU whose work is otherwise split over two or more threads."""
    return device.type == "cpu" and torch.get_num_threads() >= 2


class SideThread:
    """One worker thread running torch work on a single intra-op thread, beside the caller.

    The caller should drop to one intra-op thread itself while side work is pending (see
    `intra_op_threads`), so that each lane has a core.
    """

    def __init__(self) -> None:
        caller_threads = torch.get_num_threads()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grpo-side")
        self._executor.submit(_use_one_thread).result()
        # torch.set_num_threads also sets the default every thread adopts on its first torch call:
        # put back the caller's, now that the worker has its own.
        torch.set_num_threads(caller_threads)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        return self._executor.submit(fn)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _use_one_thread() -> None:
    # A thread's first torch call resets its count to the process default: make that call first.
    torch.get_num_threads()
    torch.set_num_threads(1)


def completed(value: T) -> Future[T]:
    """A future that already holds `value` (the same interface whether or not a side thread ran it)."""
    future: Future[T] = Future()
    future.set_result(value)
    return future
