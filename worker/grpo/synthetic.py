"""Small synthetic tasks with exact answers: the warm model's supervised data, the demo's and the benchmark's.

Torch-free (the demo's CLI process writes datasets from it). Every task is a finite list of
(question, answer) items; a fixed, seeded share of each task is *held out*: never shown during the
warm model's supervised training, used as the evaluation set of RL runs. An ordered pair is held out
only in one order (the other order stays in training), and an item is held out only when another item
has the same answer, so every held-out answer is one the model has produced for some training prompt:
RL can sharpen a preference that exists, it cannot invent one. Tasks whose answers are all distinct
(copy, repeat, next_letter) are therefore trained on in full: they are skills to keep (a retain set).

Prompts are chat messages (one user turn); the tiny tokenizer's chat template renders them as
``user: <question>\\nassistant: ``.
"""

from __future__ import annotations

import random
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

TaskName = Literal["larger", "smaller", "add", "next_letter", "repeat", "copy"]
TASKS: tuple[TaskName, ...] = ("larger", "smaller", "add", "next_letter", "repeat", "copy")

# Share of a task's items held out of supervised training (the RL eval set comes from them).
HELD_OUT_FRACTION = 1 / 3
_SPLIT_SEED = 1234  # fixed: the split must not move with the warm model's training seed


@dataclass(frozen=True)
class Item:
    """One task instance: the user's question and the exact expected answer."""

    task: TaskName
    question: str
    answer: str

    def row(self) -> dict[str, object]:
        """A dataset row: chat prompt, the answer column exact_match compares with, and the task name."""
        return {"prompt": [{"role": "user", "content": self.question}], "answer": self.answer, "task": self.task}


def _larger() -> list[Item]:
    return [Item("larger", f"Larger of {a} and {b}?", str(max(a, b))) for a in range(10) for b in range(10) if a != b]


def _smaller() -> list[Item]:
    return [Item("smaller", f"Smaller of {a} and {b}?", str(min(a, b))) for a in range(10) for b in range(10) if a != b]


def _add() -> list[Item]:
    return [Item("add", f"{a}+{b}=?", str(a + b)) for a in range(10) for b in range(10)]


def _next_letter() -> list[Item]:
    letters = string.ascii_lowercase
    return [Item("next_letter", f"Letter after {x}?", y) for x, y in zip(letters, letters[1:], strict=False)]


def _repeat() -> list[Item]:
    return [Item("repeat", f"Repeat {c} {n} times.", c * n) for c in "abcdefghij" for n in range(1, 6)]


def _copy() -> list[Item]:
    return [Item("copy", f"Copy {a}{b}.", f"{a}{b}") for a in "0123456789" for b in "abcde"]


_BUILDERS: dict[TaskName, Callable[[], list[Item]]] = {
    "larger": _larger,
    "smaller": _smaller,
    "add": _add,
    "next_letter": _next_letter,
    "repeat": _repeat,
    "copy": _copy,
}


def _order_free_key(item: Item) -> str:
    """Items that are the same question with the operands swapped share a key (only one side is held out)."""
    digits = sorted(ch for ch in item.question if ch.isdigit())
    return f"{item.task}:{''.join(digits)}" if item.task in ("larger", "smaller", "add") else item.question


def split(task: TaskName) -> tuple[list[Item], list[Item]]:
    """(train items, held-out items) of `task`, the same on every call."""
    items = _BUILDERS[task]()
    rng = random.Random(f"{_SPLIT_SEED}:{task}")
    rng.shuffle(items)
    answer_counts = Counter(item.answer for item in items)
    held_out: list[Item] = []
    seen_keys: set[str] = set()
    target = int(len(items) * HELD_OUT_FRACTION)
    for item in items:
        key = _order_free_key(item)
        # The first of a swapped pair may go; an answer that only one item has stays in training.
        if len(held_out) < target and key not in seen_keys and answer_counts[item.answer] > 1:
            held_out.append(item)
        seen_keys.add(key)
    train = [item for item in items if item not in held_out]
    return train, held_out


def train_items(tasks: tuple[TaskName, ...] = TASKS) -> list[Item]:
    return [item for task in tasks for item in split(task)[0]]


def held_out_items(task: TaskName) -> list[Item]:
    return split(task)[1]
