"""Sampling for the primitive training API through vLLM (GRPO_PRIMITIVES_SAMPLER=vllm): one engine per resident
base model, each sampler's saved adapter served as a LoRA request on it.

The base is frozen, so the engine loads it from the same model folder as worker.grpo.resident, in the resident's
float32, and never needs a weight sync; samplers are frozen adapters in peft's format (save_state's directory),
which vLLM loads as they are (lm_head included, tied embeddings too). Many tenants' samplers on one base are what
vLLM's multi-LoRA serving is for: one copy of the base, a small adapter each. The calls run one at a time
(worker.primitives_worker), so one LoRA slot is active per batch; up to MAX_CPU_LORAS adapters stay loaded in
host memory and the others are read again from their folder when next asked for.

Semantics are the native sampler's (worker.grpo.primitive_sampling): a sequence ends at a stop sequence (kept
in its tokens) or after max_tokens; temperature 0 decodes greedily; Tinker's top_k -1 keeps every token. The
differences, where vLLM has no equivalent:
- Stop sequences of one token end decoding in the engine (`stop_token_ids`); longer ones (stop strings) have no
  counterpart in vLLM's token API, so such a sequence is sampled on and cut at its first stop afterwards: the
  same tokens, at the cost of decoding past the stop.
- Log-probs are vLLM's "processed" ones, under the distribution sampled from: after temperature, as the
  native sampler's; with top_k or top_p on, renormalised over the tokens they keep (the native sampler reports
  them over the whole vocabulary). With both off, the usual RL setting, the two agree.
- A seed makes a sample reproducible on one engine, but vLLM draws its own random numbers: the same seed gives
  other tokens than the native sampler.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from worker.grpo.primitive_sampling import SampledSequence, SamplingSettings, StopReason
from worker.grpo.vllm_rollout import (
    CPU_KV_CACHE_MAX_BYTES,
    CPU_KV_CACHE_MIN_BYTES,
    VLLMUnavailable,
    bind_engine_to_loopback,
    build_llm,
    kv_bytes_per_token,
    vllm_installed,
)

# Adapters kept loaded in host memory beyond the one in the active slot.
MAX_CPU_LORAS = 16
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_BASE = "\0base"  # the base's own adapter (set_base_adapter), under a key that no sampler id is
_CPU_KV_SEQUENCES = 4  # a CPU engine's KV cache holds this many sequences at the model's full length


class VLLMSampler:
    """A vLLM engine over one base model folder; `add_adapter` registers a sampler's adapter under its id."""

    def __init__(
        self, model_dir: str | Path, workdir: str | Path, *, max_lora_rank: int, device: torch.device,
        gpu_memory_utilization: float, seed: int = 0,
    ) -> None:
        """`workdir`: where the adapters' files are kept while their samplers live (vLLM reads them lazily);
        `max_lora_rank`: one of vLLM's (the settings check it)."""
        if not vllm_installed():
            raise VLLMUnavailable("GRPO_PRIMITIVES_SAMPLER", "set it to native")
        self.max_lora_rank = max_lora_rank
        self.max_length: int | None = None  # the longest prompt + completion, where the engine sets one
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._adapters: dict[str, Any] = {}  # sampler id -> its vllm LoRARequest
        self._lora_ids = itertools.count(1)  # vLLM's adapter ids: positive and never reused
        options: dict[str, Any] = {
            "model": str(model_dir),
            "dtype": "float32",  # the resident's: sampled log-probs match forward_backward's
            "seed": seed,
            "logprobs_mode": "processed_logprobs",
            "enable_lora": True,
            "max_lora_rank": max_lora_rank,
            "max_loras": 1,
            "max_cpu_loras": MAX_CPU_LORAS,
        }
        if device.type == "cuda":
            options["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            # No CUDA graphs to capture on CPU. The KV cache is sized here (vLLM's default is a share of the host's
            # memory), and the longest sequence to what it holds.
            kv_bytes, self.max_length = _cpu_kv_cache(Path(model_dir))
            options |= {"enforce_eager": True, "kv_cache_memory_bytes": kv_bytes, "max_model_len": self.max_length}
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine, as the rollouts'
        bind_engine_to_loopback()  # a process group of one
        self.llm = build_llm(options)

    def serves(self, rank: int) -> bool:
        """Whether an adapter of this rank fits the engine's LoRA slots."""
        return rank <= self.max_lora_rank

    def add_adapter(self, sampler_id: str, directory: Path) -> None:
        # vLLM: optional (the vllm extras), imported only where a worker asked for it.
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        kept = self.workdir / f"adapter-{lora_id}"
        kept.mkdir()
        for name in ADAPTER_FILES:
            shutil.copyfile(directory / name, kept / name)
        self._adapters[sampler_id] = LoRARequest(f"sampler-{lora_id}", lora_id, str(kept))

    def set_base_adapter(self, directory: Path) -> None:
        """An adapter that computes the base exactly (B = 0), which the base's requests carry.

        A LoRA-enabled engine must not see a request without an adapter: vLLM's torch LoRA ops (its CPU path)
        pick a request's slot by indexing with its adapter index, and "no adapter", -1, indexes the last slot,
        so such a request would run under whichever adapter was loaded last."""
        self.add_adapter(_BASE, directory)

    def remove_adapter(self, sampler_id: str) -> None:
        request = self._adapters.pop(sampler_id)
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def has_adapter(self, sampler_id: str) -> bool:
        return sampler_id != _BASE and sampler_id in self._adapters

    def sample(
        self, sampler_id: str | None, prompt: list[int], num_samples: int, settings: SamplingSettings
    ) -> list[SampledSequence]:
        """`num_samples` continuations of `prompt` under the sampler's adapter, or the base (None)."""
        # vLLM: optional, as in add_adapter.
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        single = [seq[0] for seq in settings.stop if len(seq) == 1]
        longer = tuple(seq for seq in settings.stop if len(seq) > 1)
        greedy = settings.temperature == 0  # vLLM refuses n > 1 there: one sample, copied (greedy is deterministic)
        params = SamplingParams(
            n=1 if greedy else num_samples,
            temperature=settings.temperature,
            top_k=max(settings.top_k, 0),  # 0 = off in vLLM, as Tinker's -1
            top_p=settings.top_p,
            max_tokens=settings.max_tokens,
            stop_token_ids=single,
            ignore_eos=True,  # the model's EOS ends a sequence only as one of `settings.stop` (None: the EOS ids)
            logprobs=0,  # the sampled token's own
            detokenize=False,
            seed=settings.seed % 2**63,
        )
        lora = self._adapters[_BASE if sampler_id is None else sampler_id]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, lora_request=lora, use_tqdm=False)
        sequences = [_sequence(sample, longer) for sample in outputs[0].outputs]
        return sequences * num_samples if greedy else sequences

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _sequence(sample: Any, longer: tuple[tuple[int, ...], ...]) -> SampledSequence:
    """One vLLM completion as the native sampler returns it, cut at its first multi-token stop sequence."""
    tokens = list(sample.token_ids)
    logprobs = [position[token].logprob for position, token in zip(sample.logprobs, tokens, strict=True)]
    reason: StopReason = "stop" if sample.finish_reason == "stop" else "length"
    for end in range(1, len(tokens) + 1):
        if any(end >= len(seq) and tuple(tokens[end - len(seq) : end]) == seq for seq in longer):
            return SampledSequence(tokens[:end], logprobs[:end], "stop")
    return SampledSequence(tokens, logprobs, reason)


def _cpu_kv_cache(model_dir: Path) -> tuple[int, int]:
    """A CPU engine's KV cache bytes and longest sequence: room for _CPU_KV_SEQUENCES sequences at the model's
    full length within [64 MiB, 4 GiB] (float32), the length cut to what 4 GiB holds."""
    config = AutoConfig.from_pretrained(model_dir)
    per_token = kv_bytes_per_token(config, 4)  # float32
    positions = int(getattr(config, "max_position_embeddings", 4096))
    length = min(positions, CPU_KV_CACHE_MAX_BYTES // (_CPU_KV_SEQUENCES * per_token))
    return max(CPU_KV_CACHE_MIN_BYTES, _CPU_KV_SEQUENCES * length * per_token), length
