"""Thresholds of the training-health detectors; the detectors themselves are in worker.grpo.health."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HealthConfig(BaseModel):
    """Thresholds of the training-health detectors (see worker.grpo.health)."""

    model_config = ConfigDict(extra="forbid")

    patience: int = Field(3, ge=1, description="Consecutive steps a per-step condition must hold to fire.")
    entropy_min: float = Field(0.05, ge=0, description="Mean token entropy (nats) below which sampling is ~greedy.")
    kl_max: float = Field(2.0, gt=0, description="KL to the reference above which it has blown up.")
    empty_length: float = Field(1.0, ge=0, description="Mean completion length (tokens) at or below which "
                                "completions are empty (EOS only).")
    solved_reward: float = Field(0.9, description="Mean reward at or above which the prompts count as solved.")
    stuck_reward: float = Field(0.0, description="Mean reward at or below which zero-spread groups are stuck.")
    dominance: float = Field(0.75, gt=0, le=1, description="Share of a group's samples one completion must "
                             "reach to dominate it.")
    dominated_groups: float = Field(0.75, gt=0, le=1, description="Share of dominated groups that fires.")
    hacking_margin: float = Field(0.1, gt=0, description="Rise of training reward and fall of eval reward "
                                  "between two evaluations that together fire reward_hacking.")
    forgetting_drop: float = Field(0.2, gt=0, description="Drop of the retain set's eval reward below its "
                                   "first value that fires forgetting.")
    sync_logprob_gap_max: float = Field(0.05, gt=0, description="Mean |log-prob| gap per token between the "
                                        "sampler and the policy above which the sampler is on stale weights.")
