"""A two-turn tool task with exact answers: the builtin tool model's supervised data, the multi-turn tests' and the
learning benchmark's.

"What is a*b?" for a two-digit a and a one-digit b: the tiny model cannot multiply, so the answer needs the
`multiply` tool of the example calculator (examples/environments/calculator.py): call it with the question's
numbers, read the result, `submit` it. A fixed, seeded third of the items is held out of supervised training
(the held-out success of an RL run is measured on them). Torch-free.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

TOOLS = ("add", "multiply", "submit")  # the calculator's tools, in the order it lists them
HELD_OUT_FRACTION = 1 / 3
_SPLIT_SEED = 4321


@dataclass(frozen=True)
class ToolItem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}*{self.b}=?"

    @property
    def answer(self) -> str:
        return str(self.a * self.b)

    def row(self) -> dict[str, Any]:
        """A dataset row: a chat prompt, and the fields the calculator's `reset` takes."""
        return {"prompt": [{"role": "user", "content": self.question}], "question": self.question,
                "answer": self.answer}

    def calls(self, value: float | None = None) -> tuple[str, str, str]:
        """The turns that solve it: the multiply call, the tool's result as the calculator writes it (`value`, by
        default the product), the submit of that result."""
        result = str(float(self.a * self.b) if value is None else value)
        multiply = {"name": "multiply", "arguments": {"a": self.a, "b": self.b}}
        submit = {"name": "submit", "arguments": {"answer": result}}
        return (f"<tool_call>{json.dumps(multiply)}</tool_call>", result, f"<tool_call>{json.dumps(submit)}</tool_call>")


def items() -> list[ToolItem]:
    return [ToolItem(a, b) for a in range(2, 30) for b in range(2, 10)]


def split() -> tuple[list[ToolItem], list[ToolItem]]:
    """(train items, held-out items), the same on every call."""
    shuffled = items()
    random.Random(_SPLIT_SEED).shuffle(shuffled)
    cut = int(len(shuffled) * HELD_OUT_FRACTION)
    return shuffled[cut:], shuffled[:cut]


def tool_schemas() -> list[dict[str, Any]]:
    """The calculator's tools as chat templates take them (names are all the builtin template shows)."""
    return [{"type": "function", "function": {"name": name, "description": "", "parameters": {}}} for name in TOOLS]
