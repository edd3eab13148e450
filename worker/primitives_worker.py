"""`grpo primitives-worker`: the worker role behind the primitive training API (the Tinker door).

It loads each base model of GRPO_PRIMITIVES_BASE_MODELS once and keeps it resident; every tenant's training
client is a LoRA adapter with its own AdamW state on that one copy (worker.grpo.resident), every sampler a
frozen adapter or the base itself. The loop, on the execution port (service.execution.primitives):
heartbeat; take new clients and samplers of its models; free those whose sessions closed; run the next call of
each held target (a training client's in seq_id order); write each outcome to its future. Calls run one at a
time: the base model is shared, and one call's forward and backward use the cores the machine has.

Other workers' silence is noticed here too: a worker that stops heartbeating has its pending calls failed as
retryable and its clients handed to a live worker, which starts them fresh (the client then calls
load_weights), and sessions whose SDK stopped heartbeating are closed, which frees their adapters.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from service.execution import primitives as port
from service.execution.lease import process_worker_id
from service.execution.primitives import CallUsage, PendingRequest, Target
from service.execution.runtime import Settings, Storage
from worker.grpo.allocator import return_freed_memory
from worker.grpo.model_paths import resolve_model_path
from worker.grpo.primitive_vllm import VLLMSampler
from worker.grpo.resident import LoraSpec, ResidentBase
from worker.primitive_calls import CallRefused, CallRunner
from worker.scratch import claim_scratch, release_scratch

log = logging.getLogger(__name__)

# Seconds between the loop's idle polls of the database, and between its housekeeping rounds (heartbeat, other
# workers' silence, silent sessions).
IDLE_POLL_SECONDS = 0.05
HOUSEKEEPING_SECONDS = 5.0


def prepare_process() -> None:
    """Process-wide settings of a primitives worker, called once by its entry point before the models load.

    Large freed blocks go back to the kernel (worker.grpo.allocator.return_freed_memory): a worker holds many
    tenants' adapters and AdamW states for hours, and with glibc's default policy the freed activations of each
    call stay in the process, between those states, so resident memory grows with the calls rather than with
    the clients (bench/README.md, "Many LoRA clients on one base: memory").
    """
    return_freed_memory()


class PrimitivesWorker:
    def __init__(self, settings: Settings, storage: Storage, *, cache_dir: Path, device: str | None = None) -> None:
        self.settings = settings
        self.name = process_worker_id()
        # Idle training clients' states on this worker's disk (`_offload_idle`); the adapters its vLLM engines read.
        self.offload_dir = claim_scratch(Path(settings.data_dir) / "primitives-offload", self.name)
        self.vllm_dir = claim_scratch(Path(settings.data_dir) / "primitives-vllm", self.name)
        self.residents: dict[str, ResidentBase] = {}
        self.published: dict[str, dict[str, Any]] = {}
        for base_model in settings.primitives_base_models:
            resident = ResidentBase(resolve_model_path(base_model, cache_dir), device=device or "cpu")
            if settings.primitives_sampler == "vllm":
                resident.use_vllm(self._vllm_engine(resident))
            self.residents[base_model] = resident
            self.published[base_model] = {
                "tokenizer_id": resident.base_model_dir, "vocab_size": resident.vocab_size,
                "arch": resident.architecture,
            }
        self.held: dict[str, Target] = {}
        self.calls = CallRunner(self.name, storage, self._open_snapshot_sampler)
        self._last_housekeeping = 0.0
        # The clients offloaded, and when each client last ran.
        self.offloaded: dict[str, Path] = {}
        self.last_used: dict[str, float] = {}

    def _vllm_engine(self, resident: ResidentBase) -> VLLMSampler:
        folder = hashlib.sha256(resident.base_model_dir.encode()).hexdigest()[:24]
        return VLLMSampler(
            resident.base_model_dir, self.vllm_dir / folder,
            max_lora_rank=self.settings.primitives_vllm_max_lora_rank, device=resident.device,
            gpu_memory_utilization=self.settings.primitives_vllm_gpu_memory_utilization,
        )

    def close(self) -> None:
        """Stop the residents' vLLM engines, if any, and remove this worker's files (the process's exit frees
        the rest; a killed worker's files go when the next worker starts: worker.scratch)."""
        for resident in self.residents.values():
            resident.close()
        release_scratch(self.offload_dir)
        release_scratch(self.vllm_dir)

    # --- the loop --------------------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        log.info("primitives worker %s serving %s", self.name, ", ".join(self.residents))
        while not stop.is_set():
            if not self.step():
                stop.wait(IDLE_POLL_SECONDS)

    def step(self) -> bool:
        """One round; True when a call ran (the next round starts at once)."""
        now = time.monotonic()
        if now - self._last_housekeeping >= HOUSEKEEPING_SECONDS:
            self._housekeeping()
            self._last_housekeeping = now
        for target in port.adopt(self.name, list(self.residents)):
            self._hold(target)
        for target_id in port.closed_targets(self.name, list(self.held)):
            self._drop(target_id)
        calls = port.next_requests(self.name, list(self.held))
        for call in calls:
            self._run(call)
        self._offload_idle(time.monotonic())
        return bool(calls)

    def _housekeeping(self) -> None:
        port.heartbeat(self.name, self.published)
        port.release_lapsed_workers(timedelta(seconds=self.settings.primitives_worker_stale_seconds))
        port.close_silent_sessions(timedelta(seconds=self.settings.primitives_session_timeout_seconds))

    def _run(self, call: PendingRequest) -> None:
        target = self.held[call.target_id]
        self.last_used[call.target_id] = time.monotonic()
        started = time.perf_counter()
        try:
            self._bring_back(call.target_id)
            outcome = self.calls.run(self.residents[target.base_model], call)
        except CallRefused as exc:
            port.fail(self.name, call.id, str(exc), "user", self._usage(started))
        except Exception:
            log.exception("call %s (%s) of %s failed", call.id, call.operation, call.target_id)
            port.fail(self.name, call.id, f"{call.operation} failed on the server; resubmit it", "server",
                      self._usage(started))
        else:
            port.finish(self.name, call.id, outcome.body, outcome.media,
                        self._usage(started, outcome.tokens_generated, outcome.tokens_trained))

    @staticmethod
    def _usage(started: float, generated: int = 0, trained: int = 0) -> CallUsage:
        return CallUsage(generated, trained, time.perf_counter() - started)

    # --- what the worker holds -------------------------------------------------------------------------------

    def _hold(self, target: Target) -> None:
        resident = self.residents[target.base_model]
        if target.kind == "training":
            lora = target.lora or {}
            resident.add_client(target.id, LoraSpec(
                rank=int(lora["rank"]), seed=lora.get("seed"), train_mlp=bool(lora.get("train_mlp", True)),
                train_attn=bool(lora.get("train_attn", True)), train_unembed=bool(lora.get("train_unembed", True)),
            ))
        elif target.weights_path is not None:
            with tempfile.TemporaryDirectory() as tmp:
                self.calls.download(target.weights_path, Path(tmp))
                resident.add_sampler(target.id, tmp)
            self.calls.samplers_with_weights.add(target.id)
        self.held[target.id] = target

    def _offload_idle(self, now: float) -> None:
        """Move training clients idle for GRPO_PRIMITIVES_IDLE_OFFLOAD_SECONDS out of memory, adapter and AdamW
        state, to this worker's disk; their next call brings them back exactly (`_bring_back`). A client whose
        gradients await optim_step stays: a saved state holds no gradients."""
        limit = self.settings.primitives_idle_offload_seconds
        for target_id, target in list(self.held.items()):
            idle = now - self.last_used.setdefault(target_id, now)
            if target.kind != "training" or target_id in self.offloaded or idle < limit:
                continue
            resident = self.residents[target.base_model]
            if resident.has_gradients(target_id):
                continue
            directory = self.offload_dir / hashlib.sha256(target_id.encode()).hexdigest()[:24]
            resident.save_state(target_id, directory, optimizer=True)
            resident.remove_client(target_id)
            self.offloaded[target_id] = directory

    def _bring_back(self, target_id: str) -> None:
        directory = self.offloaded.pop(target_id, None)
        if directory is not None:
            self.residents[self.held[target_id].base_model].load_state(target_id, directory, optimizer=True)
            shutil.rmtree(directory, ignore_errors=True)

    def _open_snapshot_sampler(self, client_id: str, sampler_id: str, weights_id: str, directory: Path) -> None:
        client = self.held[client_id]
        self.residents[client.base_model].add_sampler(sampler_id, directory)
        self.calls.samplers_with_weights.add(sampler_id)
        port.open_sampler(self.name, client_id, sampler_id, weights_id)
        self.held[sampler_id] = Target(sampler_id, client.tenant_id, "sampling", client.base_model, None, None)

    def _drop(self, target_id: str) -> None:
        target = self.held.pop(target_id)
        self.last_used.pop(target_id, None)
        resident = self.residents[target.base_model]
        if target_id in self.offloaded:
            shutil.rmtree(self.offloaded.pop(target_id), ignore_errors=True)
        elif target.kind == "training":
            resident.remove_client(target_id)
        elif target_id in self.calls.samplers_with_weights:
            resident.remove_sampler(target_id)
            self.calls.samplers_with_weights.discard(target_id)
