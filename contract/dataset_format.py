"""The JSONL prompt-dataset format and its validation.

Torch-free and dependency-light on purpose: the service validates uploaded datasets with
`validate_jsonl_lines` while streaming them, and the engine (`worker.grpo.data`) loads them
with the same rules, so a file the service accepted never fails later in a job.

Format: one JSON object per line with
- ``prompt``: a non-empty string, or a non-empty list of chat messages ``{"role": ..., "content": ...}``
  (rendered with the tokenizer's chat template); OpenAI's reinforcement fine-tuning format names the
  message list ``messages`` instead, which is read the same way when a row has no ``prompt``;
- any other columns: passed unchanged to reward sources as ``RewardInput.extras``.
At most ``MAX_COLUMNS`` columns per row and distinct columns in the file, names of at most
``MAX_COLUMN_NAME_CHARS`` characters.
Blank lines are skipped (they still count for line numbers).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from contract.fields import text_problem

MAX_REPORTED_ERRORS = 20
# Columns are listed with the dataset on every read and passed to every reward call: bounded per row and
# per dataset (distinct names), like their names. One line is also bounded (the service's MAX_LINE_BYTES).
MAX_COLUMNS = 1024
MAX_COLUMN_NAME_CHARS = 256
CHAT_ROLES = ("system", "user", "assistant", "tool")

Prompt = str | list[dict[str, str]]


@dataclass(frozen=True)
class DatasetIssue:
    """One problem found in a dataset. ``line`` is 1-based; 0 means the file as a whole."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


@dataclass
class DatasetSummary:
    """What validation learned about a dataset.

    ``errors`` holds at most ``MAX_REPORTED_ERRORS`` issues; ``num_errors`` counts all of them.
    """

    num_rows: int = 0
    columns: list[str] = field(default_factory=list)  # every column seen, in first-seen order
    errors: list[DatasetIssue] = field(default_factory=list)
    num_errors: int = 0

    @property
    def ok(self) -> bool:
        return self.num_errors == 0

    def describe_errors(self) -> str:
        """Human-readable list of the problems, one per line."""
        lines = [str(issue) for issue in self.errors]
        hidden = self.num_errors - len(self.errors)
        if hidden > 0:
            lines.append(f"... and {hidden} more problem(s)")
        return "\n".join(lines)


def check_prompt(prompt: Any) -> str | None:
    """Return why ``prompt`` is not a valid prompt, or None when it is."""
    if isinstance(prompt, str):
        if (problem := text_problem(prompt)) is not None:
            return f"'prompt' {problem}"
        return None if prompt.strip() else "'prompt' is an empty string"
    if not isinstance(prompt, list):
        return f"'prompt' must be a string or a list of messages, got {type(prompt).__name__}"
    if not prompt:
        return "'prompt' is an empty list of messages"
    for i, message in enumerate(prompt):
        problem = _check_message(message)
        if problem:
            return f"'prompt' message {i}: {problem}"
    return None


def _check_message(message: Any) -> str | None:
    if not isinstance(message, dict):
        return f"must be an object with 'role' and 'content', got {type(message).__name__}"
    unknown = sorted(set(message) - {"role", "content"})
    if unknown:
        return f"unexpected key(s) {', '.join(unknown)}"
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        return f"'role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}"
    if not isinstance(content, str):
        return f"'content' must be a string, got {type(content).__name__}"
    if (problem := text_problem(content)) is not None:
        return f"'content' {problem}"
    return None


class NonStandardNumber(ValueError):
    """NaN, Infinity or -Infinity: Python's json reads them, JSON has no such numbers."""


def _refuse_constant(name: str) -> Any:
    raise NonStandardNumber(name)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _encodable(row: Any) -> bool:
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_row(raw: bytes | str) -> tuple[dict[str, Any] | None, str | None]:
    """Parse one non-blank JSONL line. Returns (row, None) or (None, problem)."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return None, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"
    try:
        row = json.loads(raw, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc.msg} (column {exc.colno})"
    except NonStandardNumber as exc:
        return None, f"invalid JSON: {exc} is not a JSON number"
    # Rows travel on as JSON (to reward endpoints) and text (the database): a `\\udXXX` escape that decodes to
    # an unpaired surrogate would fail there. Checked only when the line has such an escape at all.
    if _SURROGATE_ESCAPE.search(raw) and not _encodable(row):
        return None, "not valid Unicode text: an escape decodes to an unpaired surrogate (U+D800 to U+DFFF)"
    if not isinstance(row, dict):
        return None, f"each line must be a JSON object, got {type(row).__name__}"
    if len(row) > MAX_COLUMNS:
        return None, f"{len(row)} columns; a row may have at most {MAX_COLUMNS}"
    for column in row:
        if len(column) > MAX_COLUMN_NAME_CHARS:
            return None, (
                f"column name {column[:32]!r}... is {len(column)} characters; the limit is {MAX_COLUMN_NAME_CHARS}"
            )
    column = prompt_column(row)
    if column is None:
        return None, "missing required column 'prompt' (or 'messages', OpenAI's chat format)"
    problem = check_prompt(row[column])
    if problem and column == "messages":
        problem = problem.replace("'prompt'", "'messages'", 1)
    return (None, problem) if problem else (row, None)


def prompt_column(row: dict[str, Any]) -> str | None:
    """The column holding the prompt: ``prompt``, else OpenAI's ``messages``."""
    if "prompt" in row:
        return "prompt"
    return "messages" if "messages" in row else None


class JsonlValidator:
    """Incremental validator: ``feed`` lines one at a time (e.g. while streaming an upload)."""

    def __init__(self, *, max_errors: int = MAX_REPORTED_ERRORS) -> None:
        self._max_errors = max_errors
        self._line = 0
        self._seen_columns: dict[str, None] = {}  # an ordered set
        self.summary = DatasetSummary()

    def feed(self, raw: bytes | str) -> dict[str, Any] | None:
        """Validate the next line; returns the parsed row, or None for a blank or invalid line."""
        self._line += 1
        if not raw.strip():
            return None
        row, problem = parse_row(raw)
        if row is None:
            self._add_issue(DatasetIssue(self._line, problem or "invalid row"))
            return None
        new = [column for column in row if column not in self._seen_columns]
        if len(self._seen_columns) + len(new) > MAX_COLUMNS:
            self._add_issue(DatasetIssue(
                self._line, f"brings the dataset to {len(self._seen_columns) + len(new)} distinct columns; "
                f"the limit is {MAX_COLUMNS}",
            ))
            return None
        self.summary.num_rows += 1
        for column in new:
            self._seen_columns[column] = None
            self.summary.columns.append(column)
        return row

    def finish(self) -> DatasetSummary:
        """Close the stream: an empty dataset is an error too."""
        if self.summary.num_rows == 0 and self.summary.num_errors == 0:
            self._add_issue(DatasetIssue(0, "the dataset has no rows"))
        return self.summary

    @property
    def line_number(self) -> int:
        return self._line

    def _add_issue(self, issue: DatasetIssue) -> None:
        self.summary.num_errors += 1
        if len(self.summary.errors) < self._max_errors:
            self.summary.errors.append(issue)


def validate_jsonl_lines(
    lines: Iterable[bytes | str], *, max_errors: int = MAX_REPORTED_ERRORS
) -> DatasetSummary:
    """Validate a whole JSONL stream (an open binary file iterates by line)."""
    validator = JsonlValidator(max_errors=max_errors)
    for raw in lines:
        validator.feed(raw)
    return validator.finish()
