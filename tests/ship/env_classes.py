"""Environment classes `grpo envs serve` must refuse (tests/ship/test_env_serve.py serves them by name)."""

from __future__ import annotations

from typing import Any


class Steps:
    """A tool named like OpenEnv's `step` message."""

    def reset(self, **row: Any) -> None:
        return None

    def step(self) -> str:
        return ""


class NoReset:
    """No way to start an episode."""

    def look(self) -> str:
        return ""
