"""Failures of the datasets domain."""

from __future__ import annotations

from typing import Any

from service.kit.errors import Conflict, ValidationFailed


class DatasetInvalid(ValidationFailed):
    """The upload is not a valid prompt dataset. `details`: [{line, error}] (line None = the whole file)."""

    code = "dataset_invalid"

    def __init__(self, problems: list[dict[str, Any]], total: int) -> None:
        first = problems[0] if problems else {"line": None, "error": "invalid dataset"}
        where = f"line {first['line']}: " if first["line"] else ""
        more = (
            f" (and {total - 1} more problem(s); the first {len(problems)} are listed)" if total > 1 else ""
        )
        super().__init__(f"dataset is invalid: {where}{first['error']}{more}", details=problems)


class DatasetInUse(Conflict):
    code = "dataset_in_use"
