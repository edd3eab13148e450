"""Rollouts: G completions per prompt, as token ids and masks for the loss.

Sampling runs our own loop (prefill once, then one token per forward with a KV cache,
temperature / top-k / top-p with a seeded torch.Generator, stop once every row has emitted EOS):
`generate()` spends most of a small model's generation time in per-token Python machinery.
Every model decodes through its own forward with a `DynamicCache`, or through the decoders of the backend's
fast path where one `covers` it (`worker.grpo.fastpath`). Beam search stays on `generate()`.

The loss trains on the sampled ids exactly; the decoded texts go to reward sources only and are
never tokenised again (a decode/encode round trip is not the identity for most tokenizers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from torch import Tensor
from transformers import DynamicCache, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from contract.config import GRPOConfig
from worker.grpo.concurrency import SideThread, intra_op_threads
from worker.grpo.fastpath import DecodeLanes, Decoder, FastPath


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]]) -> str:
    """A plain string is used as is; a list of chat messages goes through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer.chat_template is None:
        raise ValueError("prompt is a list of chat messages but the tokenizer has no chat template")
    rendered = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    if not isinstance(rendered, str):
        raise TypeError(f"chat template rendered {type(rendered).__name__}, expected str")
    return rendered


@dataclass
class Rollout:
    """One step's generations. N = num_prompts * G rows; rows g*G .. g*G + G - 1 share prompt g."""

    prompt_ids: Tensor  # (N, P) left-padded with pad_token_id
    prompt_mask: Tensor  # (N, P) int64, 1 = real prompt token
    completion_ids: Tensor  # (N, C) right-padded with pad_token_id after the first EOS
    completion_mask: Tensor  # (N, C) int64, 1 up to and including the first EOS, 0 after
    is_truncated: Tensor  # (N,) bool, no EOS within max_completion_length
    completion_texts: list[str]  # decoded with skip_special_tokens=True, for rewards only
    group_size: int  # G
    # (N, C) float32 log-probs of the sampled tokens under the engine that sampled them (0 after EOS),
    # when that engine is not the policy itself (vLLM); None for the native rollout.
    sampler_logps: Tensor | None = None
    # Multi-turn rollouts (worker.grpo.multi_turn): (N, C) int64, 1 where the policy sampled the token, 0 where
    # the environment's tool results put it; such tokens stay in the attention but out of the loss and the KL.
    tool_mask: Tensor | None = None
    # Multi-turn rollouts: each row's episode (turns, error, environment reward), as stored with samples.
    episodes: list[dict[str, Any]] | None = None

    @property
    def policy_mask(self) -> Tensor:
        """(N, C) the tokens the policy sampled: the completion mask without the environment's tokens."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def to(self, device: torch.device) -> Rollout:
        """This rollout with its tensors on `device`."""
        def move(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.to(device)

        return Rollout(
            self.prompt_ids.to(device), self.prompt_mask.to(device), self.completion_ids.to(device),
            self.completion_mask.to(device), self.is_truncated.to(device), self.completion_texts, self.group_size,
            move(self.sampler_logps), move(self.tool_mask), self.episodes,
        )

    @property
    def input_ids(self) -> Tensor:
        """(N, P + C) prompt then completion, the input of the log-prob forward pass."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(N, P + C); padding on both sides (and everything after EOS) is masked out."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def completion_lengths(self) -> Tensor:
        """(N,) number of completion tokens, EOS included."""
        return self.completion_mask.sum(dim=1)


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_prompt_length: int | None
) -> tuple[Tensor, Tensor]:
    """Tokenise with the tokenizer's special tokens (BOS), truncate from the left, pad on the left.

    Returns ids and mask, both (num_prompts, P). Done by hand so the shared tokenizer's
    padding/truncation side is never mutated.
    """
    if not prompts:
        raise ValueError("no prompts to generate from")
    pad_id = _pad_token_id(tokenizer)
    encoded: list[list[int]] = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    if max_prompt_length is not None:
        encoded = [ids[-max_prompt_length:] for ids in encoded]
    for index, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {index} tokenises to nothing")
    return left_padded(encoded, pad_id)


def left_padded(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token sequences as one (B, P) batch padded on the left with `pad_id`, and its (B, P) mask."""
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids) :] = 1
    return input_ids, mask


def _pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("tokenizer has neither a pad token nor an EOS token")
    return int(pad_id)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokenizer's EOS plus any the model's generation config lists (chat models often have two)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no EOS token: completions could never end")
    ids = [int(tokenizer.eos_token_id)]
    model_eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    extra = [model_eos] if isinstance(model_eos, int) else list(model_eos or [])
    return ids + [int(i) for i in extra if int(i) not in ids]


def _generation_config(
    config: GRPOConfig, tokenizer: PreTrainedTokenizerBase, eos_ids: list[int]
) -> GenerationConfig:
    """A complete GenerationConfig, so the model's own generation defaults (e.g. top_k=50) never leak in."""
    common = {
        "max_new_tokens": config.max_completion_length,
        "eos_token_id": eos_ids,
        "pad_token_id": _pad_token_id(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "use_cache": True,
    }
    if config.generation == "beam":
        # G beams returned per prompt: distinct sequences by construction.
        return GenerationConfig(
            do_sample=False,
            num_beams=config.num_generations,
            num_return_sequences=config.num_generations,
            early_stopping=True,
            **common,
        )
    return GenerationConfig(
        do_sample=True,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,  # 0 disables top-k in transformers
        num_return_sequences=1,
        **common,
    )


def completion_mask_after_eos(
    completion_ids: Tensor, eos_token_ids: int | Sequence[int]
) -> tuple[Tensor, Tensor]:
    """(N, C) ids -> mask (N, C) int64 covering tokens up to and including the first EOS, and truncation (N,) bool.

    A row without EOS keeps every token and is flagged as truncated.
    """
    eos_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))  # (N, C)
    has_eos = is_eos.any(dim=1)  # (N,)
    length = completion_ids.shape[1]
    # argmax on int finds the first True; rows without EOS use the full length.
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), length)  # (N,)
    positions = torch.arange(length, device=completion_ids.device).unsqueeze(0)  # (1, C)
    mask = (positions <= first_eos.unsqueeze(1)).long()  # (N, C)
    return mask, ~has_eos


class NativeRollout:
    """Rollouts from the policy itself (`generate_rollout`); the other engine is
    `worker.grpo.vllm_rollout.VLLMRollout`, with the same three methods."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: GRPOConfig,
        *,
        fast: FastPath | None = None,
        lockstep: Callable[[bool], bool] | None = None,
    ) -> None:
        self.model, self.tokenizer, self.config, self.fast = model, tokenizer, config, fast
        self.lockstep = lockstep

    def generate(
        self, prompts: list[str], *, generator_seed: int | list[int], side: SideThread | None = None,
        with_logprobs: bool = False,
    ) -> Rollout:
        """G samples of each prompt; `generator_seed`: one for the batch, or one per prompt (generate_rollout)."""
        return generate_rollout(
            self.model,
            self.tokenizer,
            prompts,
            self.config,
            generator_seed=generator_seed,
            side=side,
            fast=self.fast,
            lockstep=self.lockstep,
            with_logprobs=with_logprobs,
        )

    def continue_sequences(
        self, sequences: list[list[int]], budgets: list[int], seeds: list[int]
    ) -> list[tuple[list[int], list[float] | None]]:
        """One continuation of each token sequence (multi-turn rollouts): see `sample_continuations`."""
        return sample_continuations(
            self.model, self.tokenizer, sequences, budgets, seeds, self.config, fast=self.fast, lockstep=self.lockstep
        )

    def sync_weights(self) -> None:
        """Nothing to do: the policy samples with its own weights."""

    def close(self) -> None:
        """Nothing to release."""


@torch.no_grad()
def generate_rollout(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    config: GRPOConfig,
    *,
    generator_seed: int | list[int] | None = None,
    side: SideThread | None = None,
    fast: FastPath | None = None,
    lockstep: Callable[[bool], bool] | None = None,
    with_logprobs: bool = False,
) -> Rollout:
    """Generate G = config.num_generations completions for each already-rendered prompt.

    Sampling mode repeats each prompt G times (contiguous rows) and samples with temperature,
    top_p and top_k; beam mode runs beam search with G beams and returns all G. With
    `generator_seed` the sampling is reproducible and the global RNG state is left as it was; a list
    holds one seed per prompt, so that a group samples the same tokens whichever batch (or rank) it is in.
    `side`, a second CPU lane, lets the fast path decode half the rows beside the caller; `fast`: the
    backend's fast path, which decodes the models it covers (else their own forward and a KV cache).
    `lockstep`: when the model's forwards are collectives (a sharded model), asked at each decoding step whether
    any rank still decodes (given whether this one does): every rank then runs the same forwards, finished rows
    taking pad tokens, and samples what it would alone. `with_logprobs` (sampling only): the rollout's
    `sampler_logps` are the sampled tokens' log-probs from the decoding. The model is put in eval mode for
    generation (no dropout) and restored afterwards. All returned tensors live on the model's device.
    """
    eos_ids = eos_token_ids(model, tokenizer)
    group = config.num_generations
    device = model.device
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, config.max_prompt_length)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    if config.generation == "sample":
        # (num_prompts * G, P): each prompt's G rows are contiguous.
        prompt_ids = prompt_ids.repeat_interleave(group, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(group, dim=0)
    was_training = model.training
    model.eval()
    sampler_logps = None
    try:
        if config.generation == "sample":
            completion_ids, sampler_logps = sample_completions(
                model, prompt_ids, prompt_mask, config, eos_ids, _pad_token_id(tokenizer),
                _generators(generator_seed, device), side, fast=fast, lockstep=lockstep, with_logprobs=with_logprobs,
            )  # (N, C') with C' <= max_completion_length
        else:
            completion_ids = _beam_search(
                model, tokenizer, prompt_ids, prompt_mask, config, eos_ids, synced=lockstep is not None
            )
    finally:
        model.train(was_training)

    if config.generation == "beam":
        # Beam search returns the G sequences of each prompt contiguously; expand the prompt to match.
        prompt_ids = prompt_ids.repeat_interleave(group, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(group, dim=0)
    completion_mask, is_truncated = completion_mask_after_eos(completion_ids, eos_ids)
    # Whatever generate() put after the first EOS (pad, or beam leftovers) becomes pad.
    completion_ids = completion_ids.masked_fill(completion_mask == 0, _pad_token_id(tokenizer))
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        is_truncated=is_truncated,
        completion_texts=list(texts),
        group_size=group,
        sampler_logps=None if sampler_logps is None else sampler_logps * completion_mask,
    )


@torch.no_grad()
def sample_continuations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sequences: list[list[int]],
    budgets: list[int],
    seeds: list[int],
    config: GRPOConfig,
    *,
    fast: FastPath | None = None,
    lockstep: Callable[[bool], bool] | None = None,
) -> list[tuple[list[int], list[float] | None]]:
    """Sample one continuation of each token sequence, row i at most `budgets[i]` tokens with its own seed: the
    sampled ids (its EOS included when reached). The policy samples itself, so no log-probs are returned.

    The sequences are left-padded into one batch and decoded by the same loop as a rollout (`sample_completions`,
    temperature, top-k and top-p from `config`)."""
    if not sequences:
        return []
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = _pad_token_id(tokenizer)
    device = model.device
    prompt_ids, prompt_mask = left_padded(sequences, pad_id)
    longest = config.model_copy(update={"max_completion_length": max(budgets)})
    was_training = model.training
    model.eval()
    try:
        out, _ = sample_completions(
            model, prompt_ids.to(device), prompt_mask.to(device), longest, eos_ids, pad_id,
            [torch.Generator(device=device).manual_seed(seed) for seed in seeds], fast=fast, lockstep=lockstep,
        )
    finally:
        model.train(was_training)
    results: list[tuple[list[int], list[float] | None]] = []
    for row, budget in zip(out.tolist(), budgets, strict=True):
        row = row[:budget]
        end = next((i for i, token in enumerate(row) if token in eos_ids), None)
        results.append((row if end is None else row[: end + 1], None))
    return results


def _generators(seed: int | list[int] | None, device: torch.device) -> torch.Generator | list[torch.Generator] | None:
    """Private generators (the global RNG is left untouched): one for the batch, or one per prompt."""
    if isinstance(seed, list):
        return [torch.Generator(device=device).manual_seed(s) for s in seed]
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def _beam_search(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    config: GRPOConfig,
    eos_ids: list[int],
    *,
    synced: bool = False,
) -> Tensor:
    """G beams per prompt through `generate()`; returns the (num_prompts * G, C') completion ids. `synced`: the
    model's forwards are collectives, so generate() steps until every rank is done (`synced_gpus`)."""
    # PreTrainedModel's stubs do not show GenerationMixin.generate to mypy.
    sequences = model.generate(  # type: ignore[operator]
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        generation_config=_generation_config(config, tokenizer, eos_ids),
        synced_gpus=synced,
    )  # (N, P + C')
    return sequences[:, prompt_ids.shape[1] :]


# --- the sampling loop ---------------------------------------------------------------------------


# transformers 5.24 renamed the forwards' `past_key_values` to `cache` (the old name goes in 5.40). Earlier
# releases do not know `cache`: their forwards would swallow it in **kwargs and decode without a cache.
_CACHE_ARGUMENT = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


class _CacheDecoder:
    """Any causal LM through its own forward and a DynamicCache."""

    def __init__(self, model: Any, prompt_mask: Tensor, max_new_tokens: int) -> None:
        self.model = model
        batch = prompt_mask.shape[0]
        # The attention mask grows by one visible column per token, as in generate().
        self.mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch, max_new_tokens)], dim=1)  # (B, P + C)
        positions = prompt_mask.long().cumsum(-1) - 1
        self.prompt_positions = positions.masked_fill(prompt_mask == 0, 1)  # generate()'s convention
        self.next_position = positions[:, -1:] + 1  # (B, 1)
        self.cache = DynamicCache(config=model.config)
        self.length = prompt_mask.shape[1]
        self.threads = torch.get_num_threads()

    def prefill(self, prompt_ids: Tensor) -> Tensor:
        return self._forward(prompt_ids, self.prompt_positions)

    def step(self, tokens: Tensor) -> Tensor:
        logits = self._forward(tokens[:, None], self.next_position, grow=True)
        self.next_position = self.next_position + 1
        return logits

    def _forward(self, ids: Tensor, positions: Tensor, *, grow: bool = False) -> Tensor:
        if grow:
            self.length += 1
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask[:, : self.length],
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{_CACHE_ARGUMENT: self.cache},
        )
        return out.logits[:, -1]


def _lanes(model: Any, prompt_mask: Tensor, max_new_tokens: int, *, parallel: bool, fast: FastPath | None) -> DecodeLanes:
    """The fast path's decoders where it covers the model (`parallel`: a side lane may run a second one), else
    one decoder through the model's own forward for all rows."""
    if fast is not None and fast.covers(model, prompt_mask.shape[1] + max_new_tokens):
        return fast.decoders(model, prompt_mask, max_new_tokens, two_lanes=parallel)
    return DecodeLanes([(slice(None), _CacheDecoder(model, prompt_mask, max_new_tokens))])


def filter_logits(logits: Tensor, *, temperature: float, top_k: int, top_p: float) -> Tensor:
    """(B, V) logits -> tempered logits with everything outside top-k / the top-p nucleus at -inf.

    Same order and rules as transformers' warpers: temperature, then top-k (0 = off; ties with the
    k-th value are kept), then top-p (smallest set whose mass reaches top_p; the most likely token
    is always kept). Works in place on `logits` when they are float32 (else on their float32 copy),
    so that a token costs at most one more full-vocabulary buffer: the sorted copy that top-p over
    the whole vocabulary needs. After top-k the nucleus is found among the kept tokens only.
    """
    logits = logits.float()  # no copy when already float32
    if temperature != 1.0:
        logits.div_(temperature)
    vocab = logits.shape[-1]
    kept = vocab
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits.masked_fill_(logits < kth, float("-inf"))
        kept = int((logits > float("-inf")).sum(-1).max())  # k, or more with ties at the k-th value
    if top_p < 1.0:
        if kept < vocab:  # every kept token, in ascending order (rows with fewer end in -inf)
            values, order = torch.topk(logits, kept, dim=-1, largest=True, sorted=True)
            values, order = values.flip(-1), order.flip(-1)  # (B, kept)
        else:
            values, order = torch.sort(logits, dim=-1)  # (B, V) ascending
        # softmax and cumulative sum in the sorted buffer itself; the largest value is the last
        probs = values.sub_(values[:, -1:]).exp_()
        cumulative = probs.div_(probs.sum(dim=-1, keepdim=True)).cumsum_(dim=-1)
        drop = cumulative <= (1 - top_p)
        drop[:, -1] = False
        logits.masked_fill_(
            torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, drop), float("-inf")
        )
    return logits


def sample_tokens(logits: Tensor, draws: Tensor) -> Tensor:
    """One token per row from softmax(logits) (B, V), by inverting the cumulative distribution at
    `draws` (B,), uniform in [0, 1). Overwrites `logits` (with the unnormalised CDF).

    Cheaper than torch.multinomial for small batches (no per-row alias setup) and the same
    distribution. Tokens with zero probability (-inf) are never drawn.
    """
    cdf = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)  # (B, V) unnormalised
    draw = draws.to(cdf.dtype).unsqueeze(1)  # (B, 1)
    tokens = torch.searchsorted(cdf, draw * cdf[:, -1:], right=True).squeeze(1)
    return tokens.clamp(max=logits.shape[-1] - 1)  # draw * total can round up to total itself


def sample_completions(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    config: GRPOConfig,
    eos_ids: list[int],
    pad_id: int,
    generator: torch.Generator | list[torch.Generator] | None,
    side: SideThread | None = None,
    *,
    fast: FastPath | None = None,
    lockstep: Callable[[bool], bool] | None = None,
    with_logprobs: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Sample up to max_completion_length tokens per row; (B, P) left-padded prompts -> (B, C') ids and, when
    `with_logprobs`, their (B, C') float32 log-probs under the sampling logits / temperature (the full vocabulary,
    as the trainer's log-probs; 0 for pad) from the decoding itself: no second forward.

    Rows that have emitted an EOS get `pad_id` from then on; decoding ends once every row has
    (so C' may be shorter than max_completion_length), as generate() does. Models the `fast` path covers
    decode through its decoders (with `side`, maybe two lanes side by side), which are told the seconds per
    decoding step afterwards. `lockstep`: see generate_rollout (one lane only).
    """
    max_new = config.max_completion_length
    batch, device = prompt_ids.shape[0], prompt_ids.device
    # One uniform per (token, row), drawn up front: row r's t-th token inverts the CDF at
    # draws[t, r] whichever lane decodes it, so lanes do not change what a seed samples.
    if isinstance(generator, list):  # one generator per prompt's block of rows
        rows = batch // len(generator)
        draws = torch.cat([torch.rand(max_new, rows, generator=g, device=device) for g in generator], dim=1)
    else:
        draws = torch.rand(max_new, batch, generator=generator, device=device)  # (C, B)
    started = time.perf_counter()
    with _no_grad(lockstep):
        lanes = _lanes(model, prompt_mask, max_new, parallel=side is not None, fast=fast)

    def run(lane: tuple[slice, Decoder]) -> tuple[Tensor, Tensor | None]:
        rows, decoder = lane
        return _sample_lane(
            decoder, prompt_ids[rows], draws[:, rows], config, eos_ids, pad_id, lockstep, with_logprobs
        )

    first, *others = lanes.decoders
    beside = [side.submit(partial(run, lane)) for lane in others] if side is not None else []
    outputs = [run(first), *(future.result() for future in beside)]
    produced = max(out.shape[1] for out, _ in outputs)
    if lanes.record is not None:
        lanes.record((time.perf_counter() - started) / produced)
    # A normal tensor again: inference tensors cannot be saved for backward (the embedding would).
    ids = torch.cat([F.pad(out, (0, produced - out.shape[1]), value=pad_id) for out, _ in outputs])
    if not with_logprobs:
        return ids, None
    logps = torch.cat([F.pad(lp, (0, produced - lp.shape[1])) for _, lp in outputs if lp is not None])
    return ids, logps.clone()


def _no_grad(lockstep: Callable[[bool], bool] | None) -> torch.no_grad | torch.inference_mode:
    """inference_mode, or no_grad for a sharded model (`lockstep`): FSDP's gathered weights are written in place
    by later forwards with gradient, which a tensor made under inference_mode does not allow."""
    return torch.no_grad() if lockstep is not None else torch.inference_mode()


def _sample_lane(
    decoder: Decoder,
    prompt_ids: Tensor,
    draws: Tensor,
    config: GRPOConfig,
    eos_ids: list[int],
    pad_id: int,
    lockstep: Callable[[bool], bool] | None = None,
    with_logprobs: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The sampling loop over one decoder's rows: (b, P) prompts and (C, b) draws -> (b, C') ids, and their
    log-probs when `with_logprobs`. With `lockstep` it stops only once no rank's rows run (finished rows take pad
    tokens meanwhile)."""
    max_new = config.max_completion_length
    batch, device = prompt_ids.shape[0], prompt_ids.device
    # inference_mode and the thread count are per thread: set here, where the lane runs.
    with _no_grad(lockstep), intra_op_threads(decoder.threads):
        eos = torch.tensor(eos_ids, device=device)
        out = torch.full((batch, max_new), pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((batch, max_new), dtype=torch.float32, device=device) if with_logprobs else None
        running = torch.ones(batch, dtype=torch.bool, device=device)
        logits = decoder.prefill(prompt_ids)
        produced = 0
        for index in range(max_new):
            # Before filtering, which works in place: the trainer's log-probs span the whole vocabulary.
            tempered = torch.log_softmax(logits.float() / config.temperature, dim=-1) if logps is not None else None
            filtered = filter_logits(
                logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
            )
            tokens = sample_tokens(filtered, draws[index])  # (b,)
            tokens = torch.where(running, tokens, pad_id)
            out[:, index] = tokens
            if logps is not None and tempered is not None:
                logps[:, index] = torch.where(running, tempered.gather(1, tokens[:, None]).squeeze(1), 0.0)
            produced = index + 1
            running &= ~torch.isin(tokens, eos)
            decoding = bool(running.any())
            if lockstep is not None:
                decoding = lockstep(decoding)
            if produced == max_new or not decoding:
                break
            logits = decoder.step(tokens)
    return out[:, :produced], None if logps is None else logps[:, :produced]
