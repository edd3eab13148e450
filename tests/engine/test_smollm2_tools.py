"""`builtin:smollm2-135m-instruct`'s tool chat template (worker.grpo.pretrained.SMOLLM2_TOOLS_TEMPLATE).

- Without tools it renders exactly what the GGUF's own SmolLM2 template renders (single-turn jobs' prompts do
  not change), and the conversion refuses a template that does not.
- With tools it lists their schemas in the system turn, speaks the Hermes format the multi-turn engine parses,
  and renders a structured tool call exactly as examples/smollm2_tools writes its worked examples as text.
- A tool result after a policy turn is the suffix `<|im_start|>tool ... <|im_start|>assistant` (what a
  multi-turn job appends, masked), computed by the engine from the template.
"""

from __future__ import annotations

import asyncio
import json
import os
import runpy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contract.config import GRPOConfig
from examples.environments.arithmetic import Arithmetic
from worker.grpo.data import PromptRow
from worker.grpo.environment import LocalEnvironment, MultiTurnSettings
from worker.grpo.multi_turn import MultiTurnRollout
from worker.grpo.pretrained import SMOLLM2_TOOLS_TEMPLATE, build_smollm2, extend_chat_template, smollm2_gguf
from worker.grpo.tool_calls import ToolCall, parse_turn, tool_format

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TOOLS: list[dict[Any, Any] | Callable[..., Any]] = [{"type": "function", "function": {
    "name": "multiply", "description": "Multiply two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
}}]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "2 + 3 ="}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "line\nbreak"}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    cache = Path(os.environ.get("GRPO_TEST_MODEL_CACHE", Path.home() / ".cache" / "grpo" / "models"))
    return AutoTokenizer.from_pretrained(build_smollm2(cache))


@pytest.fixture(scope="module")
def gguf_tokenizer() -> PreTrainedTokenizerBase:
    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_without_tools_it_renders_what_smollm2s_own_template_does(
    tokenizer: PreTrainedTokenizerBase, gguf_tokenizer: PreTrainedTokenizerBase
) -> None:
    assert tokenizer.chat_template == SMOLLM2_TOOLS_TEMPLATE != gguf_tokenizer.chat_template
    for messages in CONVERSATIONS:
        for generation_prompt in (False, True):
            ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            own = gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            assert ours == own


def test_the_conversion_refuses_a_template_that_changes_prompts_without_tools(
    gguf_tokenizer: PreTrainedTokenizerBase,
) -> None:
    without_default_system = SMOLLM2_TOOLS_TEMPLATE.replace("You are a helpful AI assistant named SmolLM", "You are")
    with pytest.raises(ValueError, match="renders"):
        extend_chat_template(gguf_tokenizer, without_default_system)
    assert gguf_tokenizer.chat_template != without_default_system


def test_with_tools_it_lists_schemas_and_speaks_hermes(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tool_format(tokenizer.chat_template) == "hermes"
    rendered = str(tokenizer.apply_chat_template(
        [{"role": "user", "content": "7*2=?"}], tools=TOOLS, tokenize=False, add_generation_prompt=True))
    system = rendered.split("<|im_end|>")[0]
    schema = TOOLS[0]
    assert isinstance(schema, dict)
    assert "<tools>\n" + json.dumps(schema["function"]) + "\n</tools>" in system
    assert rendered.endswith("<|im_start|>user\n7*2=?<|im_end|>\n<|im_start|>assistant\n")


def test_a_structured_call_renders_as_the_examples_worked_turns(tokenizer: PreTrainedTokenizerBase) -> None:
    make_data = runpy.run_path(str(REPO / "examples" / "smollm2_tools" / "make_data.py"))  # the example's script
    worked = make_data["worked_example"](7, 2)[:3]  # user, the multiply call as text, the result
    structured = [worked[0], {"role": "assistant", "content": "", "tool_calls": [
        ToolCall("multiply", {"a": 7, "b": 2}).as_message_call()]}, worked[2]]
    assert tokenizer.apply_chat_template(worked, tokenize=False) == tokenizer.apply_chat_template(
        structured, tokenize=False)
    parsed = parse_turn(worked[1]["content"] + "<|im_end|>", "hermes")
    assert parsed.calls == [ToolCall("multiply", {"a": 7, "b": 2})] and not parsed.errors


def test_a_tool_result_is_appended_as_a_tool_turn(tokenizer: PreTrainedTokenizerBase) -> None:
    """The policy's turns are scripted (a sampler that returns fixed ids); the engine runs the call on the example
    calculator and appends the result's tokens between them: exactly the template's tool turn and the next
    generation prompt, outside the policy's mask."""
    call = tokenizer('<tool_call>{"name": "multiply", "arguments": {"a": 7, "b": 2}}</tool_call>',
                     add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    answer = tokenizer("14.0", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    turns = iter([call, answer])

    def sample(
        sequences: list[list[int]], budgets: list[int], seeds: list[int]
    ) -> list[tuple[list[int], list[float] | None]]:
        ids = next(turns)
        return [(ids, None) for _ in sequences]

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    config = GRPOConfig(num_generations=2, prompts_per_step=1, max_steps=1, max_completion_length=200)
    environment = LocalEnvironment(Arithmetic, settings=MultiTurnSettings(max_turns=2))
    engine = MultiTurnRollout(
        tokenizer, config, environment, sample,
        lambda coro: asyncio.run_coroutine_threadsafe(coro, loop), [tokenizer.eos_token_id],
    )
    try:
        rollout, _ = engine.generate([PromptRow([{"role": "user", "content": "7*2=?"}], {"answer": "14"})], [0])
    finally:
        loop.call_soon_threadsafe(loop.stop)
    kept = rollout.completion_mask[0].bool()
    ids = rollout.completion_ids[0][kept].tolist()
    suffix = ids[len(call): len(ids) - len(answer)]
    assert ids[: len(call)] == call and ids[len(ids) - len(answer):] == answer
    assert tokenizer.decode(suffix) == "\n<|im_start|>tool\n14.0<|im_end|>\n<|im_start|>assistant\n"
    assert rollout.tool_mask is not None
    assert rollout.tool_mask[0][kept].tolist() == [1] * len(call) + [0] * len(suffix) + [1] * len(answer)
