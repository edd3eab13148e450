"""A reward source backed by a sequence-classification model scoring prompt + completion (a reward model
as in the GRPO paper's RL setup, https://arxiv.org/abs/2402.03300).

The score is ``logits[:, 0]``, as TRL does for a reward model. Inference runs in a worker thread
(`asyncio.to_thread`) so the event loop keeps serving the other, possibly remote, sources meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from contract.reward_types import RewardError, RewardInput, RewardModelLoadFailed
from worker.grpo.load_errors import load_failure_reason

log = logging.getLogger(__name__)

# Positions beyond this are cut from the LEFT (the prompt's start), keeping the completion intact.
_FALLBACK_MAX_LENGTH = 4096


class RewardModelSource:
    """`RewardSource` scoring ``prompt + completion`` with an `AutoModelForSequenceClassification`."""

    def __init__(
        self, model: str, *, batch_size: int = 16, device: str = "cpu", name: str | None = None
    ) -> None:
        self.name = name or f"model:{model}"
        self.batch_size = batch_size
        self.device = torch.device(device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model)
            self.model: PreTrainedModel = AutoModelForSequenceClassification.from_pretrained(model)
        except Exception as exc:
            # The exception text describes the worker's filesystem or the hub: logged, not returned.
            log.warning("reward model %r could not be loaded", model, exc_info=True)
            raise RewardModelLoadFailed(self.name, f"the reward model {load_failure_reason(exc, model)}") from exc
        self.model.to(self.device).eval()
        self._configure_padding()
        self._max_length = self._model_max_length()
        # One forward at a time: two overlapping steps must not run the model from two threads at once.
        self._lock = threading.Lock()

    def _configure_padding(self) -> None:
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise RewardError(
                    self.name, "the reward model's tokenizer has neither a pad nor an eos token"
                )
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # Sequence classifiers pool the last non-pad token, so the model must know the pad id to batch.
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.truncation_side = "left"

    def _model_max_length(self) -> int:
        limits = [
            self.tokenizer.model_max_length,
            getattr(self.model.config, "max_position_embeddings", None),
        ]
        usable = [int(x) for x in limits if isinstance(x, int) and 0 < x < 1_000_000]
        return min(usable) if usable else _FALLBACK_MAX_LENGTH

    async def __call__(self, items: Sequence[RewardInput], *, step: int) -> list[float | None]:
        texts = [item.prompt + item.completion for item in items]
        return list(await asyncio.to_thread(self.score_texts, texts))

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """Synchronous, batched scoring of full texts (``logits[:, 0]`` as float)."""
        scores: list[float] = []
        with self._lock, torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    list(texts[start : start + self.batch_size]),
                    padding=True,
                    truncation=True,
                    max_length=self._max_length,
                    return_tensors="pt",
                ).to(self.device)
                logits = self.model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                ).logits
                scores.extend(logits[:, 0].float().tolist())  # (B,)
        return scores
