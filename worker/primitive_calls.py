"""One call of the primitive training API, run on a resident base model: the request's body in, the response's
body out (JSON, or protobuf for forward_backward and sampling, as the Tinker SDK reads them).

Bad input raises `CallRefused` (the future fails with category "user": resent as is, it would fail again);
anything else is the server's failure. Saved weights go to storage under a fresh prefix per save and are then
recorded, so a recorded save is always complete; each save is also a checkpoint of the tenant, whose id the
save's result carries as `checkpoint_id` (an extra field: the SDK ignores it).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contract.tinker import requests as wire
from contract.tinker.arrays import (
    SampledArrays,
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)
from contract.tinker.paths import parse_weights_path
from service.execution import primitives as port
from service.execution.primitives import PendingRequest
from service.execution.runtime import Storage, primitive_weights_prefix
from worker.grpo.checkpoint import MANIFEST_NAME, build_manifest
from worker.grpo.primitive_errors import PrimitiveInputError
from worker.grpo.resident import AdamSettings, Datum, ResidentBase
from worker.model_sources import ADAPTER_CONFIG

CHUNK = 1 << 20


class CallRefused(Exception):
    """The caller's mistake; the message names the field."""


@dataclass(frozen=True)
class Outcome:
    body: bytes
    media: str  # "json" | "protobuf"
    tokens_generated: int = 0  # sampled
    tokens_trained: int = 0  # through forward or forward_backward


def _json(value: dict[str, Any]) -> Outcome:
    return Outcome(json.dumps(value).encode(), "json")


class CallRunner:
    """Runs calls on the resident bases of one worker; `open_sampler` is how a snapshot's sampler is held."""

    def __init__(self, worker: str, storage: Storage, open_sampler: Callable[[str, str, str, Path], None]) -> None:
        self.worker = worker
        self.storage = storage
        self.open_sampler = open_sampler
        # Samplers over saved weights (their adapter is loaded under the sampler's id); others sample the base.
        self.samplers_with_weights: set[str] = set()

    def run(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        handler = {
            "create_model": self._create_model,
            "create_from_weights": self._create_from_weights,
            "forward_backward": self._forward_backward,
            "forward": self._forward_backward,
            "optim_step": self._optim_step,
            "save_weights": self._save_weights,
            "save_weights_for_sampler": self._save_for_sampler,
            "load_weights": self._load_weights,
            "sample": self._sample,
        }[request.operation]
        try:
            return handler(resident, request)
        except (PrimitiveInputError, WireError, ValueError) as exc:
            raise CallRefused(str(exc)) from exc

    # --- training ------------------------------------------------------------------------------------------

    def _create_model(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        return _json({"model_id": request.target_id, "type": "create_model"})

    def _create_from_weights(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        body = json.loads(request.body)
        record = port.weights_by_id(request.tenant_id, body["weights_id"])
        if record is None:
            raise CallRefused("path: the saved weights were deleted")
        with tempfile.TemporaryDirectory() as tmp:
            self._download(record.storage_path, Path(tmp))
            resident.load_state(request.target_id, tmp, optimizer=bool(body["optimizer"]))
        return _json({"model_id": request.target_id, "path": record.path, "type": "load_weights"})

    def _forward_backward(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        call = decode_forward_backward(request.body)
        data = [Datum([int(t) for t in datum.tokens], datum.inputs) for datum in call.data]
        result = resident.forward_backward(request.target_id, data, call.loss_fn, call.loss_fn_config,
                                           forward_only=call.forward_only)
        outputs = [{"logprobs": out.logprobs, "elementwise_loss": out.elementwise_loss} for out in result.outputs]
        return Outcome(encode_forward_backward_output(outputs, result.metrics), "protobuf",
                       tokens_trained=sum(len(datum.tokens) for datum in data))

    def _optim_step(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        body = wire.OptimStep.model_validate_json(request.body)
        metrics = resident.optim_step(request.target_id, AdamSettings(**body.adam_params.model_dump()))
        return _json({"metrics": metrics, "type": "optim_step"})

    # --- weights ---------------------------------------------------------------------------------------------

    def _save_weights(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        body = wire.SaveWeights.model_validate_json(request.body)
        saved = self._save(resident, request, "state", body.path, optimizer=True)
        return _json({"path": saved.path, "checkpoint_id": saved.checkpoint_id, "type": "save_weights"})

    def _save_for_sampler(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        body = wire.SaveWeightsForSampler.model_validate_json(request.body)
        if body.sampler_id is None:
            assert body.path is not None  # the door requires one of them
            saved = self._save(resident, request, "sampler", body.path, optimizer=False)
            return _json({"path": saved.path, "checkpoint_id": saved.checkpoint_id,
                          "type": "save_weights_for_sampler"})
        name = body.sampler_id.rsplit(":", 2)[-2] + "-" + body.sampler_id.rsplit(":", 1)[-1]
        with tempfile.TemporaryDirectory() as tmp:
            resident.save_state(request.target_id, tmp, optimizer=False)
            saved = self._upload_and_record(request, "sampler", name, Path(tmp))
            self.open_sampler(request.target_id, body.sampler_id, saved.weights_id, Path(tmp))
        return _json({"sampling_session_id": body.sampler_id, "path": saved.path,
                      "checkpoint_id": saved.checkpoint_id, "type": "save_weights_for_sampler"})

    def _load_weights(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        body = wire.LoadWeights.model_validate_json(request.body)
        record = self._resolve(request.tenant_id, body.path)
        with tempfile.TemporaryDirectory() as tmp:
            self._download(record.storage_path, Path(tmp))
            resident.load_state(request.target_id, tmp, optimizer=body.optimizer)
        return _json({"model_id": request.target_id, "path": body.path, "type": "load_weights"})

    def _save(self, resident: ResidentBase, request: PendingRequest, kind: str, name: str, *,
              optimizer: bool) -> port.SavedWeights:
        with tempfile.TemporaryDirectory() as tmp:
            resident.save_state(request.target_id, tmp, optimizer=optimizer)
            return self._upload_and_record(request, kind, name, Path(tmp))

    def _upload_and_record(self, request: PendingRequest, kind: str, name: str, directory: Path) -> port.SavedWeights:
        """Upload a saved state under a fresh prefix (its manifest.json last) and record it with its checkpoint.

        The adapter names its base model as the service does (`builtin:tiny-instruct`, a hub id), not by where
        this worker built it, and manifest.json lists every file with its size and sha256 (as a job's
        checkpoint does): the checkpoint downloads as it is, and a job's worker verifies it and loads it onto
        that base (worker.job_inputs)."""
        _name_base_model(directory, port.weights_base_model(request.tenant_id, request.target_id))
        manifest = build_manifest(directory, 0)
        (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")
        files = {**manifest["files"], MANIFEST_NAME: _described(directory / MANIFEST_NAME)}
        prefix = primitive_weights_prefix(request.tenant_id, secrets.token_hex(12))
        try:
            for relative in sorted(files, key=lambda path: path == MANIFEST_NAME):
                self.storage.put_stream(f"{prefix}/{relative}", _chunks(directory / relative))
        except BaseException:
            self.storage.delete(prefix)  # nothing recorded names these files
            raise
        return port.record_weights(request.tenant_id, request.target_id, kind, name, prefix, files)

    def _resolve(self, tenant_id: str, path: str) -> port.WeightsRecord:
        address = parse_weights_path(path)
        record = port.saved_weights(tenant_id, *address) if address is not None else None
        if record is None:
            raise CallRefused(f"path: weights {path!r} not found")
        return record

    def _download(self, prefix: str, directory: Path) -> None:
        for key in self.storage.list(prefix):
            target = directory / key.removeprefix(prefix + "/")
            target.parent.mkdir(parents=True, exist_ok=True)
            with self.storage.open(key) as source, target.open("wb") as sink:
                while chunk := source.read(CHUNK):
                    sink.write(chunk)

    def download(self, prefix: str, directory: Path) -> None:
        """Saved weights from storage into `directory` (a sampler over them is loaded from there)."""
        self._download(prefix, directory)

    # --- sampling --------------------------------------------------------------------------------------------

    def _sample(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        body = wire.Sample.model_validate_json(request.body)
        params = body.sampling_params
        sequences = resident.sample(
            request.target_id if request.target_id in self.samplers_with_weights else None,
            wire.prompt_tokens(body.prompt),
            num_samples=body.num_samples, max_tokens=params.max_tokens, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p, seed=params.seed, stop=_stop_tokens(resident, params.stop),
        )
        return Outcome(encode_sample_response([
            SampledArrays(seq.tokens, np.asarray(seq.logprobs, dtype=np.float32).tolist(), seq.stop_reason)
            for seq in sequences
        ]), "protobuf", tokens_generated=sum(len(seq.tokens) for seq in sequences))


def _name_base_model(directory: Path, base_model: str) -> None:
    """adapter_config.json's base_model_name_or_path := the service's name of the base model."""
    config_file = directory / ADAPTER_CONFIG
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_model
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _described(file: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    for chunk in _chunks(file):
        digest.update(chunk)
    return {"size": file.stat().st_size, "sha256": digest.hexdigest()}


def _chunks(file: Path) -> Iterator[bytes]:
    with file.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            yield chunk


def _stop_tokens(resident: ResidentBase, stop: str | list[str] | list[int] | None) -> list[list[int]] | None:
    """Tinker's `stop`: None = the model's EOS; token ids stop on themselves; strings on their tokens."""
    if stop is None:
        return None
    items: list[str | int] = [stop] if isinstance(stop, str) else list(stop)
    sequences = []
    for item in items:
        if isinstance(item, int):
            sequences.append([item])
        else:
            sequences.append(list(resident.tokenizer.encode(item, add_special_tokens=False)))
    return sequences
