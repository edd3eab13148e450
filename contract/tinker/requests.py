"""The JSON bodies of the Tinker API as the official SDK (0.38) sends them. Unknown fields are ignored (the SDK
adds `type` discriminators and fields of features we do not offer); missing or mistyped ones are refused with
the field named. The door stores a training call's validated body; the worker reads it back with the same model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

LossFn = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
LOSS_FNS: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ClientConfig(_Body):
    sdk_version: str = ""


class CreateSession(_Body):
    tags: list[str] = Field(default_factory=list, max_length=64)
    user_metadata: dict[str, Any] = Field(default_factory=dict)
    sdk_version: str = ""


class SessionRef(_Body):
    session_id: str


class LoraConfig(_Body):
    rank: int = Field(ge=1, le=512)
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateModel(_Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str = Field(min_length=1, max_length=512)
    lora_config: LoraConfig


class ModelRef(_Body):
    model_id: str


class RetrieveFuture(_Body):
    request_id: str
    allow_metadata_only: bool = False


class AdamParams(_Body):
    learning_rate: float = Field(1e-4, ge=0, le=1)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStep(_Body):
    model_id: str
    seq_id: int
    adam_params: AdamParams


class SaveWeights(_Body):
    model_id: str
    seq_id: int
    path: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._-]+$")


class LoadWeights(_Body):
    """On an existing training client (`model_id`, `seq_id`), or creating one from saved state (`session_id`,
    `model_seq_id`)."""

    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    path: str
    optimizer: bool = False


class SaveWeightsForSampler(_Body):
    """Either a named save (`path`, answered with its tinker:// path) or a snapshot for a new sampling client
    (`sampling_session_seq_id`, answered with the sampler's id)."""

    model_id: str
    seq_id: int
    path: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._-]+$")
    sampling_session_seq_id: int | None = Field(None, ge=0)
    # Filled in by the door for a snapshot: the sampling session the worker opens.
    sampler_id: str | None = None


class CreateSamplingSession(_Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class EncodedText(_Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int]


class ModelInput(_Body):
    chunks: list[dict[str, Any]] = Field(min_length=1)


class SamplingParams(_Body):
    max_tokens: int = Field(16, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None


class Sample(_Body):
    sampling_session_id: str
    seq_id: int
    num_samples: int = Field(1, ge=1, le=128)
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0, le=0)  # not offered: only the sampled tokens' logprobs


def prompt_tokens(prompt: ModelInput, field: str = "prompt") -> list[int]:
    """The prompt's tokens: encoded_text chunks only (images are for vision models, which are not served)."""
    tokens: list[int] = []
    for index, chunk in enumerate(prompt.chunks):
        kind = chunk.get("type")
        if kind != "encoded_text":
            raise ValueError(f"{field}.chunks[{index}]: {kind!r} chunks are not supported (text models only)")
        tokens += EncodedText.model_validate(chunk).tokens
    return tokens
