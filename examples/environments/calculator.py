"""A tool environment served over OpenEnv's protocol: the policy answers arithmetic questions with a calculator.

Each episode starts from one training row (`reset(question=..., answer=...)`); the policy calls the `add` and
`multiply` tools as often as it likes and ends the episode with `submit(answer)`, which is rewarded 1.0 when the
answer equals the row's (as numbers when both are) and 0.0 otherwise. Tool calls themselves earn nothing.

Serve it (OpenEnv's own FastAPI app; `/health`, `/schema`, `/metadata` and the stateful `WS /ws`):

    uvicorn examples.environments.calculator:app --host 127.0.0.1 --port 8010

and register `http://127.0.0.1:8010` with `POST /v1/environments` (docs/environments.md).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

SUBMIT = "submit"


def same_answer(submitted: str, expected: str) -> bool:
    """Equal as numbers when both are ("56.0" is 56), else as text."""
    try:
        return float(submitted) == float(expected)
    except ValueError:
        return submitted == expected


class CalculatorEnvironment(MCPEnvironment):
    """Tools `add`, `multiply` and `submit`; one episode per WebSocket session (sessions share nothing)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("calculator")

        @mcp.tool()
        def add(a: float, b: float) -> float:
            """Add two numbers."""
            return a + b

        @mcp.tool()
        def multiply(a: float, b: float) -> float:
            """Multiply two numbers."""
            return a * b

        @mcp.tool(name=SUBMIT)
        def submit(answer: str) -> str:
            """Give the final answer; ends the episode."""
            return answer.strip()

        super().__init__(mcp)
        self._answer: str | None = None
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> Observation:
        self._answer = str(row["answer"]).strip() if "answer" in row else None
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return Observation(done=False, reward=None, metadata={"question": row.get("question")})

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        return self._scored(action, observation)

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    def _scored(self, action: Action, observation: Observation) -> Observation:
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == SUBMIT:
            submitted = str(action.arguments.get("answer", "")).strip()
            observation.done = True
            observation.reward = 1.0 if self._answer is not None and same_answer(submitted, self._answer) else 0.0
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    CalculatorEnvironment,
    CallToolAction,
    CallToolObservation,
    env_name="calculator",
    max_concurrent_envs=int(os.environ.get("CALCULATOR_MAX_SESSIONS", "8")),
)
