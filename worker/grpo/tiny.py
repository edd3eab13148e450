"""Offline tiny Llama-style models with a character-level tokenizer.

Tests, the demo and the benchmark need a real causal LM without network access. This module
builds one from scratch (random init, fixed seed) and writes it with `save_pretrained`, so that
callers always go through the ordinary `from_pretrained(path)` loading code.

The tokenizer has one token per printable ASCII character plus newline and tab, so any English
prompt round-trips exactly; other characters map to `<unk>`. A BOS token is prepended by the
tokenizer's post-processor (like Llama's), so the chat template does not add one itself.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import string
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

TinyPreset = Literal["tiny", "small", "medium"]

INSTRUCT_PRESET = "tiny-instruct"  # the tiny preset after offline supervised training (worker.grpo.warm)
TOOLS_PRESET = "tiny-tools"  # the tiny preset warm-started on two-turn tool conversations (worker.grpo.warm_tools)
PRETRAINED_PRESET = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, offline (worker.grpo.pretrained)

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"

# Messages as "role: content" lines; assistant turns end with EOS so a model trained on
# rendered conversations learns to stop. No BOS here: the tokenizer's post-processor adds it.
# The newline is an expression because HF renders templates with trim_blocks (eats a literal one).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# Files whose presence marks a finished build (the build is renamed into place atomically,
# so this is a sanity check rather than a lock).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class _Shape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int


# Parameter counts with the 101-token vocabulary and untied embeddings:
# tiny 0.68 M, small 3.98 M, medium 25.3 M.
_PRESETS: dict[str, _Shape] = {
    "tiny": _Shape(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4),
    "small": _Shape(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4),
    "medium": _Shape(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8),
}

MAX_POSITIONS = 4096


def vocabulary() -> list[str]:
    """Special tokens first (ids 0..3), then every printable ASCII character plus newline and tab."""
    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    return [PAD, BOS, EOS, UNK, *chars]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: one token per character, BOS prepended, no spaces added on decode."""
    vocab = {token: idx for idx, token in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every single character (newline included, hence [\s\S] rather than .) becomes its own "word".
    core.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # join tokens without the default space separator
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config(preset: TinyPreset) -> LlamaConfig:
    """The LlamaConfig of a size preset (vocabulary and special-token ids from the char tokenizer)."""
    if preset not in _PRESETS:
        raise ValueError(f"unknown tiny model preset {preset!r}; expected one of {sorted(_PRESETS)}")
    tokenizer = build_tokenizer()
    shape = _PRESETS[preset]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def is_complete_model(out_dir: Path) -> bool:
    return all((out_dir / name).is_file() for name in _REQUIRED_FILES)


def build_tiny_model(preset: TinyPreset, out_dir: Path, *, seed: int = 0) -> Path:
    """Build a randomly initialised Llama of the given size preset and save it to `out_dir`.

    Deterministic for a (preset, seed) pair; the global torch RNG is left untouched. Idempotent:
    an already complete `out_dir` is returned as is. The files are written to a temporary
    sibling directory and renamed into place, so a concurrent or interrupted build never
    leaves a half-written model behind at `out_dir`.
    """
    config = model_config(preset)  # validates the preset name first
    out_dir = Path(out_dir)
    if is_complete_model(out_dir):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists, is not empty and does not hold a complete model")

    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    if out_dir.exists():
        out_dir.rmdir()  # empty (checked above); rename cannot replace a directory
    return save_model_atomically(model, tokenizer, out_dir)


@contextmanager
def exclusive_build(out_dir: Path) -> Iterator[None]:
    """Hold the build lock of `out_dir` (an flock on a sibling file) for the block. A builtin model costs seconds
    to minutes of CPU to build: a second process asking for the same one on this machine (another worker, another
    rank) waits for the first one's result instead of repeating the work. Callers check for the finished model
    again once they hold it. The lock goes with the file's descriptor, so a build that dies releases it."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def save_model_atomically(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path, extra: dict[str, str] | None = None
) -> Path:
    """Save `model` and `tokenizer` (and `extra` text files by name) into `out_dir` through a temporary sibling
    renamed into place, so a concurrent or interrupted build never leaves a half-written model at `out_dir`."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        for name, text in (extra or {}).items():
            (tmp_dir / name).write_text(text)
        os.rename(tmp_dir, out_dir)
    except OSError:
        # Another process may have finished the same build first: that result is as good as ours.
        if is_complete_model(out_dir):
            return out_dir
        raise
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir
