"""Where a multi-turn rollout's tool calls go: an environment, one session per group member.

Two kinds behind one interface (`ToolEnvironment`, `ToolSession`):
- `OpenEnvEnvironment`: a user's OpenEnv server over its WebSocket (`outbound.openenv_session`): `reset` with the
  row's fields, MCP actions `list_tools` and `call_tool`; step rewards and `done` come from its observations.
- `LocalEnvironment`: a Python class with TRL's `environment_factory` contract, in the trainer's process
  (`grpo train`): `reset(**row)`, every other public method a tool, an optional `get_reward()`.

A tool's own error (unknown tool, bad arguments) is a message the policy reads, not a failure. A session that
breaks (the server errors, times out, answers garbage) fails that member's episode (`EpisodeFailed`); opening
that exhausts its retries because the server is busy or down raises `EnvironmentBusy`/`EnvironmentDown`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from contract.environment_factory import public_tools
from outbound.openenv_session import (
    EnvironmentBusy,
    EnvironmentConfig,
    EnvironmentDown,
    Episode,
    EpisodeError,
    EpisodeFailed,
    open_episode,
)
from worker.grpo.tool_calls import ToolCall

__all__ = [
    "EnvironmentBusy", "EnvironmentDown", "EpisodeError", "EpisodeFailed", "LocalEnvironment", "MultiTurnSettings",
    "OpenEnvEnvironment", "RewardMode", "ToolEnvironment", "ToolResult", "ToolSession",
]

RewardMode = Literal["sum", "final"]


@dataclass(frozen=True)
class MultiTurnSettings:
    """A multi-turn job's turn settings: most policy turns per episode; the environment reward's mode."""

    max_turns: int = 4
    reward_mode: RewardMode = "sum"


MAX_TOOL_TEXT_CHARS = 8192  # a tool result longer than this reaches the policy cut, saying so


@dataclass(frozen=True)
class ToolResult:
    """One tool call's outcome: the text the policy reads, the step's reward, whether the episode ended."""

    text: str
    reward: float | None = None
    done: bool = False
    error: str | None = None  # the tool's own error (also in `text`); the episode goes on


class ToolSession(Protocol):
    """One episode."""

    async def call(self, call: ToolCall) -> ToolResult: ...

    async def close(self) -> None: ...

    def final_reward(self) -> float | None:
        """The episode's reward from the environment itself once it ends (None: use the step rewards)."""
        ...


class ToolEnvironment(Protocol):
    name: str
    max_sessions: int  # episodes open at once
    settings: MultiTurnSettings  # the job's turns and reward mode
    report: Callable[[list[str]], None] | None  # told each batch's failed episodes (the job's events)

    async def open(self, row: Mapping[str, Any]) -> ToolSession: ...

    async def tools(self, session: ToolSession) -> list[dict[str, Any]]:
        """The tools as chat templates take them (`{"type": "function", "function": {name, description,
        parameters}}`), read from an open session."""
        ...


def _clip(text: str) -> str:
    if len(text) <= MAX_TOOL_TEXT_CHARS:
        return text
    return text[:MAX_TOOL_TEXT_CHARS] + f"... [cut at {MAX_TOOL_TEXT_CHARS} characters]"


# --- OpenEnv over its WebSocket -----------------------------------------------------------------


class _OpenEnvSession:
    def __init__(self, episode: Episode) -> None:
        self.episode = episode

    async def call(self, call: ToolCall) -> ToolResult:
        observation = await self.episode.step(
            {"type": "call_tool", "tool_name": call.name, "arguments": call.arguments}
        )
        body = observation.observation
        error = body.get("error")
        if error:
            message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            return ToolResult(_clip(f"error: {message}"), observation.reward, observation.done, str(message))
        return ToolResult(_clip(_result_text(body.get("result"))), observation.reward, observation.done)

    async def list_tools(self) -> list[dict[str, Any]]:
        observation = await self.episode.step({"type": "list_tools"})
        tools = observation.observation.get("tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
            raise EpisodeFailed(f"{self.episode.config.environment_id}: list_tools answered no tool list")
        return [
            {"type": "function", "function": {
                "name": tool["name"],
                "description": str(tool.get("description") or ""),
                "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
            }}
            for tool in tools
        ]

    async def close(self) -> None:
        await self.episode.close()

    def final_reward(self) -> float | None:
        return None


def _result_text(result: object) -> str:
    """An MCP tool result as text: its text content, else its data, else the result as JSON."""
    if isinstance(result, dict):
        content = result.get("content")
        if isinstance(content, list):
            texts = [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
            if texts:
                return "\n".join(texts)
        if "data" in result and result["data"] is not None:
            data = result["data"]
            return data if isinstance(data, str) else json.dumps(data)
    return result if isinstance(result, str) else json.dumps(result)


class OpenEnvEnvironment:
    """A registered OpenEnv server; at most `max_sessions` episodes open at once (its capacity and the job's)."""

    def __init__(
        self, config: EnvironmentConfig, max_sessions: int, settings: MultiTurnSettings = MultiTurnSettings(),
        report: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.config = config
        self.name = config.environment_id
        self.max_sessions = max_sessions
        self.settings = settings
        self.report = report

    async def open(self, row: Mapping[str, Any]) -> ToolSession:
        episode, _ = await open_episode(self.config, row)
        return _OpenEnvSession(episode)

    async def tools(self, session: ToolSession) -> list[dict[str, Any]]:
        assert isinstance(session, _OpenEnvSession)
        return await session.list_tools()


# --- a Python class in this process (TRL's environment_factory contract) --------------------------------------


def _schema(method: Callable[..., Any]) -> dict[str, Any]:
    """A method's tool schema from its signature, type hints and docstring."""
    hints = typing.get_type_hints(method)
    kinds = {str: "string", int: "integer", float: "number", bool: "boolean"}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, parameter in inspect.signature(method).parameters.items():
        if name == "self":
            continue
        properties[name] = {"type": kinds.get(hints.get(name, str), "string")}
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "function", "function": {
        "name": method.__name__,
        "description": inspect.getdoc(method) or "",
        "parameters": {"type": "object", "properties": properties, "required": required},
    }}


class _LocalSession:
    def __init__(self, target: Any, names: list[str]) -> None:
        self.target = target
        self.names = names

    async def call(self, call: ToolCall) -> ToolResult:
        if call.name not in self.names:
            return ToolResult(f"error: unknown tool {call.name!r}", error=f"unknown tool {call.name!r}")
        try:
            value = getattr(self.target, call.name)(**call.arguments)
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:  # the tool's own failure: the policy reads it, as in TRL
            return ToolResult(_clip(f"error: {exc}"), error=str(exc))
        return ToolResult(_clip(value if isinstance(value, str) else json.dumps(value, default=str)))

    async def close(self) -> None:
        close = getattr(self.target, "close", None)
        if callable(close):
            await asyncio.to_thread(close)

    def final_reward(self) -> float | None:
        get_reward = getattr(self.target, "get_reward", None)
        return None if get_reward is None else float(get_reward())


class LocalEnvironment:
    """`cls()` per episode, in this process."""

    def __init__(self, cls: type, max_sessions: int = 64, settings: MultiTurnSettings = MultiTurnSettings()) -> None:
        self.cls = cls
        self.names = public_tools(cls)
        self.name = cls.__name__
        self.max_sessions = max_sessions
        self.settings = settings
        self.report: Callable[[list[str]], None] | None = None  # failures show in the metrics (env/errors)

    async def open(self, row: Mapping[str, Any]) -> ToolSession:
        target = self.cls()
        try:
            target.reset(**row)
        except Exception as exc:
            raise EpisodeFailed(f"{self.name}.reset: {exc}") from exc
        return _LocalSession(target, self.names)

    async def tools(self, session: ToolSession) -> list[dict[str, Any]]:
        return [_schema(getattr(self.cls, name)) for name in self.names]
