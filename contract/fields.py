"""Field types for values that cross a boundary (REST, gRPC, the job spec) and end up in the database or
in an HTTP request: each refuses, as a validation error naming the field, what would otherwise fail later.

- `Text`: a string without NUL characters or unpaired surrogates. PostgreSQL text cannot hold U+0000 (SQLite
  can), and a lone surrogate (JSON allows the escape `"\ud800"`) cannot be encoded as UTF-8 for any database,
  response or outgoing request; either would fail there, as a 500.
- `Int32` / `Int64`: integers that fit an INTEGER / BIGINT column (steps and counts / row ids). Python ints
  are unbounded; PostgreSQL refuses the rest with "out of range".
- `HeaderValue`: a value an HTTP client can send as a header field: visible ASCII, space and tab
  (RFC 9110 field-value without obs-text), no leading or trailing whitespace.

Pydantic-only and torch-free: the engine's JobSpec and the service's schemas both use them.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

# JSON Schema patterns (ECMA 262) documenting the same rules in OpenAPI.
# Text's pattern names NUL only: unpaired surrogates are not Unicode scalar values, so a JSON Schema string
# cannot hold one anyway (and regex engines refuse them in a character class).
TEXT_PATTERN = "^[^\\u0000]*$"
_SURROGATE = re.compile("[\ud800-\udfff]")
HEADER_VALUE_PATTERN = "^([\\x21-\\x7e]([\\t\\x20-\\x7e]*[\\x21-\\x7e])?)?$"


def text_problem(value: str) -> str | None:
    """Why `value` is not `Text`, or None."""
    if "\x00" in value:
        return "contains a NUL (U+0000) character"
    if _SURROGATE.search(value):
        return "contains an unpaired surrogate (U+D800 to U+DFFF): not valid Unicode text"
    return None


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN/inf: a non-finite number is stored as "no value"."""
    return None if value is None or not math.isfinite(value) else value


def storable_text(value: str) -> str:
    """`value` with what a database cannot store (NUL, unpaired surrogates) replaced by U+FFFD: for text that is
    recorded rather than validated, such as a model's completion or a reward endpoint's error message."""
    return _SURROGATE.sub("\ufffd", value.replace("\x00", "\ufffd"))


def storable_json(value: Any) -> Any:
    """`storable_text` applied to every string (keys included) of a JSON value."""
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_json(k): storable_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable_json(v) for v in value]
    return value


def _storable(value: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _header_value(value: str) -> str:
    for ch in value:
        if not (ch == "\t" or " " <= ch <= "~"):
            raise ValueError(
                f"character {ch!r} is not allowed in an HTTP header value (visible ASCII, space and tab only)"
            )
    if value != value.strip(" \t"):
        raise ValueError("an HTTP header value cannot start or end with whitespace")
    return value


class _Checked:
    """Annotated metadata: run `check` after str validation and add `pattern` to the JSON schema."""

    def __init__(self, check: Any, pattern: str) -> None:
        self.check = check
        self.pattern = pattern

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler(schema)
        json_schema.setdefault("pattern", self.pattern)
        return json_schema


Text = Annotated[str, _Checked(_storable, TEXT_PATTERN)]
HeaderValue = Annotated[str, _Checked(_header_value, HEADER_VALUE_PATTERN)]
class _Range:
    """Annotated metadata: an integer range checked after the field's own constraints, and added to the JSON
    schema where the field's own bounds are wider. Not `Field(ge=, le=)`: a field's `Field(ge=1)` would
    replace that bound instead of adding to it."""

    def __init__(self, low: int, high: int) -> None:
        self.low = low
        self.high = high

    def check(self, value: int) -> int:
        if not self.low <= value <= self.high:
            raise ValueError(f"must be between {self.low} and {self.high}")
        return value

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler(schema)
        json_schema["minimum"] = max(json_schema.get("minimum", self.low), self.low)
        json_schema["maximum"] = min(json_schema.get("maximum", self.high), self.high)
        return json_schema


Int32 = Annotated[int, _Range(-INT32_MAX - 1, INT32_MAX)]
Int64 = Annotated[int, _Range(INT64_MIN, INT64_MAX)]
