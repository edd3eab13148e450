"""What the engine's generic paths accept from an accelerated path for the models it covers.

The log-prob forward (`worker.grpo.logprobs.completion_logprobs`), the sampling loop (`worker.grpo.rollout`) and
the reference (`worker.grpo.modeling.ModelBundle`) run every model through its module forward. A backend may
offer a faster computation of the same values for some models and sequence lengths (the fused backend's CPU
fast path, `worker.grpo.backends.fused`): it hands them a `FastPath`, which they take where it `covers` the
model, else the module forward. They never name the backend's machinery: the generic paths read alone, and the
choice of backend is made once (`worker.grpo.backends.choose_backend`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor


class Decoder(Protocol):
    """One sampling lane's model: the prompt's next-token logits, then one token's at a time."""

    threads: int  # torch intra-op threads to decode with

    def prefill(self, prompt_ids: Tensor) -> Tensor: ...  # (B, P) -> next-token logits (B, V)

    def step(self, tokens: Tensor) -> Tensor: ...  # (B,) -> next-token logits (B, V)


@dataclass
class DecodeLanes:
    """A rollout's decoders, each with the rows it decodes (side by side when there are several), and what to
    tell once they are done: the seconds each decoding step took (a fast path choosing its layouts by
    measurement keeps them)."""

    decoders: list[tuple[slice, Decoder]]
    record: Callable[[float], None] | None = None


class FastPath(Protocol):
    """The same values as the module forward, computed faster for the models it `covers`."""

    def covers(self, model: Any, length: int) -> bool:
        """Whether it reproduces `model`'s forward over sequences of `length` tokens."""
        ...

    def completion_logprobs(
        self,
        model: Any,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        targets: Tensor,
        *,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
        adapters: bool,
        prepared: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """`completion_logprobs`' log-probs (N, C) of `targets` and entropy. `adapters=False` scores a peft
        model's base weights without switching its adapters off; `prepared`: the model's weights as this path
        already gathered them for several forwards of the same weights, or None."""
        ...

    def decoders(self, model: Any, prompt_mask: Tensor, max_new_tokens: int, *, two_lanes: bool) -> DecodeLanes:
        """The decoders of one rollout's rows; `two_lanes`: a second thread is there to run a second lane."""
        ...
