"""Where a job's models may come from: `base_model` and every reward model's `model`.

Accepted forms, in every mode:
- ``builtin:<preset>``: built offline by the worker;
- ``checkpoint:<id>``: a checkpoint of the caller's own tenant (jobs.service checks the owner; another
  tenant's id is answered exactly like an unknown one);
- a Hugging Face id (``org/name``) matching the operator's `hub_model_allowlist`;
- a local directory under one of the operator's `model_local_roots` (any directory in development when
  none are configured), after resolving ``..`` and symlinks.

Never a directory inside the service's data dir or its local storage root: those hold every tenant's
datasets and checkpoints, and another tenant's checkpoint is reachable only as ``checkpoint:<id>``.

The same pure check runs at submission (REST and gRPC, through jobs.service) and again in the worker
before anything is loaded, with the worker's own settings and working directory.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from contract.spec import BUILTIN_PREFIX, CHECKPOINT_PREFIX
from service.kit.config import Settings

# huggingface_hub's repo id rule: one or two segments of [\w.-], no "--" or "..", no leading/trailing - or .
_HUB_SEGMENT = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^(?:{_HUB_SEGMENT}/)?{_HUB_SEGMENT}$", re.ASCII)


class ModelSourceKind(StrEnum):
    builtin = "builtin"
    checkpoint = "checkpoint"
    hub = "hub"
    local = "local"


@dataclass(frozen=True)
class ModelSource:
    kind: ModelSourceKind
    value: str  # builtin: the full "builtin:<preset>"; checkpoint: the id; hub: the id; local: the real path


class ModelSourceRefused(ValueError):
    """The value is not an accepted model source; the message says why without naming anything on disk."""


@dataclass(frozen=True)
class ModelSourcePolicy:
    local_roots: tuple[Path, ...] | None  # None: any directory (development without configured roots)
    forbidden: tuple[Path, ...]  # the service's own data: never a model, whatever the roots say
    hub_allowlist: tuple[str, ...]

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelSourcePolicy:
        roots = settings.model_local_roots
        local_roots: tuple[Path, ...] | None
        if roots is None:
            local_roots = None if settings.env == "development" else ()
        else:
            local_roots = tuple(_real(root) for root in roots)
        forbidden = [_real(settings.data_dir)]
        storage = local_storage_root(settings.storage_url)
        if storage is not None:
            forbidden.append(_real(storage))
        return cls(local_roots, tuple(forbidden), tuple(settings.hub_model_allowlist or ()))


def local_storage_root(storage_url: str) -> str | None:
    """The directory of a local storage URL (a plain path or file://...), None for remote stores."""
    if storage_url.startswith("file://"):
        return storage_url.removeprefix("file://")
    return None if "://" in storage_url else storage_url


def is_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and ".." not in value and "--" not in value


def classify(value: str, policy: ModelSourcePolicy) -> ModelSource:
    """The source `value` names, or ModelSourceRefused. Touches the filesystem only to resolve local paths."""
    if value.startswith(BUILTIN_PREFIX):
        return ModelSource(ModelSourceKind.builtin, value)
    if value.startswith(CHECKPOINT_PREFIX):
        checkpoint_id = value.removeprefix(CHECKPOINT_PREFIX)
        if not checkpoint_id:
            raise ModelSourceRefused("checkpoint: needs a checkpoint id")
        return ModelSource(ModelSourceKind.checkpoint, checkpoint_id)
    if is_hub_id(value):
        if not hub_id_allowed(value, policy.hub_allowlist):
            raise ModelSourceRefused(f"hub model {value!r} is not in this service's allowlist")
        return ModelSource(ModelSourceKind.hub, value)
    return ModelSource(ModelSourceKind.local, str(check_local_path(value, policy)))


def hub_id_allowed(repo_id: str, allowlist: tuple[str, ...]) -> bool:
    """Case-insensitive glob match ("Qwen/*", "meta-llama/Llama-3.2-1B", "*")."""
    lowered = repo_id.lower()
    return any(fnmatch.fnmatchcase(lowered, pattern.lower()) for pattern in allowlist)


def check_local_path(value: str, policy: ModelSourcePolicy) -> Path:
    """The real path of `value` (`..` and symlinks resolved) if the policy allows it, else ModelSourceRefused."""
    if "\x00" in value:
        raise ModelSourceRefused("not a model source")
    path = _real(value)
    if any(_inside(path, forbidden) for forbidden in policy.forbidden):
        raise ModelSourceRefused(
            "local paths inside the service's own data are refused; name a checkpoint as checkpoint:<id>"
        )
    if policy.local_roots is None:
        return path
    if not policy.local_roots:
        raise ModelSourceRefused(
            "local model paths are not accepted here; use builtin:, checkpoint:<id> or an allowed hub id"
        )
    if not any(_inside(path, root) for root in policy.local_roots):
        raise ModelSourceRefused("local model paths must be under one of the service's model roots")
    return path


def _real(path: str) -> Path:
    return Path(os.path.realpath(path))


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents
