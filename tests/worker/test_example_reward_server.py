"""examples/reward_server.py runs as its own process and answers the real client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.reward_types import RewardInput
from outbound.rewards import RemoteRewardSource

from .reward_servers import closed_port, new_secret
from .test_reward_client import make_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reward_server.py"


@pytest.fixture
def example_server() -> Iterator[tuple[str, str]]:
    secret, port = new_secret(), closed_port()
    env = {**os.environ, "GRPO_REWARD_SECRET": secret}
    process = subprocess.Popen([sys.executable, str(EXAMPLE), "--port", str(port)], env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, "example server exited"
                assert time.monotonic() < deadline, "example server did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/score", secret
    finally:
        process.terminate()
        process.wait(timeout=10)


async def test_example_scores_boxed_answers(example_server: tuple[str, str]) -> None:
    url, secret = example_server
    completions = [r"so \boxed{4}", r"\boxed{5}", "four", r"\boxed{4}"]
    extras: list[dict[str, str]] = [{"answer": "4"}, {"answer": "4"}, {"answer": "4"}, {}]
    items = [
        RewardInput(prompt="2+2?", completion=c, completion_ids=[], extras=e, index=i)
        for i, (c, e) in enumerate(zip(completions, extras, strict=True))
    ]
    source = RemoteRewardSource(make_config(url, secret))
    assert await source(items, step=0) == [1.0, 0.1, 0.0, None]
    await source.aclose()


def test_example_refuses_to_start_without_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPO_REWARD_SECRET"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "GRPO_REWARD_SECRET" in result.stderr
