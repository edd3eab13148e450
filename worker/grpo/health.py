"""Training-health guard: per-step detectors of the ways a GRPO run goes wrong, with the evidence.

Pure logic over the metrics the trainer already reports (no torch, no database): `HealthGuard.observe`
takes one step's metrics (and that step's eval/* metrics when an evaluation ran) and returns the
findings that *started* at this step. A detector fires once when its condition has held for its
patience, and re-arms only after the condition has cleared, so a long collapse is one event, not one
per step.

Detectors (thresholds in `HealthConfig`; rewards are read on their own scale, so the reward levels
assume a reward in [0, 1], the usual case of exact-match or pass/fail rewards):

- ``entropy_collapse``: mean token entropy below `entropy_min` while the reward is below
  `solved_reward`: the policy samples one answer and it is not the right one.
- ``kl_blowup``: KL to the reference above `kl_max` (only when beta > 0, otherwise no KL is measured).
- ``length_collapse``: every completion empty (mean length <= `empty_length` tokens: EOS only) or every
  completion truncated at max_completion_length.
- ``zero_variance``: every group has zero reward spread, so there is no gradient. Told apart by the
  reward level: ``graduated`` (reward >= `solved_reward`: the prompts are solved; severity info) vs
  ``stuck`` (reward <= `stuck_reward`: nothing the model samples earns anything).
- ``dominant_completion``: in at least `dominated_groups` of the groups one completion is at least
  `dominance` of the samples and earns less than `solved_reward` (mode collapse onto a wrong answer,
  often the same one for every prompt; metric ``groups/dominated_frac``).
- ``reward_hacking``: between two evaluations the training reward rose by `hacking_margin` or more
  while the held-out eval reward fell by `hacking_margin` or more.
- ``forgetting``: the retain set's eval reward (prompts of skills to keep) dropped by `forgetting_drop`
  or more below its value at the first evaluation.
- ``stale_sampler``: right after a weight push, the sampling engine's log-probs of trained sequences differ from
  the policy's by more than `sync_logprob_gap_max` per token (`sync/logprob_gap`, worker.grpo.weight_sync): it
  samples from weights the policy no longer has. Fires at the first check that shows it (no patience).

Severity ``warning`` is unhealthy (`on_unhealthy: pause` stops the run); ``info`` is news only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from contract.health import HealthConfig

Severity = Literal["warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One detector firing: what, how bad, and the numbers that show it."""

    kind: str
    severity: Severity
    step: int
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_event_data(self) -> dict[str, Any]:
        return {"kind": self.kind, "severity": self.severity, "step": self.step, "evidence": self.evidence}


def dominated_fraction(
    texts: Sequence[str], rewards: Sequence[float], group_size: int, dominance: float, solved_reward: float
) -> float:
    """Share of the contiguous groups of `group_size` completions in which one text fills >= dominance of the
    group and earns less than `solved_reward` (a group dominated by a right answer is a solved prompt)."""
    starts = range(0, len(texts), group_size)
    if not starts:
        return 0.0
    dominated = 0
    for start in starts:
        group = texts[start : start + group_size]
        text, count = Counter(group).most_common(1)[0]
        reward = rewards[start + group.index(text)]
        dominated += count >= dominance * len(group) and reward < solved_reward
    return dominated / len(starts)


@dataclass
class _Eval:
    step: int
    eval_reward: float
    train_reward: float | None  # None at step 0: no training step yet


class HealthGuard:
    """Feed it every step's metrics in order; it returns the findings that start at that step."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self._streaks: dict[str, int] = {}
        self._active: set[str] = set()
        self._recent_rewards: list[float] = []
        self._last_eval: _Eval | None = None
        self._first_retain: float | None = None

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[Finding]:
        """`metrics` of one step (step 0: the evaluation before training, eval/* only)."""
        reward = metrics.get("reward/mean")
        findings: list[Finding] = []
        if reward is not None:
            self._recent_rewards = [*self._recent_rewards[-4:], reward]  # the training reward near an eval
            findings += self._per_step(step, metrics, reward)
        findings += self._on_eval(step, metrics)
        return findings

    # --- per-step conditions (with patience) ----------------------------------------------------

    def _per_step(self, step: int, m: Mapping[str, float], reward: float) -> list[Finding]:
        c = self.config
        solved = reward >= c.solved_reward
        out: list[Finding] = []
        entropy = m.get("entropy")
        out += self._sustained(
            "entropy_collapse", step, entropy is not None and entropy < c.entropy_min and not solved,
            lambda: (f"token entropy {entropy:.3f} < {c.entropy_min} while reward is {reward:.3f}: the policy "
                     "samples (almost) one answer, and not a rewarded one",
                     {"entropy": entropy, "reward/mean": reward}),
        )
        kl = m.get("kl")
        out += self._sustained(
            "kl_blowup", step, kl is not None and kl > c.kl_max,
            lambda: (f"KL to the reference {kl:.3f} > {c.kl_max}", {"kl": kl, "reward/mean": reward}),
        )
        length, truncated = m.get("completion_length/mean"), m.get("truncated_fraction")
        empty = length is not None and length <= c.empty_length
        all_truncated = truncated is not None and truncated >= 1.0
        out += self._sustained(
            "length_collapse", step, empty or all_truncated,
            lambda: ("every completion is empty" if empty else "every completion hits max_completion_length",
                     {"completion_length/mean": length, "truncated_fraction": truncated, "reward/mean": reward}),
        )
        zero_std = m.get("frac_zero_std_groups")
        flat = zero_std is not None and zero_std >= 1.0
        out += self._sustained(
            "zero_variance_graduated", step, flat and solved,
            lambda: (f"every group has zero reward spread at reward {reward:.3f}: the prompts are solved "
                     "(graduated); further steps have no gradient", {"frac_zero_std_groups": zero_std,
                                                                    "reward/mean": reward}),
            severity="info",
        )
        out += self._sustained(
            "zero_variance_stuck", step, flat and reward <= c.stuck_reward,
            lambda: (f"every group has zero reward spread at reward {reward:.3f}: nothing the model samples "
                     "earns reward, so there is no gradient", {"frac_zero_std_groups": zero_std,
                                                              "reward/mean": reward}),
        )
        gap = m.get("sync/logprob_gap")
        if gap is not None:  # only at the steps the check ran: no streak across the steps between
            out += self._sustained(
                "stale_sampler", step, gap > c.sync_logprob_gap_max,
                lambda: (f"right after a weight push the sampler's log-probs differ from the policy's by {gap:.4f} "
                         f"per token (> {c.sync_logprob_gap_max}): it samples from stale weights",
                         {"sync/logprob_gap": gap}),
                patience=1,
            )
        dominated = m.get("groups/dominated_frac")
        out += self._sustained(
            "dominant_completion", step, dominated is not None and dominated >= c.dominated_groups,
            lambda: (f"in {dominated:.0%} of the groups one unrewarded completion fills >= {c.dominance:.0%} of "
                     f"the samples (reward {reward:.3f}): mode collapse onto a wrong answer",
                     {"groups/dominated_frac": dominated, "reward/mean": reward}),
        )
        return out

    def _sustained(
        self, kind: str, step: int, condition: bool, describe: Any, *, severity: Severity = "warning",
        patience: int | None = None,
    ) -> list[Finding]:
        if not condition:
            self._streaks[kind] = 0
            self._active.discard(kind)
            return []
        self._streaks[kind] = self._streaks.get(kind, 0) + 1
        if kind in self._active or self._streaks[kind] < (patience or self.config.patience):
            return []
        self._active.add(kind)
        message, evidence = describe()
        evidence = {**evidence, "steps": self._streaks[kind]}
        return [Finding(kind, severity, step, message, evidence)]

    # --- conditions between evaluations --------------------------------------------------------

    def _on_eval(self, step: int, m: Mapping[str, float]) -> list[Finding]:
        c = self.config
        out: list[Finding] = []
        eval_reward = m.get("eval/reward/mean")
        if eval_reward is not None:
            train_reward = sum(self._recent_rewards) / len(self._recent_rewards) if self._recent_rewards else None
            last = self._last_eval
            if last is not None and last.train_reward is not None and train_reward is not None:
                rose, fell = train_reward - last.train_reward, last.eval_reward - eval_reward
                if rose >= c.hacking_margin and fell >= c.hacking_margin and "reward_hacking" not in self._active:
                    self._active.add("reward_hacking")
                    out.append(Finding(
                        "reward_hacking", "warning", step,
                        f"training reward rose {rose:+.3f} while held-out eval reward fell {-fell:+.3f} since step "
                        f"{last.step}: the policy may be exploiting the reward rather than solving the task",
                        {"since_step": last.step, "train_reward": [last.train_reward, train_reward],
                         "eval_reward": [last.eval_reward, eval_reward]},
                    ))
                elif fell < c.hacking_margin:
                    self._active.discard("reward_hacking")
            self._last_eval = _Eval(step, eval_reward, train_reward)
        retain = m.get("eval/retain/reward/mean")
        if retain is not None:
            if self._first_retain is None:
                self._first_retain = retain
            elif self._first_retain - retain >= c.forgetting_drop and "forgetting" not in self._active:
                self._active.add("forgetting")
                out.append(Finding(
                    "forgetting", "warning", step,
                    f"retain-set reward fell from {self._first_retain:.3f} to {retain:.3f}: skills outside the "
                    "training task are being lost",
                    {"retain_reward": [self._first_retain, retain],
                     **{k: v for k, v in m.items() if k.startswith("eval/retain/")}},
                ))
        return out
