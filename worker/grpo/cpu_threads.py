"""How a GRPO step spends the CPU's cores: torch's intra-op thread count, and a side thread.

Why a side thread: on a small CPU, splitting one op over the cores pays a wake-up and a join per
op (tens of microseconds each with OpenMP's passive waiting, on a VM) and the GEMMs of small models
scale poorly. Measured on a 2-core EPYC (torch 2.13, the bench's small preset): the policy forward
and backward take ~1.2x less time on two threads than on one, and the reference forward gains
nothing. Two independent forwards, each on one thread on its own core, finish sooner than the same
two one after the other on both threads. The side thread is that second lane.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")


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
