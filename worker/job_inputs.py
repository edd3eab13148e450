"""An attempt's inputs on the worker's disk: the datasets' rows, the models it loads (a tenant's checkpoint as a
model is downloaded and verified), the checkpoint it resumes from, and `RankInputs`, what the other ranks of a
multi-device job receive instead of reading the database themselves.

What the database says comes through the execution port (service.execution.inputs); the files come from
storage. A dataset that no longer parses fails the job (`dataset_invalid`); a `checkpoint:<id>` model that is
missing or corrupt fails it (`base_checkpoint_invalid`); a resume checkpoint that does not verify is skipped for
the one before it (event `checkpoint_unusable`, steps rewound).

A `checkpoint:<id>` that holds only a LoRA adapter (weights saved through the Tinker API) is loaded onto the base
model its adapter_config.json names (checked like any model source) and merged into a plain model beside the
download (`<id>-merged`): what the job loads. Other nodes of the job merge their own copy the same way.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from contract.spec import JobSpec
from outbound.rewards import RemoteRewardConfig
from service.execution import inputs as port
from service.execution import reporting
from service.execution.lease import Claim
from service.execution.runtime import Settings, Storage, get_settings
from worker.failures import JobFailure, checkpoint_problem
from worker.grpo.data import DatasetError, PromptRow, load_jsonl
from worker.model_sources import (
    adapter_only_base,
    check_checkpoint_adapter_base,
    check_hub_size,
    check_source,
)

log = logging.getLogger(__name__)

CHUNK = 1 << 20
RANK_INPUTS_FILE = "rank-inputs.json"
Rows = tuple[list[PromptRow], list[PromptRow] | None, list[PromptRow] | None]


@dataclass(frozen=True)
class FetchedCheckpoint:
    """A checkpoint rank 0 downloaded into its working directory (to resume from, or a model source)."""

    directory: Path
    storage_path: str
    manifest: list[dict[str, Any]]
    adapter_base: str | None = None  # an adapter-only checkpoint's base model: merged at merged_dir(directory)


def merged_dir(directory: Path) -> Path:
    """Where an adapter-only checkpoint downloaded into `directory` is merged onto its base model."""
    return directory.with_name(f"{directory.name}-merged")


def merge_onto_base(directory: Path, base: str, cache_dir: Path) -> Path:
    """The adapter in `directory` merged onto `base` (a checked model source: `builtin:` ones are built under
    `cache_dir`) at merged_dir(directory)."""
    # torch, peft and transformers: only the job's process may import them (the Celery parent forks children).
    from worker.grpo.adapter_merge import merge_adapter
    from worker.grpo.model_paths import resolve_model_path

    return merge_adapter(directory, resolve_model_path(base, cache_dir), merged_dir(directory))


def download_checkpoint_files(storage: Storage, storage_path: str, manifest: list[dict[str, Any]], directory: Path) -> Path:
    """Download every file `manifest` lists into `directory` and verify them (CheckpointCorrupt)."""
    # worker.grpo.checkpoint imports torch: only the job's process may (the Celery parent forks children).
    from worker.grpo.checkpoint import verify_manifest

    shutil.rmtree(directory, ignore_errors=True)
    for entry in manifest:
        target = directory / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        with storage.open(f"{storage_path}/{entry['path']}") as source, target.open("wb") as handle:
            shutil.copyfileobj(source, handle, CHUNK)
    verify_manifest(directory)
    return directory


class InputFetcher:
    """Puts one attempt's inputs on disk and remembers the checkpoints it fetched (for `RankInputs`)."""

    def __init__(self, job_id: str, settings: Settings, storage: Storage) -> None:
        self.job_id = job_id
        self.settings = settings
        self.storage = storage
        self.fetched: list[FetchedCheckpoint] = []

    def rows(self, inputs: port.JobInputs, workdir: Path) -> Rows:
        """The train rows, and the eval and retain rows when the spec names those datasets."""
        train = self._load_rows(inputs.dataset_key, workdir / "train.jsonl")
        evals = None if inputs.eval_dataset_key is None else self._load_rows(inputs.eval_dataset_key, workdir / "eval.jsonl")
        retain = (
            None if inputs.retain_dataset_key is None
            else self._load_rows(inputs.retain_dataset_key, workdir / "retain.jsonl")
        )
        return train, evals, retain

    def _load_rows(self, key: str, path: Path) -> list[PromptRow]:
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.storage.open(key) as source, path.open("wb") as target:
            shutil.copyfileobj(source, target, CHUNK)
        try:
            return load_jsonl(path)
        except DatasetError as exc:
            raise JobFailure("dataset_invalid", str(exc)) from exc

    def resolve_model(self, inputs: port.JobInputs, field: str, value: str, directory: Path) -> str:
        """What the engine loads for a model source (worker.model_sources checks it again first):
        `builtin:` and hub ids unchanged, `checkpoint:<id>` a verified local copy, a local path its real path."""
        source = check_source(field, value, port.ModelSourcePolicy.from_settings(self.settings))
        if source.kind is port.ModelSourceKind.checkpoint:
            return str(self._tenant_checkpoint(inputs.tenant_id, field, source.value, directory / source.value))
        if source.kind is port.ModelSourceKind.hub:
            check_hub_size(field, value, self.settings.hub_model_max_bytes)
            return value
        return source.value

    def _tenant_checkpoint(self, tenant_id: str, field: str, checkpoint_id: str, directory: Path) -> Path:
        checkpoint = port.tenant_checkpoint(tenant_id, checkpoint_id)
        if checkpoint is None:
            raise JobFailure("base_checkpoint_invalid", f"{field}: checkpoint {checkpoint_id!r} not found")
        # worker.grpo.checkpoint imports torch: only the job's process may (the Celery parent forks children).
        from worker.grpo.checkpoint import CheckpointCorrupt

        try:
            self._fetch(checkpoint, directory)
            base = adapter_only_base(directory)
        except (OSError, ValueError, CheckpointCorrupt) as exc:
            log.warning("job %s: %s: checkpoint %s unusable: %s", self.job_id, field, checkpoint_id, exc)
            raise JobFailure(
                "base_checkpoint_invalid", f"{field}: checkpoint {checkpoint_id!r}: {checkpoint_problem(exc)}"
            ) from exc
        if base is None:
            return directory
        return self._merged(field, checkpoint_id, directory, base)

    def _merged(self, field: str, checkpoint_id: str, directory: Path, base: object) -> Path:
        """An adapter-only checkpoint merged onto the base model its adapter names (checked first)."""
        value = f"checkpoint:{checkpoint_id}"
        source = check_checkpoint_adapter_base(field, value, base, port.ModelSourcePolicy.from_settings(self.settings))
        if source.kind is port.ModelSourceKind.hub:
            check_hub_size(field, source.value, self.settings.hub_model_max_bytes)
        try:
            merged = merge_onto_base(directory, source.value, Path(self.settings.data_dir) / "models")
        except (OSError, ValueError) as exc:
            log.warning("job %s: %s: adapter %s onto %r failed: %s", self.job_id, field, checkpoint_id, base, exc)
            raise JobFailure(
                "base_checkpoint_invalid",
                f"{field}: checkpoint {checkpoint_id!r}: its adapter could not be loaded onto its base model {base!r}",
            ) from exc
        self.fetched[-1] = replace(self.fetched[-1], adapter_base=source.value)
        return merged

    def _fetch(self, checkpoint: port.StoredCheckpoint, directory: Path) -> Path:
        """Download every listed file and verify it against the engine's manifest (CheckpointCorrupt)."""
        download_checkpoint_files(self.storage, checkpoint.storage_path, checkpoint.manifest, directory)
        self.fetched.append(FetchedCheckpoint(directory, checkpoint.storage_path, list(checkpoint.manifest)))
        return directory

    def resume_point(self, claim: Claim, root: Path) -> Path | None:
        """The newest checkpoint that verifies; older ones are tried if it does not (and steps rewound)."""
        # worker.grpo.checkpoint imports torch: only the job's process may (the Celery parent forks children).
        from worker.grpo.checkpoint import CheckpointCorrupt

        checkpoint = port.resume_checkpoint(claim.job_id, before_step=claim.resume_step + 1)
        while checkpoint is not None:
            try:
                # Named like the engine's own directories so the trainer knows that step is saved.
                return self._fetch(checkpoint, root / f"checkpoint-{checkpoint.step}")
            except (OSError, ValueError, CheckpointCorrupt) as exc:
                log.warning("job %s: checkpoint %s unusable: %s", claim.job_id, checkpoint.id, exc)
                reporting.record_event(claim, "checkpoint_unusable",
                                       f"checkpoint {checkpoint.id}: {checkpoint_problem(exc)}",
                                       {"checkpoint_id": checkpoint.id, "step": checkpoint.step})
                checkpoint = port.rewind_past(claim, checkpoint.step)
        return None


def _with_secrets(config: RemoteRewardConfig) -> dict[str, Any]:
    """The config as JSON with its secrets in clear (model_dump masks them), for RankInputs' file."""
    document = config.model_dump(mode="json")
    document["secret"] = config.secret.get_secret_value()
    if config.previous_secret is not None:
        document["previous_secret"] = config.previous_secret.get_secret_value()
    return document



@dataclass(frozen=True)
class RankInputs:
    """What the other ranks of a job need to train without the database. Rank 0 writes them into its working
    directory for the ranks of its node (`write`); a node other than rank 0's builds its own from the
    database and storage it trusts, given only `shared()` through the collectives (JobRunner.inputs_for_node),
    and downloads its own copies of `fetched` (`on_node`)."""

    spec: JobSpec
    queue: str
    train_rows: list[PromptRow]
    eval_rows: list[PromptRow] | None
    retain_rows: list[PromptRow] | None
    base_model: str
    resume_from: Path | None
    remote_configs: dict[str, RemoteRewardConfig]  # reward_function_id -> its endpoint, secrets included
    model_paths: dict[str, str]
    output_dir: Path
    workdir: Path  # rank 0's working directory, under which every path above lies
    node: int  # rank 0's node
    fetched: tuple[FetchedCheckpoint, ...]

    def shared(self) -> dict[str, Any]:
        """What rank 0 sends every rank through the collectives: where things are, nothing secret, no rows."""
        return {
            "queue": self.queue, "base_model": self.base_model,
            "resume_from": None if self.resume_from is None else str(self.resume_from),
            "model_paths": dict(self.model_paths), "output_dir": str(self.output_dir), "workdir": str(self.workdir),
            "node": self.node,
            "fetched": [
                {"directory": str(f.directory), "storage_path": f.storage_path, "manifest": list(f.manifest),
                 "adapter_base": f.adapter_base}
                for f in self.fetched
            ],
        }

    @classmethod
    def from_shared(
        cls,
        shared: Mapping[str, Any],
        spec: JobSpec,
        rows: Rows,
        remote_configs: dict[str, RemoteRewardConfig],
    ) -> RankInputs:
        resume = shared["resume_from"]
        return cls(
            spec, str(shared["queue"]), *rows, str(shared["base_model"]), None if resume is None else Path(resume),
            remote_configs, dict(shared["model_paths"]), Path(shared["output_dir"]), Path(shared["workdir"]),
            int(shared["node"]),
            tuple(FetchedCheckpoint(Path(f["directory"]), f["storage_path"], f["manifest"], f.get("adapter_base"))
                  for f in shared["fetched"]),
        )

    def write(self, path: Path) -> None:
        """Into this node's working directory, readable by the worker's user only (it holds secrets)."""

        def plain(rows: list[PromptRow] | None) -> list[dict[str, Any]] | None:
            return None if rows is None else [{"prompt": r.prompt, "extras": r.extras} for r in rows]

        document = {
            "shared": self.shared(), "spec": self.spec.model_dump(mode="json"),
            "rows": [plain(self.train_rows), plain(self.eval_rows), plain(self.retain_rows)],
            "remote_configs": {k: _with_secrets(c) for k, c in self.remote_configs.items()},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(document, handle)

    @classmethod
    def read(cls, path: Path) -> RankInputs:
        def rows(plain: list[dict[str, Any]] | None) -> list[PromptRow] | None:
            return None if plain is None else [PromptRow(prompt=r["prompt"], extras=r["extras"]) for r in plain]

        document = json.loads(path.read_text())
        train, eval_rows, retain = (rows(r) for r in document["rows"])
        assert train is not None
        configs = {k: RemoteRewardConfig.model_validate(c) for k, c in document["remote_configs"].items()}
        return cls.from_shared(document["shared"], JobSpec.model_validate(document["spec"]),
                               (train, eval_rows, retain), configs)

    def fetch_onto(self, workdir: Path, storage: Storage) -> None:
        """Download what rank 0 fetched into the same places under this node's `workdir` (and merge an
        adapter-only checkpoint onto its base model there, as rank 0 did)."""
        for checkpoint in self.fetched:
            directory = workdir / checkpoint.directory.relative_to(self.workdir)
            download_checkpoint_files(storage, checkpoint.storage_path, checkpoint.manifest, directory)
            if checkpoint.adapter_base is not None:
                merge_onto_base(directory, checkpoint.adapter_base, Path(get_settings().data_dir) / "models")

    def on_node(self, workdir: Path) -> RankInputs:
        """These inputs with rank 0's working directory replaced by this node's `workdir`."""

        def moved(path: str) -> str:
            inside = Path(path).is_relative_to(self.workdir)
            return str(workdir / Path(path).relative_to(self.workdir)) if inside else path

        return replace(
            self,
            base_model=moved(self.base_model),
            resume_from=None if self.resume_from is None else Path(moved(str(self.resume_from))),
            model_paths={name: moved(path) for name, path in self.model_paths.items()},
            output_dir=Path(moved(str(self.output_dir))),
            workdir=workdir,
        )
