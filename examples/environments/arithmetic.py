"""The calculator as a TRL-style environment class (`environment_factory` contract), for `grpo train` without a
server (examples/tools.yaml) or served over OpenEnv by `grpo envs serve examples.environments.arithmetic:Arithmetic`.

The policy is asked `a*b=?`; it may `multiply` (or `add`), then `submit` its answer. The episode's reward
(`get_reward`) is 1.0 once the submitted answer equals the row's as a number, else 0.0.
"""

from __future__ import annotations


class Arithmetic:
    def __init__(self) -> None:
        self.expected = ""
        self.submitted: str | None = None

    def reset(self, **row: str) -> None:
        self.expected, self.submitted = str(row.get("answer", "")), None

    def add(self, a: float, b: float) -> float:
        """Add two numbers."""
        return float(a) + float(b)

    def multiply(self, a: float, b: float) -> float:
        """Multiply two numbers."""
        return float(a) * float(b)

    def submit(self, answer: str) -> str:
        """Give the final answer."""
        self.submitted = str(answer).strip()
        return self.submitted

    def get_reward(self) -> float:
        if self.submitted is None:
            return 0.0
        try:
            return 1.0 if float(self.submitted) == float(self.expected) else 0.0
        except ValueError:
            return 1.0 if self.submitted == self.expected else 0.0
