"""Tool calls in a policy's turn: which format a tokenizer's chat template speaks, and parsing calls out of text.

A multi-turn rollout needs two things of the chat template: that it renders `tools=` (so the policy sees the
tools) and a known way the model writes a call. Two formats cover the open models users train:
- `hermes` (Qwen2.5, Qwen3, SmolLM3, Hermes and the builtin tool model): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a turn may hold several.
- `llama3` (Llama 3.1, 3.2, 3.3): the turn is one JSON object `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`.
A template that shows neither has no tool format: the job fails at start with that reason rather than training
a policy whose calls are never read. Parsing is strict JSON; a call that does not parse is returned as an error
for the tool message (the policy reads it and may try again, as in TRL), never silently dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

ToolFormat = Literal["hermes", "llama3"]

_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


# A Hermes-format template on the builtin "role: content" lines (worker.grpo.tiny): the tools are listed by name,
# an assistant's calls follow its text as `<tool_call>{json}</tool_call>`, a tool result is a `tool:` line.
HERMES_LINES_TEMPLATE = (
    "{% if tools %}{{ 'system: tools ' }}{% for tool in tools %}{{ tool['function']['name'] }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ 'assistant: ' + (message['content'] or '') }}"
    "{% for call in message.tool_calls or [] %}{{ '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}"
    "{% endfor %}{{ eos_token + '\\n' }}"
    "{% else %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


class NoToolFormat(ValueError):
    """The tokenizer's chat template renders no tool calls this engine can read."""


@dataclass(frozen=True)
class ToolCall:
    """One call the policy wrote: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def as_message_call(self) -> dict[str, Any]:
        """The call as chat templates take it in an assistant message's `tool_calls`."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedTurn:
    """What a policy turn asked for: its calls, and the calls that did not parse (each with the reason)."""

    calls: list[ToolCall]
    errors: list[str]

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.errors)


def tool_format(chat_template: str | None) -> ToolFormat:
    """The tool-call format `chat_template` speaks; NoToolFormat if it has none."""
    if not chat_template:
        raise NoToolFormat("the tokenizer has no chat template: a multi-turn job needs one that renders tools")
    if "<tool_call>" in chat_template:
        return "hermes"
    if _PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3"
    raise NoToolFormat(
        "the tokenizer's chat template has no tool-call format this engine reads (Hermes/Qwen `<tool_call>` or "
        "Llama 3 JSON calls): give the job a model whose template renders tools"
    )


def parse_turn(text: str, fmt: ToolFormat) -> ParsedTurn:
    """The tool calls in one policy turn's text (special tokens kept, so the markers are visible)."""
    if fmt == "hermes":
        bodies = [match.group(1) for match in _HERMES_CALL.finditer(text)]
        return _parsed(bodies, arguments_key="arguments")
    body = text.split(_PYTHON_TAG, 1)[1] if _PYTHON_TAG in text else text
    body = _strip_end_tokens(body)
    if not body.startswith("{"):
        return ParsedTurn([], [])  # a plain answer: Llama 3 calls are a whole turn of JSON
    return _parsed([body], arguments_key="parameters")


def _strip_end_tokens(text: str) -> str:
    for token in ("<|eom_id|>", "<|eot_id|>", "<|end_of_text|>"):
        text = text.replace(token, "")
    return text.strip()


def _parsed(bodies: list[str], *, arguments_key: str) -> ParsedTurn:
    calls: list[ToolCall] = []
    errors: list[str] = []
    for body in bodies:
        try:
            calls.append(_call(json.loads(body), arguments_key))
        except (ValueError, TypeError) as exc:
            errors.append(f"tool call not understood: {exc}")
    return ParsedTurn(calls, errors)


def _call(value: object, arguments_key: str) -> ToolCall:
    if not isinstance(value, dict):
        raise TypeError("a call is a JSON object with a name")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise TypeError("a call needs a string 'name'")
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise TypeError(f"{arguments_key!r} of {name!r} is not a JSON object")
    return ToolCall(name, arguments)
