"""One call of the primitive training API, run on a resident base model: the request's body in, the response's
body out (JSON, or protobuf for forward_backward and sampling, as the Tinker SDK reads them).

Bad input raises `CallRefused` (the future fails with category "user": resent as is, it would fail again);
anything else is the server's failure. Saved weights go to storage under a fresh prefix per save and are then
recorded, so a recorded save is always complete.
"""

from __future__ import annotations

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
from service.execution import primitives as port
from service.execution.primitives import PendingRequest
from service.execution.runtime import Storage, primitive_weights_prefix
from worker.grpo.primitive_errors import PrimitiveInputError
from worker.grpo.resident import AdamSettings, Datum, ResidentBase

PATH_KINDS = {"weights": "state", "sampler_weights": "sampler"}
CHUNK = 1 << 20


class CallRefused(Exception):
    """The caller's mistake; the message names the field."""


@dataclass(frozen=True)
class Outcome:
    body: bytes
    media: str  # "json" | "protobuf"


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
        return Outcome(encode_forward_backward_output(outputs, result.metrics), "protobuf")

    def _optim_step(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        body = wire.OptimStep.model_validate_json(request.body)
        metrics = resident.optim_step(request.target_id, AdamSettings(**body.adam_params.model_dump()))
        return _json({"metrics": metrics, "type": "optim_step"})

    # --- weights ---------------------------------------------------------------------------------------------

    def _save_weights(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        body = wire.SaveWeights.model_validate_json(request.body)
        path = self._save(resident, request, "state", body.path, optimizer=True)
        return _json({"path": path, "type": "save_weights"})

    def _save_for_sampler(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        body = wire.SaveWeightsForSampler.model_validate_json(request.body)
        if body.sampler_id is None:
            assert body.path is not None  # the door requires one of them
            return _json({"path": self._save(resident, request, "sampler", body.path, optimizer=False),
                          "type": "save_weights_for_sampler"})
        name = body.sampler_id.rsplit(":", 2)[-2] + "-" + body.sampler_id.rsplit(":", 1)[-1]
        with tempfile.TemporaryDirectory() as tmp:
            resident.save_state(request.target_id, tmp, optimizer=False)
            path, weights_id = self._upload_and_record(request, "sampler", name, Path(tmp))
            self.open_sampler(request.target_id, body.sampler_id, weights_id, Path(tmp))
        return _json({"sampling_session_id": body.sampler_id, "path": path, "type": "save_weights_for_sampler"})

    def _load_weights(self, resident: ResidentBase, request: PendingRequest) -> Outcome:
        body = wire.LoadWeights.model_validate_json(request.body)
        record = self._resolve(request.tenant_id, body.path)
        with tempfile.TemporaryDirectory() as tmp:
            self._download(record.storage_path, Path(tmp))
            resident.load_state(request.target_id, tmp, optimizer=body.optimizer)
        return _json({"model_id": request.target_id, "path": body.path, "type": "load_weights"})

    def _save(self, resident: ResidentBase, request: PendingRequest, kind: str, name: str, *, optimizer: bool) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            resident.save_state(request.target_id, tmp, optimizer=optimizer)
            path, _ = self._upload_and_record(request, kind, name, Path(tmp))
        return path

    def _upload_and_record(self, request: PendingRequest, kind: str, name: str, directory: Path) -> tuple[str, str]:
        prefix = primitive_weights_prefix(request.tenant_id, secrets.token_hex(12))
        for file in sorted(p for p in directory.rglob("*") if p.is_file()):
            self.storage.put_stream(f"{prefix}/{file.relative_to(directory).as_posix()}", _chunks(file))
        weights_id = port.record_weights(request.tenant_id, request.target_id, kind, name, prefix)
        segment = "weights" if kind == "state" else "sampler_weights"
        return f"tinker://{request.target_id}/{segment}/{name}", weights_id

    def _resolve(self, tenant_id: str, path: str) -> port.WeightsRecord:
        parts = path.removeprefix("tinker://").split("/")
        record = None
        if path.startswith("tinker://") and len(parts) == 3 and parts[1] in PATH_KINDS:
            record = port.saved_weights(tenant_id, parts[0], PATH_KINDS[parts[1]], parts[2])
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
        ]), "protobuf")


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
