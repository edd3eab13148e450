"""`builtin:tiny-tools`: the tiny architecture with a Hermes tool-call chat template, warm-started offline on
two-turn calculator conversations (worker.grpo.tool_tasks).

The multi-turn counterpart of `builtin:tiny-instruct` (worker.grpo.warm, whose module docstring says why RL needs a
warm start): supervised on `user: a*b=?` -> `multiply` call -> tool result -> `submit` call, loss on the policy's
turns only (never the tool's), stopped early so that on held-out questions the model calls the tools in the right
shape but copies numbers only partly right: what an RL run with the calculator environment then improves.
Cached under `<cache>/tiny-tools-<recipe hash>`, like the instruct model.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from worker.grpo.tiny import TOOLS_PRESET, build_tokenizer
from worker.grpo.tool_calls import HERMES_LINES_TEMPLATE
from worker.grpo.tool_tasks import ToolItem, split, tool_schemas
from worker.grpo.warm import WarmRecipe, build_warm_model

TOOLS_RECIPE = WarmRecipe(tasks=(), steps=150, batch_size=16, data_version=102)  # bump when the data changes


def tools_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = HERMES_LINES_TEMPLATE
    return tokenizer


def build_tools_model(cache_dir: Path, recipe: WarmRecipe = TOOLS_RECIPE) -> Path:
    """The warm tool model of `recipe` under `cache_dir`, trained now if not cached."""
    tokenizer = tools_tokenizer()
    train, _ = split()
    return build_warm_model(
        Path(cache_dir) / f"{TOOLS_PRESET}-{recipe.digest()}", recipe, tokenizer,
        lambda rng: conversation_batch(tokenizer, [rng.choice(train) for _ in range(recipe.batch_size)], rng),
    )


def conversation(
    tokenizer: PreTrainedTokenizerFast, item: ToolItem, value: float | None = None
) -> tuple[list[int], list[int]]:
    """The solved conversation's ids and a 0/1 label mask: 1 on the policy's two turns (their EOS included).
    `value`: what the tool answers in it (default the product)."""
    multiply, result, submit = item.calls(value)
    tools: list[dict[Any, Any] | Callable[..., Any]] = list(tool_schemas())
    prompt = str(tokenizer.apply_chat_template(
        [{"role": "user", "content": item.question}], tools=tools, tokenize=False, add_generation_prompt=True))
    suffix = f"\ntool: {result}\nassistant: "  # what the template renders for the tool message after a call
    eos = [int(tokenizer.eos_token_id)]
    parts = [
        (tokenizer(prompt)["input_ids"], 0),  # BOS added by the post-processor
        (tokenizer(multiply, add_special_tokens=False)["input_ids"] + eos, 1),
        (tokenizer(suffix, add_special_tokens=False)["input_ids"], 0),
        (tokenizer(submit, add_special_tokens=False)["input_ids"] + eos, 1),
    ]
    ids = [token for part, _ in parts for token in part]
    labels = [flag for part, flag in parts for _ in part]
    return ids, labels


def conversation_batch(
    tokenizer: PreTrainedTokenizerFast, batch: list[ToolItem], rng: random.Random | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, mask, labels), each (B, T); labels are -100 outside the policy's turns. With `rng` the
    tool answers a random number instead of the product: the answer is then only in the tool's message, so the
    model learns to copy it from there rather than recall a product from the question (which fails on every
    question it has not seen)."""
    rows = [conversation(tokenizer, item, None if rng is None else float(rng.randint(0, 999))) for item in batch]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), int(tokenizer.pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for row, (ids, flags) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        keep = torch.tensor(flags, dtype=torch.bool)
        labels[row, : len(ids)] = torch.where(keep, torch.tensor(ids), torch.tensor(-100))
    return input_ids, attention_mask, labels
