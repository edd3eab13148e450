"""The API process's grading lane: graders/run's rule graders score in short-lived child processes.

Why a process: grading is CPU work on text a tenant chooses. In the API's threads it would share the pool that
authenticates requests (asyncio's default executor) and the GIL with every request, and a thread past its
deadline cannot be stopped. A child process can: at the deadline it is killed (SIGKILL), and its memory is
capped (RLIMIT_AS) besides the limits on what it is given (`contract.graders.GraderLimits`).

Children are forked from multiprocessing's fork server, which has the metric libraries imported already, so a
child costs a fork, not an interpreter start. At most `processes` children run at once per API process and
at most `queue` more requests wait for one; a request beyond that is refused at once with 503 `grader_busy`
and Retry-After, never queued without bound. Waiting for a child takes no thread: the event loop watches the
result pipe and the child's sentinel.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import math
import multiprocessing
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from fastapi import FastAPI, Request

from contract.graders import GraderLimits, SubGrader
from contract.reward_types import RewardInput
from outbound.graders import LocalRunner, LocalScores, score_local
from service.kit.config import Settings, get_settings
from service.kit.errors import DomainError
from service.openai import grading_child

log = logging.getLogger(__name__)

# Imported once by the fork server, inherited by every child.
PRELOAD = ["service.openai.grading_child", "outbound.graders", "rapidfuzz", "sacrebleu", "nltk.translate.gleu_score", "rouge_score.rouge_scorer"]


class GraderBusy(DomainError):
    """Every grading process of this API process is busy and the queue for them is full."""

    code = "grader_busy"
    http_status = 503
    grpc_status = grpc.StatusCode.UNAVAILABLE

    def __init__(self, processes: int, queue: int) -> None:
        super().__init__(
            f"the graders are busy ({processes} gradings run at once, {queue} more may wait; "
            "GRPO_GRADER_PROCESSES, GRPO_GRADER_QUEUE); retry in 1 s",
            details={"processes": processes, "queue": queue, "retry_after_s": 1},
        )

    def http_headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}

    def grpc_trailers(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after", "1"),)


class GradingFailed(DomainError):
    """The grading process ran out of its memory or CPU allowance, or died without answering."""

    code = "grading_failed"
    http_status = 422
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED


class GradingPool:
    """Runs picklable functions in child processes of the fork server: bounded in number, queue, time, memory.

    One per API process (`app.state.grading`); its bookkeeping is the serving event loop's."""

    def __init__(self, *, processes: int, queue: int, memory_bytes: int) -> None:
        self.processes = processes
        self.queue = queue
        self.memory_bytes = memory_bytes
        self._slots = asyncio.Semaphore(processes)
        self._admitted = 0  # running plus waiting
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grading-start")
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([*PRELOAD, *_main_script_imports()])

    @property
    def busy(self) -> int:
        return self._admitted

    def warm(self) -> None:
        """Start the fork server and wait until it has imported the metric libraries (a second or two, once per
        process), so that no grading's `process.start()` blocks the event loop that long. Blocking."""
        process = self._context.Process(target=grading_child.nothing, daemon=True)
        process.start()
        process.join()
        process.close()

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """`fn(*args)` in a child process. Raises GraderBusy at once when full, TimeoutError (the child killed)
        past `timeout_s`, the child's exception, or GradingFailed when it died without answering."""
        if self._admitted >= self.processes + self.queue:
            raise GraderBusy(self.processes, self.queue)
        self._admitted += 1
        try:
            async with asyncio.timeout(timeout_s):  # the wait for a process counts towards the deadline
                async with self._slots:
                    return await self._in_child(fn, args, timeout_s)
        finally:
            self._admitted -= 1

    async def _in_child(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
        reader, writer = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=grading_child.run, args=(writer, self.memory_bytes, math.ceil(timeout_s) + 1, fn, args),
            daemon=True,
        )
        # A message to the fork server, its answer, and the arguments written to the child: milliseconds, in a
        # thread of the pool's own so that a slow fork never holds the event loop.
        started = asyncio.get_running_loop().run_in_executor(self._starter, process.start)
        answer: tuple[str, Any] | None = None
        exitcode: int | None = None
        try:
            await asyncio.shield(started)
            writer.close()
            await _readable(reader.fileno(), process.sentinel)
            if reader.poll():
                answer = reader.recv()
        finally:
            writer.close()
            reader.close()
            with contextlib.suppress(BaseException):
                await asyncio.shield(started)  # cancelled while starting: let it finish, then kill the child
            exitcode = await _reap(process)
        if answer is None:
            raise GradingFailed(f"the grading process ended without an answer (exit code {exitcode})")
        status, value = answer
        if status == "ok":
            return value
        if status == "error":
            raise value
        if status == "memory":
            raise GradingFailed(f"grading needed more than {self.memory_bytes} bytes (GRPO_GRADER_MEMORY_BYTES)")
        raise GradingFailed(f"grading failed: {value}")


def _main_script_imports() -> list[str]:
    """The modules the main script (the `grpo` console script, pytest's) imports at its top level.

    Each child runs the main script again before it unpickles its target (multiprocessing's spawn preparation;
    Python 3.11's fork server cannot import it once for all), and the `grpo` script imports the whole CLI, a
    noticeable start-up cost per child. With those modules imported by the fork server, running the script again costs nothing."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path:
        return []
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


async def _readable(*fds: int) -> None:
    """Wait, on the event loop, until one of `fds` is readable (data, EOF or a process's exit)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    for fd in fds:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        for fd in fds:
            loop.remove_reader(fd)


async def _reap(process: multiprocessing.process.BaseProcess) -> int | None:
    """Kill the child if it still runs (a deadline passed, the request went away), collect it, and return its
    exit code (negative: the signal that ended it)."""
    if process.pid is None:
        return None  # never started
    if process.exitcode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        with contextlib.suppress(ValueError, OSError, TimeoutError):
            await asyncio.wait_for(_readable(process.sentinel), 5)
    exitcode = None
    with contextlib.suppress(ValueError):
        process.join(0)
        exitcode = process.exitcode
        process.close()
    return exitcode


def local_runner(pool: GradingPool) -> LocalRunner:
    """`outbound.graders.LocalRunner` for graders/run: `score_local` in one of the pool's child processes."""

    async def run(
        graders: Mapping[str, SubGrader], items: Sequence[RewardInput], limits: GraderLimits, timeout_s: float
    ) -> LocalScores:
        result = await pool.run(score_local, dict(graders), list(items), limits, timeout_s=timeout_s)
        assert isinstance(result, LocalScores)
        return result

    return run


def open_grading_pool(app: FastAPI, settings: Settings) -> GradingPool:
    """The app's pool (`app.state.grading`), made on the serving event loop."""
    pool = app.state.grading = GradingPool(
        processes=settings.grader_processes, queue=settings.grader_queue, memory_bytes=settings.grader_memory_bytes
    )
    return pool


def grading_pool(request: Request) -> GradingPool:
    """The pool of the app serving `request` (made on first use where the app was started without its lifespan)."""
    pool = getattr(request.app.state, "grading", None)
    return pool if isinstance(pool, GradingPool) else open_grading_pool(request.app, get_settings())
