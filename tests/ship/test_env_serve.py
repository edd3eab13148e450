"""`grpo envs serve module:Class` hosts a TRL-style environment class over OpenEnv's protocol, as its own process on
loopback: its public methods are tools with their schemas, one instance per session (two episodes at once keep
their own rows), `get_reward` comes with every tool result; a class OpenEnv cannot host is refused with the reason."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.env_host import tool_names
from examples.environments.lookup import CapitalLookup
from outbound.openenv_session import EnvironmentConfig, open_episode
from tests.ship.conftest import GRPO, Processes, clean_env, free_port, wait_http_ok

pytestmark = pytest.mark.slow
TARGET = "examples.environments.lookup:CapitalLookup"


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
    server = processes.start("envs-serve", [*GRPO, "envs", "serve", TARGET, "--port", str(port)], clean_env())
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


def test_a_target_that_is_not_a_class_exits_with_the_reason(tmp_path: Path) -> None:
    done = subprocess.run([*GRPO, "envs", "serve", "examples.environments.lookup:Nothing"], env=clean_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "has no class Nothing" in done.stderr, done.stderr


class Steps:
    def reset(self, **row: Any) -> None: ...
    def step(self) -> str:
        return ""


class NoReset:
    def look(self) -> str:
        return ""


@pytest.mark.parametrize(("cls", "says"), [(Steps, "['step']"), (NoReset, "no reset")])
def test_classes_openenv_cannot_host_are_refused(cls: type, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        tool_names(cls)


def test_tools_are_the_public_methods_but_the_episodes_own() -> None:
    assert tool_names(CapitalLookup) == ["answer", "lookup"]  # not reset, get_reward, nor private helpers
