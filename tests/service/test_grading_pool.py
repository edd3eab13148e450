"""The API's grading pool with real child processes: a deadline kills the child, capacity refuses instead of
queuing without bound, the memory cap holds, and the graders' own errors come back intact."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from contract.graders import GraderLimits, MissingField, parse_grader, parse_reference
from contract.reward_types import RewardInput
from outbound.graders import score_local
from service.openai.grading import GraderBusy, GradingFailed, GradingPool


def _spin_and_report(path: str) -> None:
    """Writes its pid, then burns CPU forever (a grading that never ends)."""
    with open(path, "w") as handle:
        handle.write(str(os.getpid()))
    while True:
        pass


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _allocate(size: int) -> int:
    return len(bytearray(size))


def _missing() -> None:
    raise MissingField(parse_reference("item.answer"), "answer")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module", autouse=True)
def _fork_server_ready() -> None:
    GradingPool(processes=1, queue=0, memory_bytes=0).warm()


async def test_the_deadline_kills_the_child(tmp_path: os.PathLike[str]) -> None:
    pool = GradingPool(processes=1, queue=0, memory_bytes=256 * 1024**2)
    report = os.path.join(tmp_path, "pid")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await pool.run(_spin_and_report, report, timeout_s=1.5)
    assert time.monotonic() - started < 5
    pid = int(open(report).read())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _alive(pid), "the child still runs after its deadline"
    assert pool.busy == 0
    assert await pool.run(_sleep, 0, timeout_s=10) == 0  # the slot is free again


async def test_beyond_processes_and_queue_is_refused_at_once() -> None:
    pool = GradingPool(processes=1, queue=1, memory_bytes=256 * 1024**2)
    running = asyncio.gather(pool.run(_sleep, 1.0, timeout_s=10), pool.run(_sleep, 0.1, timeout_s=10))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    with pytest.raises(GraderBusy) as busy:
        await pool.run(_sleep, 0, timeout_s=10)
    assert time.monotonic() - started < 0.5
    assert busy.value.http_status == 503 and busy.value.http_headers() == {"Retry-After": "1"}
    assert await running == [1.0, 0.1]


async def test_memory_past_the_cap_is_a_grading_failure() -> None:
    pool = GradingPool(processes=1, queue=0, memory_bytes=128 * 1024**2)
    with pytest.raises(GradingFailed) as failed:
        await pool.run(_allocate, 1024**3, timeout_s=30)
    assert failed.value.http_status == 422 and "GRPO_GRADER_MEMORY_BYTES" in failed.value.message
    assert await pool.run(_allocate, 1024, timeout_s=30) == 1024


async def test_graders_errors_and_results_come_back() -> None:
    pool = GradingPool(processes=2, queue=0, memory_bytes=512 * 1024**2)
    with pytest.raises(MissingField) as missing:
        await pool.run(_missing, timeout_s=30)
    assert missing.value.at == "answer"
    grader = parse_grader({"type": "text_similarity", "name": "sim", "input": "{{sample.output_text}}",
                           "reference": "{{item.ref}}", "evaluation_metric": "rouge_l"})
    items = [RewardInput(prompt="", completion="the cat sat", completion_ids=[], extras={"ref": "the cat sat"})]
    found = await pool.run(score_local, {"sim": grader}, items, GraderLimits(), timeout_s=30)
    assert found.scores == {"sim": [1.0]}
