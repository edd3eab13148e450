"""Scoring completions: the composite of weighted reward sources, and the built-in rule rewards.

A source is any async callable `RewardSource` (see `reward_types`): built-ins here, a reward model
(`reward_model.RewardModelSource`) and the worker's remote endpoints. `CompositeReward` runs every
source concurrently, validates each answer (length, finite numbers) so a broken source fails loudly
with a `RewardError` naming it, and sums the weighted values, ignoring None (abstentions).

This module does not import torch: the reward-model source is imported only when a spec asks for it.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contract.graders import GraderLimits
from contract.reward_types import RewardError, RewardInput, RewardSource, RewardTimedOut
from contract.spec import (
    BoxedAnswerParams,
    BuiltinRewardSpec,
    EnvironmentRewardSpec,
    ExactMatchParams,
    GraderRewardSpec,
    JobRewardSpec,
    LengthPenaltyParams,
    ModelRewardSpec,
    RegexMatchParams,
    RemoteRewardSpec,
    compile_user_pattern,
)
from outbound.graders import ChatFactory, GraderSource

__all__ = [
    "CompositeReward",
    "FunctionSource",
    "RewardResult",
    "boxed_answer_reward",
    "build_builtin_source",
    "build_reward_sources",
    "extract_boxed",
]


# --------------------------------------------------------------------------------------------------
# Composite
# --------------------------------------------------------------------------------------------------


@dataclass
class RewardResult:
    """The scores of one batch of completions."""

    total: list[float]  # weighted sum ignoring None; NaN where every source abstained
    per_source: dict[str, list[float | None]]  # raw (unweighted) values by source name
    metrics: dict[str, float]  # "reward/<source>/mean", "reward/<source>/std" (None ignored; NaN if all None)


class CompositeReward:
    """Weighted sum of several reward sources, scored concurrently."""

    def __init__(self, sources: list[tuple[RewardSource, float]]) -> None:
        if not sources:
            raise ValueError("CompositeReward needs at least one reward source")
        names = [source.name for source, _ in sources]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward sources listed twice: {', '.join(duplicates)}")
        for source, weight in sources:
            if not math.isfinite(weight):
                raise ValueError(f"reward source {source.name!r}: weight must be finite, got {weight!r}")
        self.sources = list(sources)

    @property
    def names(self) -> list[str]:
        return [source.name for source, _ in self.sources]

    async def score(self, items: Sequence[RewardInput], *, step: int) -> RewardResult:
        """Score `items` with every source at once; raise the first source failure as a `RewardError`."""
        tasks = [asyncio.ensure_future(_checked_call(source, items, step)) for source, _ in self.sources]
        try:
            answers = await asyncio.gather(*tasks)
        except BaseException:
            # One source failed (or we were cancelled): a slow remote source may still be retrying,
            # so stop the others instead of letting them run on unobserved.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        per_source = dict(zip(self.names, answers, strict=True))
        weights = [weight for _, weight in self.sources]
        return RewardResult(
            total=_weighted_totals(answers, weights, len(items)),
            per_source=per_source,
            metrics=_source_metrics(per_source),
        )


async def _checked_call(source: RewardSource, items: Sequence[RewardInput], step: int) -> list[float | None]:
    """Call one source and validate its answer; any failure becomes a `RewardError` naming the source."""
    try:
        answer: Any = await source(items, step=step)
    except RewardError:
        raise  # already names its source; RewardUnavailable must reach the worker unchanged (pause, not fail)
    except Exception as exc:
        raise RewardError(source.name, f"raised {type(exc).__name__}: {exc}") from exc
    return _validate_answer(source.name, answer, len(items))


def _validate_answer(name: str, answer: Any, expected: int) -> list[float | None]:
    if isinstance(answer, str | bytes) or not isinstance(answer, Sequence):
        raise RewardError(name, f"expected a list of {expected} numbers or None, got {type(answer).__name__}")
    if len(answer) != expected:
        raise RewardError(name, f"returned {len(answer)} values for {expected} completions")
    values: list[float | None] = []
    for i, value in enumerate(answer):
        if value is None:
            values.append(None)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardError(name, f"value {i} is not a number: {value!r} ({type(value).__name__})")
        number = float(value)
        if not math.isfinite(number):
            raise RewardError(name, f"value {i} is not finite: {number!r}")
        values.append(number)
    return values


def _weighted_totals(answers: Sequence[list[float | None]], weights: Sequence[float], n: int) -> list[float]:
    totals: list[float] = []
    for i in range(n):
        present = [w * v for values, w in zip(answers, weights, strict=True) if (v := values[i]) is not None]
        # NaN marks "every source abstained": the advantage code turns it into advantage 0.
        totals.append(math.fsum(present) if present else math.nan)
    return totals


def _source_metrics(per_source: dict[str, list[float | None]]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for name, values in per_source.items():
        present = [v for v in values if v is not None]
        # Population std (1/n), the seeds' definition; NaN when the source abstained everywhere.
        metrics[f"reward/{name}/mean"] = statistics.fmean(present) if present else math.nan
        metrics[f"reward/{name}/std"] = statistics.pstdev(present) if present else math.nan
    return metrics


# --------------------------------------------------------------------------------------------------
# Built-in rule rewards: cheap pure functions of one completion, wrapped as async sources
# --------------------------------------------------------------------------------------------------

ItemScorer = Callable[[RewardInput], float | None]


# A batch of rule scoring that runs longer than this fails the job. The built-in rules are linear in the
# completions (RE2 for user patterns), which max_completion_length bounds: only a pathological input the rules
# did not foresee gets near it, and the job then ends instead of occupying the worker.
RULE_TIMEOUT_S = 60.0


class FunctionSource:
    """An async `RewardSource` around a pure per-item function, run off the event loop under a deadline."""

    def __init__(self, name: str, fn: ItemScorer, *, timeout_s: float = RULE_TIMEOUT_S) -> None:
        self.name = name
        self._fn = fn
        self.timeout_s = timeout_s

    async def __call__(self, items: Sequence[RewardInput], *, step: int) -> list[float | None]:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._score, items), self.timeout_s)
        except TimeoutError as exc:
            raise RewardTimedOut(
                self.name, f"scoring {len(items)} completions took longer than {self.timeout_s:g}s"
            ) from exc

    def _score(self, items: Sequence[RewardInput]) -> list[float | None]:
        return [self._fn(item) for item in items]


def _answer_column(source: str, item: RewardInput, column: str) -> str:
    """The ground truth of `item` as text; a missing or null column is the dataset's fault, named."""
    if column not in item.extras:
        available = ", ".join(sorted(item.extras)) or "none"
        raise RewardError(source, f"dataset row has no column {column!r} (columns: {available})")
    value = item.extras[column]
    if value is None:
        raise RewardError(source, f"dataset row has a null {column!r} column")
    return str(value)


_BOXED = "\\boxed{"
_BRACES = re.compile(r"[{}]")


def extract_boxed(text: str) -> str | None:
    r"""Content of the LAST complete ``\boxed{...}`` in `text`, with nested braces balanced.

    ``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``; an unclosed box is ignored. One pass over the braces
    (linear in the completion, however many unclosed boxes a model writes).
    """
    box_at = {start + len(_BOXED) - 1: start for start in _occurrences(text, _BOXED)}  # its "{" -> box start
    if not box_at:
        return None
    best: tuple[int, int] | None = None  # (box start, index of its closing "}")
    opened: list[int] = []
    for brace in _BRACES.finditer(text):
        position = brace.start()
        if brace.group() == "{":
            opened.append(position)
        elif opened:
            start = box_at.get(opened.pop())
            if start is not None and (best is None or start > best[0]):
                best = (start, position)
    return None if best is None else text[best[0] + len(_BOXED) : best[1]]


def _occurrences(text: str, needle: str) -> list[int]:
    found: list[int] = []
    start = text.find(needle)
    while start != -1:
        found.append(start)
        start = text.find(needle, start + 1)
    return found


def _as_number(text: str) -> float | None:
    cleaned = text.strip().strip("$").replace(",", "").strip()
    try:
        number = float(cleaned)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def boxed_answer_reward(completion: str, ground_truth: str, params: BoxedAnswerParams) -> float:
    r"""Seed 003's rule reward: format_reward for a non-empty ``\boxed{}`` answer, + correct_reward if right.

    Numbers compare within `params.tolerance` (so "63.0" matches "63"); anything else compares as
    stripped text.
    """
    boxed = extract_boxed(completion)
    if boxed is None or not boxed.strip():
        return 0.0
    answer, truth = boxed.strip(), ground_truth.strip()
    answer_number, truth_number = _as_number(answer), _as_number(truth)
    if answer_number is not None and truth_number is not None:
        correct = abs(answer_number - truth_number) <= params.tolerance
    else:
        correct = answer == truth
    return params.format_reward + (params.correct_reward if correct else 0.0)


def _boxed_source(name: str, params: BoxedAnswerParams) -> FunctionSource:
    def score(item: RewardInput) -> float:
        return boxed_answer_reward(item.completion, _answer_column(name, item, params.answer_column), params)

    return FunctionSource(name, score)


def _exact_match_source(name: str, params: ExactMatchParams) -> FunctionSource:
    def normalise(text: str) -> str:
        text = text.strip() if params.strip else text
        return text if params.case_sensitive else text.casefold()

    def score(item: RewardInput) -> float:
        truth = _answer_column(name, item, params.answer_column)
        return 1.0 if normalise(item.completion) == normalise(truth) else 0.0

    return FunctionSource(name, score)


def _regex_source(name: str, params: RegexMatchParams) -> FunctionSource:
    pattern = compile_user_pattern(params.pattern)  # RE2: linear time, and it releases the GIL while matching
    match = pattern.fullmatch if params.fullmatch else pattern.search

    def score(item: RewardInput) -> float:
        return 1.0 if match(item.completion) else 0.0

    return FunctionSource(name, score)


def _length_penalty_source(name: str, params: LengthPenaltyParams) -> FunctionSource:
    def score(item: RewardInput) -> float:
        length = len(item.completion_ids) if params.unit == "tokens" else len(item.completion)
        return -params.scale * abs(length - params.target_length) / params.target_length

    return FunctionSource(name, score)


class EnvironmentReward:
    """The environment's reward of each episode (multi-turn jobs): computed during the rollout, read here."""

    name = "environment"

    async def __call__(self, items: Sequence[RewardInput], *, step: int) -> list[float | None]:
        return [item.environment_reward for item in items]


def build_builtin_source(spec: BuiltinRewardSpec) -> FunctionSource:
    """The source for one built-in spec (its params were validated by the spec already)."""
    name = spec.source_name
    if spec.name == "boxed_answer":
        return _boxed_source(name, BoxedAnswerParams.model_validate(spec.params))
    if spec.name == "exact_match":
        return _exact_match_source(name, ExactMatchParams.model_validate(spec.params))
    if spec.name == "regex_match":
        return _regex_source(name, RegexMatchParams.model_validate(spec.params))
    if spec.name == "length_penalty":
        return _length_penalty_source(name, LengthPenaltyParams.model_validate(spec.params))
    raise RewardError(name, f"unknown built-in reward {spec.name!r}")


# --------------------------------------------------------------------------------------------------
# From job spec to composite
# --------------------------------------------------------------------------------------------------


def build_reward_sources(
    specs: Sequence[JobRewardSpec],
    *,
    remote: Callable[[RemoteRewardSpec], RewardSource] | None = None,
    device: str = "cpu",
    model_paths: Mapping[str, str] | None = None,
    chat: ChatFactory | None = None,
    grader_limits: GraderLimits = GraderLimits(),
) -> CompositeReward:
    """Build the composite for a job's `rewards` list.

    Built-ins and reward models are built here (models on `device`, loaded from `model_paths[spec.model]`
    when given: the service resolves checkpoint: and builtin: sources); remote specs are built by
    `remote`, the worker's client factory. A remote spec without one is a `RewardError`. Graders are built
    here too; their score_model parts call a chat endpoint through `chat`, the worker's chat client factory,
    and they render and compare within `grader_limits` (the service's `Settings.grader_limits()`).
    """
    sources: list[tuple[RewardSource, float]] = []
    for spec in specs:
        source: RewardSource
        if isinstance(spec, BuiltinRewardSpec):
            source = build_builtin_source(spec)
        elif isinstance(spec, ModelRewardSpec):
            # Imported here so that rule-only and remote-only jobs never import torch.
            from worker.grpo.reward_model import RewardModelSource

            path = (model_paths or {}).get(spec.model, spec.model)
            source = RewardModelSource(path, batch_size=spec.batch_size, device=device, name=spec.source_name)
        elif isinstance(spec, RemoteRewardSpec):
            if remote is None:
                raise RewardError(spec.source_name, "remote reward sources need a client, and none was given")
            source = remote(spec)
        elif isinstance(spec, GraderRewardSpec):
            source = GraderSource(spec.source_name, spec.parsed, chat=chat, limits=grader_limits)
        elif isinstance(spec, EnvironmentRewardSpec):
            source = EnvironmentReward()
        else:  # pragma: no cover - the discriminated union admits nothing else
            raise TypeError(f"unknown reward spec {spec!r}")
        sources.append((source, spec.weight))
    return CompositeReward(sources)
