"""Prompt datasets for training: loading JSONL files and a resumable, seeded prompt sampler.

The row format and its validation live in `contract.dataset_format` (torch-free, shared with
the service). This module adds the engine side: typed rows and the order in which prompts are drawn.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from contract.dataset_format import DatasetIssue, JsonlValidator, Prompt, prompt_column


class DatasetError(ValueError):
    """A dataset file is missing or malformed. The message lists the offending lines."""

    def __init__(self, source: str, issues: list[DatasetIssue], num_errors: int | None = None) -> None:
        self.source = source
        self.issues = issues
        self.num_errors = len(issues) if num_errors is None else num_errors
        details = "\n".join(f"  {issue}" for issue in issues)
        hidden = self.num_errors - len(issues)
        if hidden > 0:
            details += f"\n  ... and {hidden} more problem(s)"
        super().__init__(f"invalid dataset {source}:\n{details}")


@dataclass(frozen=True)
class PromptRow:
    """One training prompt and the row's other columns (given to reward sources as extras)."""

    prompt: Prompt
    extras: dict[str, Any] = field(default_factory=dict)


def parse_jsonl_lines(lines: Iterable[bytes | str], *, source: str = "<lines>") -> list[PromptRow]:
    """Parse and validate JSONL lines; raises DatasetError listing up to 20 problems."""
    validator = JsonlValidator()
    rows: list[PromptRow] = []
    for raw in lines:
        row = validator.feed(raw)
        if row is not None:
            prompt = row.pop(prompt_column(row) or "prompt")
            rows.append(PromptRow(prompt=prompt, extras=row))
    summary = validator.finish()
    if not summary.ok:
        raise DatasetError(source, summary.errors, summary.num_errors)
    return rows


def load_jsonl(path: Path) -> list[PromptRow]:
    """Load a JSONL prompt dataset from disk."""
    try:
        with path.open("rb") as handle:
            return parse_jsonl_lines(handle, source=str(path))
    except OSError as exc:
        raise DatasetError(str(path), [DatasetIssue(0, f"cannot read file: {exc.strerror or exc}")]) from exc


class PromptSampler:
    """Draws dataset indices in a seeded random order, reshuffled every epoch.

    The order of epoch ``e`` is a pure function of ``(seed, e)``, so the cursor ``(epoch, position)``
    is all a checkpoint needs to continue exactly where it stopped.
    """

    def __init__(self, num_rows: int, seed: int) -> None:
        if num_rows < 1:
            raise ValueError("a sampler needs at least one row")
        self.num_rows = num_rows
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def next_indices(self, count: int) -> list[int]:
        """The next ``count`` indices; crosses epoch boundaries (a prompt may then repeat in one batch)."""
        indices: list[int] = []
        while len(indices) < count:
            if self.position == self.num_rows:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(indices), self.num_rows - self.position)
            indices.extend(int(i) for i in self._order[self.position : self.position + take])
            self.position += take
        return indices

    def state_dict(self) -> dict[str, int]:
        return {"num_rows": self.num_rows, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != self.num_rows:
            raise ValueError(
                f"the checkpoint was trained on {state['num_rows']} prompts but the dataset has {self.num_rows}"
            )
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._permutation(self.epoch)
