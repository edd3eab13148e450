"""Host a Python environment class as an OpenEnv server (`grpo envs serve module:Class`).

The class follows TRL's `environment_factory` contract, so an environment written for TRL serves unchanged:
- `reset(self, **row) -> str | None` starts an episode from a training row's fields and may return the text of the
  first observation;
- every other public method is a tool: its name, type hints and docstring are the tool's schema;
- an optional `get_reward(self) -> float` is the episode's reward so far, reported with every tool result (a job
  that takes the final step reward gets its value when the episode ends).
One instance per WebSocket session. The server is OpenEnv's own (`create_app`), with MCP tool actions
(`list_tools`, `call_tool`), so anything that speaks OpenEnv can use it.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

from contract.environment_factory import public_tools


def hosted(cls: type) -> type[MCPEnvironment]:
    """An OpenEnv environment whose sessions each wrap a new `cls()`."""
    names = public_tools(cls)

    class Hosted(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            self.target = cls()
            mcp = FastMCP(cls.__name__)
            for name in names:
                mcp.tool(name=name)(getattr(self.target, name))
            super().__init__(mcp)
            self._state = State(episode_id=None, step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> Observation:
            text = self.target.reset(**row)
            self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
            return Observation(done=False, reward=None, metadata={} if text is None else {"text": str(text)})

        async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
            return self._rewarded(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

        def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
            return self._rewarded(action, super().step(action, timeout_s=timeout_s, **kwargs))

        def _rewarded(self, action: Action, observation: Observation) -> Observation:
            self._state.step_count += 1
            if isinstance(action, CallToolAction) and callable(getattr(self.target, "get_reward", None)):
                observation.reward = float(self.target.get_reward())
            return observation

        def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
            return Observation(done=False, reward=None, metadata={"error": f"unknown action {type(action).__name__}"})

        @property
        def state(self) -> State:
            return self._state

    Hosted.__name__ = Hosted.__qualname__ = f"Hosted{cls.__name__}"
    return Hosted


def hosted_app(cls: type, max_sessions: int) -> FastAPI:
    return create_app(hosted(cls), CallToolAction, CallToolObservation, env_name=cls.__name__,
                      max_concurrent_envs=max_sessions)
