"""graders/run cannot exhaust the API (issue 30), against a real `grpo serve` process on loopback.

- Template amplification: a 20,000-character template of 2,000 ``{{item.a}}`` over a 100 KB field would render
  200 MB per template (it raised the server from 140 to 540 MB before the limit); it is refused with a 400 naming
  the field and GRPO_GRADER_MAX_RENDERED_CHARS, and the server with its grading processes grows by under 100 MB.
- rouge_l on two 20,000-token texts (rouge-score's n x m table: about 400 M Python ints, tens of GB) is answered
  in seconds, several at once, while another tenant's first request (an API key the server has not cached)
  is answered within 1 s: grading runs in child processes, not in the threads that look keys up.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from contract.graders import MAX_RENDERED_CHARS
from outbound.graders import similarity
from tests.worker.procs import ApiClient, PeakMemory, Proc, Stack, private_tmp

pytestmark = [pytest.mark.slow]

MIB = 1024 * 1024
RUN = "/openai/v1/fine_tuning/alpha/graders/run"


def tree_memory(root: int) -> int:
    """Resident bytes of `root` and every process below it (the fork server and its grading children), each
    process's shared pages counted in proportion (PSS): a child forked from the fork server shares its pages."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    total = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    data_dir = private_tmp("grpo-grader-limits-")
    stack = Stack(database_url=f"sqlite:///{data_dir}/grpo.db", broker_url=f"sqla+sqlite:///{data_dir}/broker.db",
                  data_dir=data_dir, extra_env={"GRPO_GRADER_PROCESSES": "2", "GRPO_GRADER_QUEUE": "8"})
    try:
        stack.start_api(worker=False)
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture(scope="module")
def server(stack: Stack) -> Proc:
    return stack.procs[0]


@pytest.fixture(scope="module")
def api(stack: Stack) -> ApiClient:
    client = stack.make_client()
    warm = client.http.post(RUN, json={"grader": string_check("{{item.a}}"), "model_sample": "x", "item": {"a": "x"}})
    assert warm.status_code == 200 and warm.json()["reward"] == 1.0, warm.text
    return client


def string_check(reference: str) -> dict[str, Any]:
    return {"type": "string_check", "name": "amp", "operation": "eq", "input": "{{sample.output_text}}",
            "reference": reference}


def test_template_amplification_is_refused_in_bounded_memory(server: Proc, api: ApiClient) -> None:
    body = {"grader": string_check("{{item.a}}" * 2000), "model_sample": "x", "item": {"a": "x" * 100_000}}
    with PeakMemory(lambda: tree_memory(server.popen.pid), interval_s=0.02) as memory:
        responses = [api.http.post(RUN, json=body) for _ in range(3)]
    for response in responses:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "grader_input_too_large" and error["param"] == "grader.reference", error
        assert str(MAX_RENDERED_CHARS) in error["message"] and "GRPO_GRADER_MAX_RENDERED_CHARS" in error["message"]
    print(f"server and its grading processes grew {memory.growth / MIB:.1f} MiB")
    assert memory.growth < 100 * MIB, f"grew {memory.growth / MIB:.0f} MiB"


def test_rouge_l_on_20k_tokens_leaves_other_tenants_answered(stack: Stack, api: ApiClient) -> None:
    rng = random.Random(30)
    words = [f"word{i}" for i in range(2000)]
    text, reference = (" ".join(rng.choices(words, k=20_000)) for _ in range(2))
    body = {
        "grader": {"type": "text_similarity", "name": "lcs", "input": "{{sample.output_text}}",
                   "reference": "{{item.reference}}", "evaluation_metric": "rouge_l"},
        "model_sample": text, "item": {"reference": reference},
    }
    expected = similarity("rouge_l", text, reference)
    results: list[httpx.Response | BaseException] = []
    start = threading.Barrier(9)

    def grade() -> None:
        start.wait()
        try:
            results.append(api.http.post(RUN, json=body, timeout=120))
        except BaseException as exc:  # reported below
            results.append(exc)

    threads = [threading.Thread(target=grade) for _ in range(8)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    start.wait()
    time.sleep(0.3)  # the gradings are running
    waits = []
    for _ in range(3):  # other tenants, each with a key the server has never seen
        other = stack.make_client()
        asked = time.monotonic()
        response = other.http.get("/v1/jobs", timeout=30)
        waits.append(time.monotonic() - asked)
        assert response.status_code == 200, response.text
    for thread in threads:
        thread.join(120)
    elapsed = time.monotonic() - started
    print(f"other tenants answered in {[round(w, 3) for w in waits]} s; 8 gradings took {elapsed:.1f} s")
    assert max(waits) < 1.0, waits
    assert elapsed < 60
    statuses = [r.status_code if isinstance(r, httpx.Response) else repr(r) for r in results]
    assert len(results) == 8 and set(statuses) <= {200, 503} and 200 in statuses, statuses
    for response in results:
        assert isinstance(response, httpx.Response)
        if response.status_code == 200:
            assert response.json()["reward"] == pytest.approx(expected) and 0 < expected < 1
        else:
            assert response.json()["error"]["code"] == "grader_busy" and response.headers["retry-after"] == "1"
