"""One base causal LM resident in memory, serving many clients of the primitive (Tinker-style) training API.

Each client is a named LoRA adapter on the one shared base (peft's add_adapter / set_adapter /
delete_adapter) with its own AdamW over its adapter's parameters only; samplers are frozen adapters loaded
from saved states, and `sample(None, ...)` samples the base itself (peft's disable_adapter). With a vLLM engine
(use_vllm, worker.grpo.primitive_vllm), the base and the samplers sample there instead. The adapters
share the base's modules and one is active at a time, so every call holds one lock.

Tinker's semantics: a datum's tokens are the model input and `loss_fn_inputs` hold one value per input
token, position i's target `target_tokens[i]` predicted from tokens[:i + 1]; a loss is the sum over tokens
and datums (worker.grpo.primitive_losses); gradients accumulate over forward_backward calls until
optim_step, which steps and zeroes them.

LoRA: alpha = 32 whatever the rank (scaling 32 / rank): the tinker-cookbook's lora_alpha (the default of
hyperparam_utils.get_lora_lr_over_full_finetune_lr; "LoRA Without Regret", https://thinkingmachines.ai/blog/lora/,
fixes alpha so that the best learning rate barely depends on the rank). A is initialised as peft does
(Kaiming-uniform) from the client's seed in a forked RNG, B = 0: a new adapter computes the base exactly,
and one seed gives one adapter whatever else is loaded. Trained modules (Tinker's LoraConfig flags): the
attention's q/k/v/o projections, the MLP's gate/up/down projections, the unembedding `lm_head`.

A saved state is a peft adapter directory (adapter_model.safetensors, adapter_config.json: it loads with
PeftModel.from_pretrained) plus lora_spec.json (the client's LoraSpec) and, with the optimizer,
optimizer.pt (AdamW's state_dict): loading it back gives the same next step, bit for bit.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from worker.grpo.primitive_errors import PrimitiveConflict, PrimitiveInputError, PrimitiveNotFound
from worker.grpo.primitive_losses import LossFn, check_inputs, check_loss_fn, elementwise_loss, resolve_config
from worker.grpo.primitive_sampling import SampledSequence, SamplingSettings, sample_sequences
from worker.grpo.rollout import eos_token_ids

if TYPE_CHECKING:  # the engine only: vLLM is optional, and the worker hands one in (use_vllm)
    from worker.grpo.primitive_vllm import VLLMSampler

LORA_ALPHA = 32
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
SPEC_FILE, ADAPTER_FILE, OPTIMIZER_FILE = "lora_spec.json", "adapter_model.safetensors", "optimizer.pt"
# peft needs one adapter at all times (its model breaks with none): a rank-1 one that is never trained
# (B = 0, so it computes the base) and is active only between calls.
_PLACEHOLDER = "resident_placeholder"

__all__ = [
    "AdamSettings", "Datum", "DatumOutput", "ForwardBackwardResult", "LoraSpec", "ResidentBase", "SampledSequence",
]


@dataclass(frozen=True)
class LoraSpec:
    """A client's adapter (Tinker's LoraConfig): rank, the seed of its initialisation (None: a fresh one,
    returned by add_client) and which modules it trains."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class AdamSettings:
    """One optimizer step's hyperparameters (Tinker's AdamParams and its defaults); grad_clip_norm 0 = no clip."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class Datum:
    """The model input (N token ids) and the loss's inputs, each an array of N values (module docstring)."""

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class DatumOutput:
    """Per input position: the log-prob of its target token and its loss, both float32 of length N."""

    logprobs: np.ndarray
    elementwise_loss: np.ndarray


@dataclass(frozen=True)
class ForwardBackwardResult:
    """One output per datum, in order, and metrics named `name:reduction` as the SDK folds them (`loss:sum`)."""

    outputs: list[DatumOutput]
    metrics: dict[str, float]


@dataclass
class _Client:
    adapter: str  # peft's name for it: ids are the caller's, and peft chokes on dots and some substrings
    spec: LoraSpec  # its seed resolved
    params: list[nn.Parameter]  # the adapter's, in module order (AdamW's state is keyed by this order)
    optimizer: torch.optim.AdamW


@dataclass(frozen=True)
class _Checked:
    tokens: Tensor  # (N,) int64
    inputs: dict[str, Tensor]  # each (N,)


class ResidentBase:
    """A base model loaded once, its clients (adapter + AdamW each) and samplers (frozen adapters)."""

    def __init__(
        self, model_dir: str | Path, *, device: str | torch.device = "cpu", max_batch_tokens: int = 16384
    ) -> None:
        """Load `model_dir` (float32) and its tokenizer. `max_batch_tokens`: forward_backward runs its datums
        in padded batches of at most this many positions (one datum alone may exceed it)."""
        self.base_model_dir = str(model_dir)
        self.device = torch.device(device)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        base.to(self.device)  # type: ignore[arg-type]
        base.eval()  # no dropout: a call's result depends on its inputs alone
        base.requires_grad_(False)
        self.architecture = type(base).__name__  # e.g. LlamaForCausalLM, for a model's description
        self.vocab_size = min(base.get_input_embeddings().num_embeddings, base.get_output_embeddings().out_features)
        self._max_positions: int | None = getattr(base.config, "max_position_embeddings", None)
        self._eos_ids = eos_token_ids(base, self.tokenizer)
        linears = (name for name, module in base.named_modules() if isinstance(module, nn.Linear))
        self._linear_names = {name.rsplit(".", 1)[-1] for name in linears}
        supported = [*UNEMBED_MODULES, *ATTENTION_MODULES, *MLP_MODULES]
        first = next((name for name in supported if name in self._linear_names), None)
        if first is None:
            raise ValueError(f"{model_dir}: none of the LoRA target modules {supported} is a linear layer here")
        with torch.random.fork_rng(devices=[]):
            self._peft: PeftModel = get_peft_model(base, self._lora_config(1, [first]), adapter_name=_PLACEHOLDER)
        self._module: Any = self._peft.base_model.model  # the transformers model, LoRA layers injected
        self._clients: dict[str, _Client] = {}
        self._samplers: dict[str, str] = {}  # sampler id -> adapter name
        self._names = itertools.count()
        self._max_batch_tokens = max_batch_tokens
        self._lock = threading.RLock()
        self._vllm: VLLMSampler | None = None

    def use_vllm(self, engine: VLLMSampler) -> None:
        """Sample the base, and samplers whose adapters fit the engine's LoRA rank, through vLLM from now on
        (worker.grpo.primitive_vllm, loaded from this base's folder); training clients sample natively."""
        with self._lock, tempfile.TemporaryDirectory() as tmp:
            self._write_adapter(_PLACEHOLDER, Path(tmp))  # B = 0: it computes the base
            engine.set_base_adapter(Path(tmp))
            self._vllm = engine

    def close(self) -> None:
        """Stop the vLLM engine, if any."""
        with self._lock:
            if self._vllm is not None:
                self._vllm.close()
                self._vllm = None

    # --- clients ----------------------------------------------------------------------------------------

    def add_client(self, client_id: str, spec: LoraSpec) -> LoraSpec:
        """A new adapter for `client_id`, initialised from `spec.seed`, and a fresh AdamW over it. Returns the
        spec with its seed (a fresh one when it was None)."""
        targets = self._targets(spec)
        resolved = spec if spec.seed is not None else replace(spec, seed=random.SystemRandom().randrange(2**63))
        assert resolved.seed is not None
        with self._lock:
            self._check_free(client_id)
            adapter = self._add_adapter("client", self._lora_config(resolved.rank, targets), resolved.seed)
            params = self._adapter_params(adapter)
            self._clients[client_id] = _Client(adapter, resolved, params, _adamw(params))
        return resolved

    def remove_client(self, client_id: str) -> None:
        """Drop the client's adapter, gradients and optimizer state."""
        with self._lock:
            client = self._client(client_id)
            del self._clients[client_id]
            self._delete_adapter(client.adapter)

    def client_spec(self, client_id: str) -> LoraSpec:
        with self._lock:
            return self._client(client_id).spec

    def has_gradients(self, client_id: str) -> bool:
        """Whether forward_backward calls have left gradients that the next optim_step will apply."""
        with self._lock:
            return any(param.grad is not None for param in self._client(client_id).params)

    def forward_backward(
        self,
        client_id: str,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        forward_only: bool = False,
    ) -> ForwardBackwardResult:
        """Log-probs and loss of each datum under the client's adapter; unless `forward_only`, the summed
        loss's gradient is added to the adapter's (kept until optim_step). Bad input raises
        PrimitiveInputError naming the field, before anything runs."""
        fn = check_loss_fn(loss_fn)
        settings = resolve_config(fn, loss_fn_config)
        if not data:
            raise PrimitiveInputError("data", "no datums")
        checked = [self._check_datum(fn, datum, f"data[{index}]") for index, datum in enumerate(data)]
        outputs: list[DatumOutput] = []
        total = 0.0
        with self._lock:
            self._peft.set_adapter(self._client(client_id).adapter)  # trainable, the others frozen
            for chunk in _chunks([len(item.tokens) for item in checked], self._max_batch_tokens):
                batch = [checked[index] for index in chunk]
                with torch.set_grad_enabled(not forward_only):
                    logprobs = self._target_logprobs(batch)  # one (N_i,) per datum
                    losses = [
                        elementwise_loss(fn, lp, {k: v.to(self.device) for k, v in item.inputs.items()}, settings)
                        for lp, item in zip(logprobs, batch, strict=True)
                    ]
                    loss = torch.stack([elementwise.sum() for elementwise in losses]).sum()
                    if not forward_only:
                        loss.backward()  # the sum over datums: batches' gradients add up to the call's
                total += float(loss.detach())
                outputs.extend(DatumOutput(_numpy(lp), _numpy(el)) for lp, el in zip(logprobs, losses, strict=True))
            self._peft.set_adapter(_PLACEHOLDER, inference_mode=True)
        return ForwardBackwardResult(outputs, {"loss:sum": total})

    def optim_step(self, client_id: str, adam: AdamSettings) -> dict[str, float]:
        """One AdamW step of the client's adapter with `adam`'s hyperparameters on its accumulated gradients
        (their global norm clipped to grad_clip_norm when > 0), then the gradients are zeroed. Metrics:
        grad_norm:mean (before clipping), learning_rate:mean."""
        _check_adam(adam)
        with self._lock:
            client = self._client(client_id)
            with_grad = [p for p in client.params if p.grad is not None]
            grads = [p.grad for p in with_grad if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            if adam.grad_clip_norm > 0 and with_grad:
                torch.nn.utils.clip_grads_with_norm_(with_grad, adam.grad_clip_norm, norm)
            for group in client.optimizer.param_groups:
                group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps)
                group["weight_decay"] = adam.weight_decay
            client.optimizer.step()
            client.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": float(norm), "learning_rate:mean": adam.learning_rate}

    # --- sampling -------------------------------------------------------------------------------------------

    def sample(
        self,
        adapter: str | None,
        prompt: Sequence[int],
        *,
        num_samples: int = 1,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[Sequence[int]] | None = None,
    ) -> list[SampledSequence]:
        """`num_samples` continuations of `prompt` under the adapter of a client or sampler id, or the base
        (None). `seed` makes them reproducible (None: a fresh one). `stop`: token-id sequences that end a
        sequence, kept in its tokens; None = the model's EOS tokens, [] = none (max_tokens only), as Tinker's
        SamplingParams. Log-probs: worker.grpo.primitive_sampling."""
        prompt_ids = self._check_tokens(prompt, "prompt")
        settings = self._sampling_settings(
            len(prompt_ids), num_samples, max_tokens, temperature, top_k, top_p, seed, stop
        )
        with self._lock:
            engine = self._vllm
            if engine is not None and (adapter is None or engine.has_adapter(adapter)):
                if engine.max_length is not None and len(prompt_ids) + max_tokens > engine.max_length:
                    raise PrimitiveInputError(
                        "sampling_params.max_tokens", f"prompt + max_tokens exceed the sampler's {engine.max_length}"
                    )
                return engine.sample(adapter, prompt_ids, num_samples, settings)
            with self._active(adapter):
                return sample_sequences(self._module, prompt_ids, num_samples, settings)

    def add_sampler(self, sampler_id: str, directory: str | Path) -> None:
        """Load a saved state's adapter (save_state's directory) as a frozen adapter to sample under."""
        path = Path(directory)
        spec = _read_spec(path)
        targets = self._targets(spec)
        with self._lock:
            self._check_free(sampler_id)
            adapter = self._add_adapter("sampler", self._lora_config(spec.rank, targets), 0)
            try:
                self._load_adapter_weights(adapter, path)
            except Exception:
                self._delete_adapter(adapter)
                raise
            for param in self._adapter_params(adapter):
                param.requires_grad_(False)
            self._samplers[sampler_id] = adapter
            if self._vllm is not None and self._vllm.serves(spec.rank):
                self._vllm.add_adapter(sampler_id, path)

    def remove_sampler(self, sampler_id: str) -> None:
        with self._lock:
            if sampler_id not in self._samplers:
                raise PrimitiveNotFound("sampler", sampler_id)
            self._delete_adapter(self._samplers.pop(sampler_id))
            if self._vllm is not None and self._vllm.has_adapter(sampler_id):
                self._vllm.remove_adapter(sampler_id)

    # --- saved states ---------------------------------------------------------------------------------------

    def save_state(self, client_id: str, directory: str | Path, *, optimizer: bool = True) -> None:
        """Write the client's adapter (and with `optimizer`, its AdamW state) into `directory`."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        with self._lock:
            client = self._client(client_id)
            self._write_adapter(client.adapter, path)
            spec = {**asdict(client.spec), "lora_alpha": LORA_ALPHA, "target_modules": self._targets(client.spec)}
            (path / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
            if optimizer:
                torch.save(client.optimizer.state_dict(), path / OPTIMIZER_FILE)

    def load_state(self, client_id: str, directory: str | Path, *, optimizer: bool = True) -> LoraSpec:
        """Load a saved state into the client (created from the saved spec when it is not loaded): its adapter
        weights and, with `optimizer`, its AdamW state (else a fresh AdamW). Pending gradients are dropped."""
        path = Path(directory)
        spec = _read_spec(path)
        if optimizer and not (path / OPTIMIZER_FILE).is_file():
            raise PrimitiveInputError("path", f"{path} holds no optimizer state ({OPTIMIZER_FILE})")
        with self._lock:
            created = client_id not in self._clients
            if created:
                self.add_client(client_id, spec)
            client = self._clients[client_id]
            if replace(client.spec, seed=None) != replace(spec, seed=None):
                raise PrimitiveInputError("path", f"the saved adapter is {spec}, the client's {client.spec}")
            try:
                self._load_adapter_weights(client.adapter, path)
                client.optimizer = self._load_optimizer(client.params, path) if optimizer else _adamw(client.params)
            except Exception:
                if created:
                    self.remove_client(client_id)
                raise
            for param in client.params:
                param.grad = None
            return client.spec

    # --- helpers --------------------------------------------------------------------------------------------

    def _client(self, client_id: str) -> _Client:
        if client_id not in self._clients:
            raise PrimitiveNotFound("client", client_id)
        return self._clients[client_id]

    def _check_free(self, identifier: str) -> None:
        if identifier in self._clients or identifier in self._samplers:
            raise PrimitiveConflict(identifier)

    @contextmanager
    def _active(self, adapter: str | None) -> Iterator[None]:
        """The named client's or sampler's adapter active (frozen), or every adapter off for None."""
        if adapter is None:
            with self._peft.disable_adapter():
                yield
            return
        if adapter in self._clients:
            name = self._clients[adapter].adapter
        elif adapter in self._samplers:
            name = self._samplers[adapter]
        else:
            raise PrimitiveNotFound("client or sampler", adapter)
        self._peft.set_adapter(name, inference_mode=True)
        try:
            yield
        finally:
            self._peft.set_adapter(_PLACEHOLDER, inference_mode=True)

    def _write_adapter(self, adapter: str, path: Path) -> None:
        """The adapter in peft's format: adapter_model.safetensors and adapter_config.json."""
        # The adapter alone: with lm_head trained peft would also copy the base's unembedding by default.
        state = get_peft_model_state_dict(self._peft, adapter_name=adapter, save_embedding_layers=False)
        tensors = {name: tensor.detach().cpu().clone() for name, tensor in state.items()}
        save_file(tensors, str(path / ADAPTER_FILE))
        self._peft.peft_config[adapter].save_pretrained(str(path))

    def _lora_config(self, rank: int, targets: list[str]) -> LoraConfig:
        return LoraConfig(
            r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets, bias="none",
            base_model_name_or_path=self.base_model_dir,
        )

    def _targets(self, spec: LoraSpec) -> list[str]:
        """The module names the spec's adapter trains (checked: rank, at least one kind present)."""
        if isinstance(spec.rank, bool) or not isinstance(spec.rank, int) or spec.rank < 1:
            raise PrimitiveInputError("lora_config.rank", f"must be a positive integer, got {spec.rank!r}")
        if spec.seed is not None and not 0 <= spec.seed < 2**64:
            raise PrimitiveInputError("lora_config.seed", f"must be in [0, 2**64), got {spec.seed}")
        wanted = [
            *(ATTENTION_MODULES if spec.train_attn else ()),
            *(MLP_MODULES if spec.train_mlp else ()),
            *(UNEMBED_MODULES if spec.train_unembed else ()),
        ]
        present = [name for name in wanted if name in self._linear_names]
        if not present:
            raise PrimitiveInputError("lora_config", f"trains none of this model's linear layers (asked: {wanted})")
        return present

    def _add_adapter(self, kind: str, config: LoraConfig, seed: int) -> str:
        """A new adapter, its A initialised from `seed` in a forked RNG (the global RNG is left as it was)."""
        name = f"{kind}_{next(self._names)}"
        with torch.random.fork_rng(devices=[]):  # peft initialises on the CPU, then moves to the base's device
            torch.manual_seed(seed)
            self._peft.add_adapter(name, config)
        self._peft.set_adapter(_PLACEHOLDER, inference_mode=True)
        return name

    def _delete_adapter(self, name: str) -> None:
        self._peft.set_adapter(_PLACEHOLDER, inference_mode=True)  # never delete the active adapter
        self._peft.delete_adapter(name)

    def _adapter_params(self, name: str) -> list[nn.Parameter]:
        return [param for param_name, param in self._peft.named_parameters() if f".{name}." in param_name]

    def _load_adapter_weights(self, adapter: str, path: Path) -> None:
        file = path / ADAPTER_FILE
        if not file.is_file():
            raise PrimitiveInputError("path", f"{path} holds no adapter weights ({ADAPTER_FILE})")
        state = load_file(str(file), device=str(self.device))
        try:
            result: Any = set_peft_model_state_dict(self._peft, state, adapter_name=adapter)
        except RuntimeError as error:  # a shape that does not fit this base or rank
            raise PrimitiveInputError("path", f"the saved adapter does not fit this model: {error}") from error
        missing = [key for key in result.missing_keys if f".{adapter}." in key]
        if missing or result.unexpected_keys:
            unexpected = result.unexpected_keys[:3]
            raise PrimitiveInputError("path", f"the saved adapter does not fit: missing {missing[:3]}, unexpected {unexpected}")

    def _load_optimizer(self, params: list[nn.Parameter], path: Path) -> torch.optim.AdamW:
        optimizer = _adamw(params)
        try:
            optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True))
        except (ValueError, KeyError) as error:
            raise PrimitiveInputError("path", f"the saved optimizer state does not fit: {error}") from error
        return optimizer

    def _check_tokens(self, tokens: Sequence[int], field: str) -> list[int]:
        array = np.asarray(tokens)
        if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu":
            raise PrimitiveInputError(field, "must be a non-empty list of token ids")
        bad = np.flatnonzero((array < 0) | (array >= self.vocab_size))
        if bad.size:
            index = int(bad[0])
            raise PrimitiveInputError(
                f"{field}[{index}]", f"token id {int(array[index])} is outside the vocabulary [0, {self.vocab_size})"
            )
        if self._max_positions is not None and array.size > self._max_positions:
            raise PrimitiveInputError(field, f"{array.size} tokens, the model takes at most {self._max_positions}")
        return [int(token) for token in array]

    def _check_datum(self, loss_fn: LossFn, datum: Datum, where: str) -> _Checked:
        tokens = self._check_tokens(datum.tokens, f"{where}.model_input")
        inputs = check_inputs(loss_fn, datum.loss_fn_inputs, len(tokens), self.vocab_size, where)
        return _Checked(torch.tensor(tokens, dtype=torch.long), inputs)

    def _target_logprobs(self, batch: list[_Checked]) -> list[Tensor]:
        """Each datum's (N_i,) log-probs of its targets, the batch right-padded into one forward: padding
        comes after a row's tokens, so causal attention keeps it out of their results."""
        lengths = [len(item.tokens) for item in batch]
        ids = torch.zeros((len(batch), max(lengths)), dtype=torch.long)  # (B, L); pad id 0, masked out
        targets, mask = torch.zeros_like(ids), torch.zeros_like(ids)
        for row, (item, length) in enumerate(zip(batch, lengths, strict=True)):
            ids[row, :length] = item.tokens
            targets[row, :length] = item.inputs["target_tokens"]
            mask[row, :length] = 1
        ids, targets, mask = ids.to(self.device), targets.to(self.device), mask.to(self.device)
        logits = self._module(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()  # (B, L, V)
        logps = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
        return [logps[row, :length] for row, length in enumerate(lengths)]

    def _sampling_settings(
        self, prompt_length: int, num_samples: int, max_tokens: int, temperature: float, top_k: int, top_p: float,
        seed: int | None, stop: Sequence[Sequence[int]] | None,
    ) -> SamplingSettings:
        if num_samples < 1:
            raise PrimitiveInputError("num_samples", f"must be >= 1, got {num_samples}")
        if max_tokens < 1:
            raise PrimitiveInputError("sampling_params.max_tokens", f"must be >= 1, got {max_tokens}")
        if self._max_positions is not None and prompt_length + max_tokens > self._max_positions:
            raise PrimitiveInputError(
                "sampling_params.max_tokens", f"prompt + max_tokens exceed the model's {self._max_positions} positions"
            )
        if not math.isfinite(temperature) or temperature < 0:
            raise PrimitiveInputError("sampling_params.temperature", f"must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise PrimitiveInputError("sampling_params.top_p", f"must be in (0, 1], got {top_p}")
        if seed is not None and not 0 <= seed < 2**64:
            raise PrimitiveInputError("sampling_params.seed", f"must be in [0, 2**64), got {seed}")
        sequences: tuple[tuple[int, ...], ...]
        if stop is None:
            sequences = tuple((eos,) for eos in self._eos_ids)
        else:
            sequences = tuple(tuple(self._check_tokens(s, f"sampling_params.stop[{i}]")) for i, s in enumerate(stop))
        return SamplingSettings(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=random.SystemRandom().randrange(2**63) if seed is None else seed, stop=sequences,
        )


def _adamw(params: list[nn.Parameter]) -> torch.optim.AdamW:
    """A client's AdamW; optim_step sets its hyperparameters from each call before stepping."""
    return torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)


def _check_adam(adam: AdamSettings) -> None:
    checks = {
        "learning_rate": adam.learning_rate >= 0,
        "beta1": 0 <= adam.beta1 < 1,
        "beta2": 0 <= adam.beta2 < 1,
        "eps": adam.eps >= 0,
        "weight_decay": adam.weight_decay >= 0,
        "grad_clip_norm": adam.grad_clip_norm >= 0,
    }
    for name, ok in checks.items():
        value = getattr(adam, name)
        if not ok or not math.isfinite(value):
            raise PrimitiveInputError(f"adam_params.{name}", f"out of range: {value}")


def _read_spec(path: Path) -> LoraSpec:
    file = path / SPEC_FILE
    if not file.is_file():
        raise PrimitiveInputError("path", f"{path} holds no saved state ({SPEC_FILE})")
    saved = json.loads(file.read_text())
    return LoraSpec(
        rank=int(saved["rank"]), seed=saved["seed"], train_mlp=bool(saved["train_mlp"]),
        train_attn=bool(saved["train_attn"]), train_unembed=bool(saved["train_unembed"]),
    )


def _chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive datums grouped so that each padded batch (count x longest) holds at most `budget` positions."""
    chunks: list[list[int]] = []
    current: list[int] = []
    width = 0
    for index, length in enumerate(lengths):
        if current and max(width, length) * (len(current) + 1) > budget:
            chunks.append(current)
            current, width = [], 0
        current.append(index)
        width = max(width, length)
    if current:
        chunks.append(current)
    return chunks


def _numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy()
