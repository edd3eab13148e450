"""The models the GRPO step benchmark trains: the architectures users fine-tune, at realistic proportions.

Imported by `bench/grpo_step.py` (run as a script, so this directory is on `sys.path`).

Every model is built here with random weights (fixed seed) and saved with `save_pretrained`, so both
frameworks load it through `from_pretrained(path)` like a downloaded checkpoint. Two vocabularies:

- `small`: `worker.grpo.tiny`'s character tokenizer (101 tokens), as in the tiny/small presets;
- `32k`: a byte-level BPE tokenizer with 32,000 tokens (the size of Llama 2's and Mistral's), trained here
  with the `tokenizers` library on text generated from a fixed recipe (a seeded pseudo-language with a
  Zipf word distribution plus common English words), never downloaded. Training is deterministic: the
  same recipe gives the same vocabulary (`vocab_hash`), and the result is cached on disk by that recipe.

Two models of real size keep their own vocabulary (`build_real_model`): SmolLM2-135M-Instruct with its real
weights (`builtin:smollm2-135m-instruct`, 49,152 tokens, chat template), and a Gemma 3 model at gemma-3-270m's
shape (random weights, 262,144 tokens: the 32k tokenizer widened), an architecture only the engine's `hf`
backend serves.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Arch = Literal["llama", "qwen2", "qwen3", "mistral"]
Vocab = Literal["small", "32k"]
ARCHS: tuple[Arch, ...] = ("llama", "qwen2", "qwen3", "mistral")
VOCABS: tuple[Vocab, ...] = ("small", "32k")

PAD, BOS, EOS = "<pad>", "<s>", "</s>"


# ==================================================================================================
# Model shapes
# ==================================================================================================


@dataclass(frozen=True)
class Shape:
    """The realistic proportions: GQA 4:1, MLP ~2.7x the hidden size, untied embeddings."""

    hidden_size: int = 256
    intermediate_size: int = 688  # 2.69x, a multiple of 16
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32  # hidden_size / num_attention_heads


REALISTIC = Shape()
MAX_POSITIONS = 4096


def hf_config(arch: Arch, vocab_size: int, special_ids: dict[str, int], shape: Shape = REALISTIC) -> Any:
    """The transformers config of `arch` at `shape`: what distinguishes each family is kept (Llama 3's
    rope scaling, Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm, Mistral's sliding window set
    longer than any sequence here, so that every framework runs full attention)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "pad_token_id": special_ids["pad"],
        "bos_token_id": special_ids["bos"],
        "eos_token_id": special_ids["eos"],
    }
    if arch == "llama":
        llama3_rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        return LlamaConfig(**common, head_dim=shape.head_dim, rope_parameters=llama3_rope)
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=shape.head_dim, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**common, head_dim=shape.head_dim, sliding_window=MAX_POSITIONS)
    raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHS)}")


# ==================================================================================================
# The 32k BPE tokenizer, trained offline
# ==================================================================================================

# Ranked first in the corpus, so that they become whole tokens as in a real tokenizer (the bench's
# prompts are "Repeat the digit 7: ").
_ENGLISH = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part repeat digit answer question sum count letter vowel reply"
).split()
_ONSETS = (
    "",
    *"bcdfghjklmnprstvwz",
    "br",
    "ch",
    "cl",
    "dr",
    "fl",
    "gr",
    "pl",
    "pr",
    "sh",
    "st",
    "str",
    "th",
    "tr",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "ng", "nd", "st", "ck", "x")
_ENDINGS = (".", ".", ".", "?", "!", ":", ",", ";")


@dataclass(frozen=True)
class BPERecipe:
    """Everything that determines the tokenizer. Change a field and the cache key (and vocabulary) changes."""

    vocab_size: int = 32_000
    seed: int = 0
    lexicon_size: int = 60_000  # distinct pseudo-words, drawn with Zipf weights
    sentences: int = 60_000  # ~8.5 MB of text: enough pairs for 32k merges at min_frequency 2
    zipf_exponent: float = 0.8
    min_frequency: int = 2
    version: int = 1  # bump when the generator's code changes

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def corpus(recipe: BPERecipe) -> Iterator[str]:
    """Lines of generated text: capitalised sentences of 6-18 words, some numbers, punctuation."""
    rng = random.Random(recipe.seed)
    pseudo: set[str] = set()
    while len(pseudo) < recipe.lexicon_size:
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        pseudo.add(
            "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        )
    ordered = sorted(pseudo - set(_ENGLISH))  # sorted: set order depends on PYTHONHASHSEED
    rng.shuffle(ordered)
    lexicon = list(_ENGLISH) + ordered
    cumulative = list(
        itertools.accumulate(1.0 / (rank + 1) ** recipe.zipf_exponent for rank in range(len(lexicon)))
    )
    for _ in range(recipe.sentences):
        words = rng.choices(lexicon, cum_weights=cumulative, k=rng.randint(6, 18))
        words[0] = words[0].capitalize()
        line = " ".join(words)
        if rng.random() < 0.3:
            line += f" {rng.randrange(10 ** rng.randint(1, 4))}"
        yield line + rng.choice(_ENDINGS)


def train_bpe(recipe: BPERecipe) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` (GPT-2 / Llama 3 / Qwen style: any text encodes, no <unk>),
    with <pad> <s> </s> as ids 0, 1, 2 and <s> prepended by the post-processor (as Llama's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        min_frequency=recipe.min_frequency,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(recipe), trainer)
    if tokenizer.get_vocab_size() != recipe.vocab_size:
        raise RuntimeError(
            f"the corpus yields {tokenizer.get_vocab_size()} tokens, not {recipe.vocab_size}: "
            "raise the recipe's lexicon_size or sentences"
        )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def vocab_hash(tokenizer: Any) -> str:
    """SHA-256 of the vocabulary and merges, independent of JSON key order."""
    model = json.loads(tokenizer.to_str())["model"]
    canonical = json.dumps({"vocab": model["vocab"], "merges": model["merges"]}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpo-service" / "bench"


def cached_bpe(recipe: BPERecipe, cache_dir: Path) -> Any:
    """The recipe's tokenizer from `cache_dir` (trained and written there on first use, ~10-20 s)."""
    from tokenizers import Tokenizer

    path = Path(cache_dir) / f"bpe-{recipe.vocab_size}-{recipe.key}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = train_bpe(recipe)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    tokenizer.save(str(partial))
    os.replace(partial, path)  # atomic: a concurrent reader sees the whole file or none
    return tokenizer


def hf_tokenizer(vocab: Vocab, cache_dir: Path) -> Any:
    """The `PreTrainedTokenizerFast` of a vocabulary option (left padding, like the engine's rollouts)."""
    from transformers import PreTrainedTokenizerFast

    if vocab == "small":
        from worker.grpo.tiny import build_tokenizer

        return build_tokenizer()
    if vocab != "32k":
        raise ValueError(f"unknown vocabulary {vocab!r}; expected one of {', '.join(VOCABS)}")
    return PreTrainedTokenizerFast(
        tokenizer_object=cached_bpe(BPERecipe(), cache_dir),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )


def widen_vocabulary(tokenizer: Any, size: int) -> Any:
    """`tokenizer` with ids up to `size` - 1: the new tokens are distinct letter strings that no text encodes
    to, so that a model with a real model's vocabulary size (Qwen2.5's 151,936) samples only ids that decode
    (a tokenizer drops ids it does not know from the text). Encoding is unchanged."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="widen-") as tmp:
        tokenizer.save_pretrained(tmp)
        path = Path(tmp) / "tokenizer.json"
        spec = json.loads(path.read_text())
        vocab: dict[str, int] = spec["model"]["vocab"]
        taken = set(vocab) | {token["content"] for token in spec.get("added_tokens", [])}
        next_id = 1 + max([*vocab.values(), *(t["id"] for t in spec.get("added_tokens", []))])
        number = 0
        while next_id < size:
            number += 1
            word, n = "", number
            while n:  # bijective base 26: a, b, ..., z, aa, ab, ...
                n, digit = divmod(n - 1, 26)
                word = chr(ord("a") + digit) + word
            if word not in taken:
                vocab[word] = next_id
                next_id += 1
        path.write_text(json.dumps(spec))
        return AutoTokenizer.from_pretrained(tmp)


# ==================================================================================================
# Models of real size with their own vocabulary
# ==================================================================================================

RealModel = Literal["smollm2", "gemma3"]
# Each keeps its own vocabulary: the name is the case's vocabulary column.
REAL_VOCABS: dict[RealModel, str] = {"smollm2": "49k", "gemma3": "262k"}
GEMMA3_VOCAB = 262_144


def gemma3_270m_config(vocab_size: int, special_ids: dict[str, int]) -> Any:
    """google/gemma-3-270m's text config (config.json): 18 layers, hidden 640, MLP 2048, 4 query heads and 1
    KV head of 256, GELU-tanh, query scale 256, sliding window 512 on five layers in six (local rope theta
    10k, global 1M), tied embeddings, no logit soft-capping. The special ids are the bench tokenizer's."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=512,
        max_position_embeddings=32_768,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        pad_token_id=special_ids["pad"],
        bos_token_id=special_ids["bos"],
        eos_token_id=special_ids["eos"],
    )


def build_real_model(model: RealModel, out_dir: Path, *, cache_dir: Path, seed: int = 0) -> Path:
    """`smollm2`: SmolLM2-135M-Instruct's folder (real weights, converted once under `cache_dir/models` by the
    engine's `builtin:` source; `out_dir` unused). `gemma3`: the gemma-3-270m-shaped model with the 32k
    tokenizer widened to 262,144 tokens, random weights saved in bfloat16 (as the real checkpoint) to `out_dir`."""
    if model == "smollm2":
        from worker.grpo.pretrained import build_smollm2

        return build_smollm2(Path(cache_dir) / "models")
    if model != "gemma3":
        raise ValueError(f"unknown model {model!r}; expected one of {', '.join(REAL_VOCABS)}")
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    tokenizer = widen_vocabulary(hf_tokenizer("32k", cache_dir), GEMMA3_VOCAB)
    special = {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
    return save_random_model(gemma3_270m_config(len(tokenizer), special), tokenizer, out_dir, seed, "bfloat16")


def build_model(
    arch: Arch,
    vocab: Vocab,
    out_dir: Path,
    *,
    cache_dir: Path,
    seed: int = 0,
    shape: Shape = REALISTIC,
    tokenizer: Any = None,
    overrides: Mapping[str, Any] | None = None,
    dtype: str | None = None,
) -> Path:
    """Save a randomly initialised `arch` model at the realistic shape with `vocab`'s tokenizer to `out_dir`.

    `bench/gpu_check.py` builds its Qwen2.5-0.5B-shaped model with another `shape`, a widened `tokenizer`
    (its length is the vocabulary size), config `overrides` (tied embeddings) and bfloat16 weights (`dtype`).
    """
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    tokenizer = tokenizer if tokenizer is not None else hf_tokenizer(vocab, cache_dir)
    special = {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
    config = hf_config(arch, len(tokenizer), special, shape)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    return save_random_model(config, tokenizer, out_dir, seed, dtype)


def save_random_model(config: Any, tokenizer: Any, out_dir: Path, seed: int, dtype: str | None) -> Path:
    """A model of `config` with random weights (`seed`; the global RNG untouched) saved with `tokenizer`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    special = {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **({"dtype": getattr(torch, dtype)} if dtype else {}))
    model.generation_config = GenerationConfig(
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"]
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.replace(partial, out_dir)  # a finished build appears whole (out_dir must not exist yet)
    return out_dir
