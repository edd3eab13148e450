"""The engine's model backends, and the one place that picks one (`choose_backend`).

A backend is what the trainer asks of the model for a step: sampling a group's completions, the reference and
old log-probs, the policy's log-probs with gradient, the backward, weight sync to a separate generation engine.
The trainer never names a backend's machinery (lanes, halves, fused kernels).

- `hf` (`ModuleBackend`): the transformers module forward; any causal LM, any device.
- `fused` (`FusedBackend`): the CPU fast path; the Llama family (Llama, Qwen2, Qwen3, Mistral) where
  `fused.fast_decoder.supports` it, on a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from contract.config import GRPOConfig
from worker.grpo.backends.fused import FusedBackend, FusedPath, fast_decoder
from worker.grpo.backends.hf import Forwards, ModuleBackend
from worker.grpo.distributed import Parallel
from worker.grpo.fastpath import FastPath
from worker.grpo.loss import LossSettings
from worker.grpo.modeling import ModelBundle

BackendName = Literal["auto", "hf", "fused"]

__all__ = [
    "BackendName", "Forwards", "FusedBackend", "FusedPath", "ModuleBackend", "backend_for", "choose_backend",
    "fast_path_for", "fused_applies",
]


def fused_applies(models: ModelBundle, config: GRPOConfig) -> bool:
    """Whether the CPU fast path covers this run: a CPU device, an architecture it reproduces on the run's
    sequences, and neither bf16 autocast nor torch.compile, which act on the module forward (module_options).
    On a GPU the module forward is what the libraries (DDP, FSDP2, compile) see."""
    if config.bf16 or config.torch_compile:
        return False
    # The longest sequence known up front; a longer one (no prompt limit) is checked again where it is computed,
    # and takes the module forward there if the fast path does not reproduce it.
    longest = (config.max_prompt_length or 0) + config.max_completion_length
    return models.policy.device.type == "cpu" and fast_decoder.supports(models.policy, longest)


def choose_backend(
    models: ModelBundle, config: GRPOConfig, name: BackendName = "auto", *, sharded: bool = False
) -> None:
    """Choose this run's backend, once, before anything wraps the model (`auto`: fused where it applies, else
    hf): sets `models.fast`, the fast path the module-level functions (log-probs, sampling, reference) and
    the distributed wrappers follow, so every path makes the same choice. `sharded` (fsdp on several ranks):
    always hf, whose module forward gathers one decoder layer at a time; the fused path reads every layer's
    weights in one function, so FSDP would have to gather the whole policy as one unit for it."""
    if sharded and name == "fused":
        raise ValueError("fsdp shards the policy through the module forward: use the hf backend")
    models.fast = None if sharded else fast_path_for(models, config, name)


def backend_for(
    models: ModelBundle, parallel: Parallel, config: GRPOConfig, loss_settings: LossSettings, output_dir: Path
) -> ModuleBackend:
    """The chosen backend (`choose_backend`) for this run."""
    kind = ModuleBackend if models.fast is None else FusedBackend
    return kind(models, parallel, config, loss_settings, output_dir)


def fast_path_for(models: ModelBundle, config: GRPOConfig, name: BackendName = "auto") -> FastPath | None:
    """The fast path the backend `name` gives these models (`auto`: fused where it applies), or None."""
    fused = fused_applies(models, config) if name == "auto" else name == "fused"
    return FusedPath() if fused else None
