"""The fused backend's fast path as the generic paths take it (`worker.grpo.fastpath.FastPath`)."""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor

from worker.grpo.backends.fused import fast_decoder, static_decoder
from worker.grpo.fastpath import DecodeLanes, Decoder
from worker.grpo.logprobs import head_logprobs


class FusedPath:
    """The fast path as the generic paths take it (`worker.grpo.fastpath.FastPath`): log-probs through one
    fused full-sequence forward and the LM head in chunks, sampling through static decoders in the layout
    `layouts` measures fastest for each shape (one chooser per run)."""

    def __init__(self, layouts: static_decoder.LayoutChooser | None = None) -> None:
        self.layouts = layouts or static_decoder.LayoutChooser()

    def covers(self, model: Any, length: int) -> bool:
        return fast_decoder.supports(model, length)

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
        # Forwards of the same weights may share one gathering of them (a copy of every layer's).
        net = prepared if prepared is not None else fast_decoder.DecoderFunctional(model, adapters=adapters)
        hidden = net.completion_hidden(input_ids, attention_mask, position_ids, targets.shape[1])  # (N, C, E)
        return head_logprobs(
            hidden, net.lm_head, net.lm_head_bias, targets,
            temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
        )

    def decoders(self, model: Any, prompt_mask: Tensor, max_new_tokens: int, *, two_lanes: bool) -> DecodeLanes:
        """One static decoder for all rows, or two for the halves of the batch decoded side by side, in the
        layout `layouts` chooses for this shape (static_decoder.LayoutChooser)."""
        net = fast_decoder.DecoderFunctional(model)
        rows = prompt_mask.shape[0]
        key = static_decoder.layout_key(net, rows)
        layout = self.layouts.choose(key, static_decoder.layout_candidates(net, rows, two_lanes=two_lanes))
        record = partial(self.layouts.record, key, layout)
        if layout.lanes == 1:
            decoder = static_decoder.StaticDecoder(net, prompt_mask, max_new_tokens, threads=layout.threads)
            return DecodeLanes([(slice(None), decoder)], record)
        weights = static_decoder.DecodeWeights.of(net)
        halves = [slice(0, rows // 2), slice(rows // 2, rows)]
        decoders: list[tuple[slice, Decoder]] = [
            (half, static_decoder.StaticDecoder(net, prompt_mask[half], max_new_tokens, weights, layout.threads))
            for half in halves
        ]
        return DecodeLanes(decoders, record)
