"""The worker's side of owned model sources: check again, then make each source loadable.

The service checked every `base_model` / reward `model` at submission (service.jobs.model_sources); the
worker checks again with its own settings and working directory, right before loading, because that is
where the filesystem is:

- a hub id that also names a directory relative to the worker's working directory would be loaded from that
  directory by `from_pretrained`: refused;
- a hub download must fit `hub_model_max_bytes`, measured from the hub's file listing before anything is
  downloaded (skipped when HF_HUB_OFFLINE is set: nothing can be downloaded then);
- a local path is handed to `from_pretrained` as the real path that was checked;
- a tenant's checkpoint that holds only an adapter (weights saved through the Tinker API) names its base model,
  which passes the same policy before the worker loads the adapter onto it (worker.job_inputs).

Failures become `ModelUnavailable` with a stable code and a message naming only the field and what the
tenant wrote; the underlying exception (paths, hub responses) goes to the worker's log.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from contract.spec import BUILTIN_PREFIX, CHECKPOINT_PREFIX
from service.execution.inputs import (
    ModelSource,
    ModelSourceKind,
    ModelSourcePolicy,
    ModelSourceRefused,
    classify,
)

log = logging.getLogger(__name__)

# Files `from_pretrained` fetches from a repository's top level; weights in other formats are not fetched.
_CONFIG_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")

ADAPTER_CONFIG = "adapter_config.json"
MERGED_DIR = "merged"  # worker.grpo.checkpoint.MERGED_DIR, which imports torch: a LoRA job's whole model

HubFiles = Callable[[str], Iterable[tuple[str, int | None]]]


class ModelUnavailable(Exception):
    """A model source the worker will not or cannot load. `code` is the job's error code."""

    def __init__(self, code: str, field: str, value: str, reason: str) -> None:
        super().__init__(f"{field}: {value!r} {reason}")
        self.code = code
        self.message = str(self)


def check_source(field: str, value: str, policy: ModelSourcePolicy) -> ModelSource:
    """The policy's verdict in the worker, plus the hub-id-that-is-a-local-directory case and the base model
    an adapter-only directory names."""
    try:
        source = classify(value, policy)
    except ModelSourceRefused as exc:
        raise ModelUnavailable("model_source_refused", field, value, f"is not accepted: {exc}") from exc
    if source.kind is ModelSourceKind.hub and os.path.lexists(value):
        log.warning("%s: hub id %r names a path in the worker's working directory; refused", field, value)
        raise ModelUnavailable("model_load_failed", field, value, "could not be loaded")
    if source.kind is ModelSourceKind.local:
        check_adapter_base(field, value, Path(source.value), policy)
    return source


def check_adapter_base(field: str, value: str, directory: Path, policy: ModelSourcePolicy) -> None:
    """A directory with only a PEFT adapter makes `from_pretrained` load the adapter's
    `base_model_name_or_path` instead: that reference must pass the same policy."""
    adapter_config = directory / ADAPTER_CONFIG
    if not adapter_config.is_file() or (directory / "config.json").exists():
        return
    base: object = None
    try:
        base = json.loads(adapter_config.read_text(encoding="utf-8")).get("base_model_name_or_path")
        if not isinstance(base, str) or base.startswith((BUILTIN_PREFIX, CHECKPOINT_PREFIX)):
            raise ModelSourceRefused("not a model source")
        classify(base, policy)
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("%s: the adapter in %s names base model %r: refused (%s)", field, directory, base, exc)
        raise ModelUnavailable(
            "model_source_refused", field, value, "is an adapter whose base model is not accepted here"
        ) from exc


def adapter_only_base(directory: Path) -> object | None:
    """What an adapter-only checkpoint (adapter_config.json, no model of its own: weights saved through the Tinker
    API) names as its base model; None for a checkpoint holding a whole model (a LoRA job's has `merged/`)."""
    whole_model = (directory / "config.json").exists() or (directory / MERGED_DIR).exists()
    if whole_model or not (directory / ADAPTER_CONFIG).is_file():
        return None
    config = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    return config.get("base_model_name_or_path", "") if isinstance(config, dict) else ""


def check_checkpoint_adapter_base(field: str, value: str, base: object, policy: ModelSourcePolicy) -> ModelSource:
    """The base model an adapter-only checkpoint names passes the policy of a model named directly (the Tinker
    API names it as the service does: `builtin:...`, a hub id); never another checkpoint."""
    try:
        if not isinstance(base, str) or not base or base.startswith(CHECKPOINT_PREFIX):
            raise ModelUnavailable("model_source_refused", field, str(base), "is not a model source")
        return check_source(field, base, policy)
    except ModelUnavailable as exc:
        log.warning("%s: the adapter of %s names base model %r: refused (%s)", field, value, base, exc)
        raise ModelUnavailable(
            exc.code, field, value, "is an adapter whose base model is not accepted here"
        ) from exc


def check_hub_size(field: str, repo_id: str, max_bytes: int, hub_files: HubFiles | None = None) -> None:
    """Refuse a hub model whose download would exceed `max_bytes`, before downloading anything."""
    if hub_files is None:
        from huggingface_hub import constants  # slow to import; only hub ids need it

        if constants.HF_HUB_OFFLINE:
            return  # from_pretrained reads the local cache only
        hub_files = hub_file_sizes
    try:
        files = list(hub_files(repo_id))
    except Exception as exc:
        log.warning("%s: listing hub model %r failed: %s", field, repo_id, exc)
        raise ModelUnavailable("model_load_failed", field, repo_id, "could not be loaded") from exc
    names = {name for name, _ in files}
    if ADAPTER_CONFIG in names and "config.json" not in names:
        # from_pretrained would go on to the base model the adapter names, unchecked.
        raise ModelUnavailable(
            "model_source_refused",
            field,
            repo_id,
            "is an adapter-only repository; name its base model instead",
        )
    size = download_size(files)
    if size is None or size > max_bytes:
        log.warning("%s: hub model %r is %s bytes (limit %d)", field, repo_id, size, max_bytes)
        raise ModelUnavailable(
            "model_too_large", field, repo_id, f"is larger than this service's limit of {max_bytes} bytes"
        )


def hub_file_sizes(repo_id: str, *, endpoint: str | None = None) -> list[tuple[str, int | None]]:
    """(path, size) of every file of the repository's main revision, from the hub's API (one request)."""
    from huggingface_hub import HfApi  # slow to import; only hub ids need it

    info = HfApi(endpoint=endpoint).model_info(repo_id, files_metadata=True)
    return [(sibling.rfilename, sibling.size) for sibling in info.siblings or ()]


def download_size(files: Iterable[tuple[str, int | None]]) -> int | None:
    """Bytes `from_pretrained` would fetch: top-level config/tokenizer files plus one weight format
    (safetensors when present, else PyTorch .bin). None when a counted file's size is unknown."""
    top = [(name, size) for name, size in files if "/" not in name]
    safetensors = [
        (n, s) for n, s in top if n.endswith(".safetensors") or n.endswith(".safetensors.index.json")
    ]
    weights = safetensors or [(n, s) for n, s in top if n.endswith(".bin") or n.endswith(".bin.index.json")]
    counted = {*weights, *((n, s) for n, s in top if n.endswith(_CONFIG_SUFFIXES))}
    if any(size is None for _, size in counted):
        return None
    return sum(size or 0 for _, size in counted)
