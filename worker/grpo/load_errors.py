"""Why a model did not load, in words a tenant may see (a reason class, never the loader's text, which names the
worker's files): for the policy (`model_load_failed` on `base_model`) and for reward models alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors import SafetensorError
from transformers import CONFIG_MAPPING

from worker.grpo.pretrained import GGUFUnavailable

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


def load_failure_reason(exc: BaseException, path: str) -> str:
    """Why `path` (what the engine was given to load) did not load, in words the tenant may see: a reason
    class, never the loader's text (it names the worker's files)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, GGUFUnavailable):
            return f"could not be loaded: {seen}"
        if isinstance(seen, SafetensorError):
            return "could not be loaded: corrupt safetensors file"
        seen = seen.__cause__ or seen.__context__
    architecture = unknown_architecture(Path(path))
    if architecture is not None:
        return f"could not be loaded: unknown architecture {architecture!r}" if architecture else (
            "could not be loaded: unknown architecture"
        )
    return "could not be loaded"


def unknown_architecture(directory: Path) -> str | None:
    """The architecture a local model's config.json names when transformers has no such model type (the
    empty string when its name is not a plain identifier); None when the type is known or there is no config."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    name = architectures[0] if isinstance(architectures, list) and architectures else model_type
    return name if isinstance(name, str) and _IDENTIFIER.match(name) else ""
