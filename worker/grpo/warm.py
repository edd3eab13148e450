"""`builtin:tiny-instruct`: the tiny architecture, warm-started offline by supervised next-token learning.

RL sharpens what a model can already sometimes do; a randomly initialised model cannot do anything
conditional, so GRPO on it only finds prompt-independent shortcuts. Real users start from an
instruct/SFT model; this is the offline stand-in. Supervised training on the train split of the
synthetic tasks (worker.grpo.synthetic), rendered through the tokenizer's chat template, loss on the
answer and EOS only, stopped by step count *early*: on held-out prompts the model is then partly right
greedily and right among 8 samples on nearly every one, which is the starting point RL needs. RL can
only sharpen answers the model sometimes gives: a held-out question it never answers right under
sampling stays wrong, so the stopping step is the earliest that leaves almost none of those on the demo's
task (bench/README.md has the sweep). Stopping on an accuracy threshold is fragile: held-out accuracy
jumps tens of points within ten steps.

Deterministic from the recipe (one intra-op thread, seeded init and data order); the result is cached
under `<cache>/tiny-instruct-<recipe hash>` so a changed recipe never reuses stale weights.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from worker.grpo.concurrency import intra_op_threads
from worker.grpo.synthetic import TASKS, Item, TaskName, train_items
from worker.grpo.tiny import (
    INSTRUCT_PRESET,
    TinyPreset,
    build_tokenizer,
    exclusive_build,
    is_complete_model,
    model_config,
    save_model_atomically,
)

INSTRUCT_NAME = INSTRUCT_PRESET


@dataclass(frozen=True)
class WarmRecipe:
    """Everything that determines the warm model's weights; its hash names the cache directory."""

    preset: TinyPreset = "tiny"
    tasks: tuple[TaskName, ...] = TASKS
    seed: int = 0
    steps: int = 120  # stopped early on purpose (see the module docstring)
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    adam_betas: tuple[float, float] = (0.9, 0.98)
    max_grad_norm: float = 1.0
    data_version: int = 1  # bump when worker.grpo.synthetic changes its items or split

    def digest(self) -> str:
        payload = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


DEFAULT_RECIPE = WarmRecipe()


def instruct_dir(cache_dir: Path, recipe: WarmRecipe = DEFAULT_RECIPE) -> Path:
    return Path(cache_dir) / f"{INSTRUCT_NAME}-{recipe.digest()}"


def build_instruct_model(cache_dir: Path, recipe: WarmRecipe = DEFAULT_RECIPE) -> Path:
    """The warm model of `recipe` under `cache_dir`, trained now if not cached (a short run on one CPU core)."""
    items = train_items(recipe.tasks)
    tokenizer = build_tokenizer()
    return build_warm_model(
        instruct_dir(cache_dir, recipe), recipe, tokenizer,
        lambda rng: supervised_batch(tokenizer, [rng.choice(items) for _ in range(recipe.batch_size)]),
    )


def build_warm_model(
    out_dir: Path, recipe: WarmRecipe, tokenizer: PreTrainedTokenizerFast, next_batch: Callable[[random.Random], Batch]
) -> Path:
    """`out_dir`, trained now by `fit` on `next_batch`'s batches if it does not hold the model yet; the recipe is
    written beside the weights."""
    if is_complete_model(out_dir):
        return out_dir
    with exclusive_build(out_dir):
        if is_complete_model(out_dir):  # built while this process waited for the lock
            return out_dir
        model = fit(recipe, tokenizer, next_batch)
        recipe_json = json.dumps(asdict(recipe), indent=2, sort_keys=True) + "\n"
        return save_model_atomically(model, tokenizer, out_dir, extra={"recipe.json": recipe_json})


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def fit(
    recipe: WarmRecipe, tokenizer: PreTrainedTokenizerFast, next_batch: Callable[[random.Random], Batch]
) -> LlamaForCausalLM:
    """`recipe.steps` of supervised next-token training of a fresh model of `recipe.preset` on the (ids, mask,
    labels) batches `next_batch` draws with the recipe's seeded data RNG; the global RNGs are left untouched."""
    data_rng = random.Random(recipe.seed)
    with torch.random.fork_rng(devices=[]), intra_op_threads(1):
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(model_config(recipe.preset))
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=recipe.learning_rate, betas=recipe.adam_betas, weight_decay=0.0
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / max(1, recipe.warmup_steps))
        )
        model.train()
        for _ in range(recipe.steps):
            input_ids, attention_mask, labels = next_batch(data_rng)
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    model.eval()
    return model


def supervised_batch(
    tokenizer: PreTrainedTokenizerFast, items: list[Item]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, mask, labels), each (B, T); labels are -100 except on the answer and EOS."""
    rows: list[tuple[list[int], int]] = []
    for item in items:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": item.question}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids: list[int] = tokenizer(str(prompt))["input_ids"]  # BOS added by the post-processor
        answer_ids: list[int] = tokenizer(item.answer, add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids + answer_ids + [int(tokenizer.eos_token_id)], len(prompt_ids)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), int(tokenizer.pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for row, (ids, prompt_length) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, prompt_length : len(ids)] = torch.tensor(ids[prompt_length:])
    return input_ids, attention_mask, labels
