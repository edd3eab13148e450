"""`grpo envs serve module:Class` hosts a TRL-style environment class over OpenEnv's protocol, as its own process on
loopback (in the OpenEnv venv, tests/openenv_servers.py): its public methods are tools with their schemas (not
reset, get_reward or private helpers), one instance per session (two episodes at once keep their own rows),
`get_reward` comes with every tool result; a class OpenEnv cannot host is refused with the reason."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import httpx
import pytest

from outbound.openenv_session import EnvironmentConfig, open_episode
from tests.openenv_servers import openenv_python
from tests.ship.conftest import Processes, clean_env, free_port, wait_http_ok
from tests.worker.procs import REPO

pytestmark = pytest.mark.slow
TARGET = "examples.environments.lookup:CapitalLookup"


def grpo() -> list[str]:
    return [openenv_python(), "-m", "cli"]


def _config(url: str) -> EnvironmentConfig:
    return EnvironmentConfig(environment_id="env_lookup", url=url, secret="whsec_" + "A" * 32, allow_private=True)


async def _episode(url: str, country: str, capital: str, answer: str) -> list[Any]:
    episode, first = await open_episode(_config(url), {"country": country, "answer": capital})
    try:
        tools = await episode.step({"type": "list_tools"})
        found = await episode.step({"type": "call_tool", "tool_name": "lookup", "arguments": {"country": country}})
        done = await episode.step({"type": "call_tool", "tool_name": "answer", "arguments": {"city": answer}})
        return [first, tools, found, done]
    finally:
        await episode.close()


def test_serves_a_class_as_an_openenv_server(processes: Processes) -> None:
    port = free_port()
    server = processes.start("envs-serve", [*grpo(), "envs", "serve", TARGET, "--port", str(port)], clean_env())
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/health", server, timeout=60)
    assert httpx.get(f"{url}/schema").json()["action"]["properties"]["tool_name"]["type"] == "string"

    async def two_at_once() -> list[list[Any]]:
        return list(await asyncio.gather(_episode(url, "Kenya", "Nairobi", "Nairobi"),
                                         _episode(url, "Peru", "Lima", "Cusco")))

    right, wrong = asyncio.run(two_at_once())
    first, tools, found, done = right
    assert first.observation["metadata"] == {"text": "What is the capital of Kenya?"}
    schemas = {t["name"]: t for t in tools.observation["tools"]}
    assert set(schemas) == {"lookup", "answer"}
    assert schemas["lookup"]["input_schema"]["properties"] == {"country": {"type": "string"}}
    assert schemas["lookup"]["description"] == "Look a country up in the table of capitals."
    assert found.observation["result"]["data"] == "Nairobi" and found.reward == 0.0
    assert done.reward == 1.0
    assert wrong[0].observation["metadata"]["text"] == "What is the capital of Peru?" and wrong[3].reward == 0.0


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("examples.environments.lookup:Nothing", "has no class Nothing"),
        ("tests.ship.env_classes:Steps", "methods named ['step'] cannot be tools"),
        ("tests.ship.env_classes:NoReset", "no reset(self, **row) method"),
        ("no_colon", "expected module:Class"),
    ],
)
def test_what_cannot_be_served_exits_with_the_reason(target: str, says: str) -> None:
    done = subprocess.run([*grpo(), "envs", "serve", target], env=clean_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2 and says in done.stderr, done.stderr
