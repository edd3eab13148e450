"""Evaluating OpenAI graders (contract.graders): the worker's reward source and the service's graders/run.

Here rather than in the engine so that the service's ``POST /openai/v1/fine_tuning/alpha/graders/run`` grades
with the very code training uses (the service does not import the worker); the engine builds `GraderSource`
next to its built-in rule rewards (`worker.grpo.rewards.build_reward_sources`).

`grade_local` scores one completion with a string_check or text_similarity grader; `GraderSource` scores a
batch: the rule graders in a thread under the rule deadline, score_model graders through the chat source the
worker builds (`outbound.rewards.chat`, same SSRF policy, retries and breaker as reward endpoints), then a
multi grader's formula per completion. `run_grader` is the same evaluation for one sample, with OpenAI's
per-grader detail, for `POST /openai/v1/fine_tuning/alpha/graders/run`.

The metric libraries (rapidfuzz, sacrebleu, nltk, rouge-score) are imported on first use.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from contract.graders import (
    FormulaError,
    Grader,
    MissingField,
    MultiGrader,
    Sample,
    SampleNotJson,
    ScoreModelGrader,
    StringCheckGrader,
    SubGrader,
    TextSimilarityGrader,
    evaluate_formula,
    render,
    sub_graders,
)
from contract.reward_types import RewardError, RewardInput, RewardSource, RewardTimedOut

__all__ = ["GraderSource", "GradeOutcome", "grade_local", "run_grader", "similarity"]

RULE_TIMEOUT_S = 60.0

# Builds the source that scores completions with one score_model grader (the worker's outbound chat client).
ChatFactory = Callable[[ScoreModelGrader], RewardSource]


# --- text similarity ------------------------------------------------------------------------------


def similarity(metric: str, text: str, reference: str) -> float:
    """The score in [0, 1] of `text` against `reference` under one of OpenAI's metrics."""
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz

        return float(fuzz.WRatio(text, reference)) / 100.0
    if metric == "bleu":
        import sacrebleu

        return float(sacrebleu.sentence_bleu(text, [reference]).score) / 100.0
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return float(sentence_gleu([reference.split()], text.split()))
    if metric.startswith("rouge_"):
        return _rouge(metric.removeprefix("rouge_"))(reference, text)
    raise ValueError(f"unknown evaluation metric {metric!r}")


@functools.cache
def _rouge(kind: str) -> Callable[[str, str], float]:
    from rouge_score import rouge_scorer

    name = "rougeL" if kind == "l" else f"rouge{kind}"
    scorer = rouge_scorer.RougeScorer([name])
    return lambda reference, text: float(scorer.score(reference, text)[name].fmeasure)


def _string_check(grader: StringCheckGrader, text: str, reference: str) -> float:
    if grader.operation == "eq":
        return float(text == reference)
    if grader.operation == "ne":
        return float(text != reference)
    if grader.operation == "like":
        return float(reference in text)
    return float(reference.casefold() in text.casefold())


def grade_local(grader: StringCheckGrader | TextSimilarityGrader, item: Mapping[str, Any], sample: Sample) -> float:
    """Score one completion. Raises MissingField (the dataset's fault) or SampleNotJson."""
    text, reference = render(grader.input, item, sample), render(grader.reference, item, sample)
    if isinstance(grader, StringCheckGrader):
        return _string_check(grader, text, reference)
    return similarity(grader.evaluation_metric, text, reference)


# --- one sample, with detail (graders/run) ----------------------------------------------------------


@dataclass
class GradeOutcome:
    """OpenAI's graders/run answer, in our terms: the reward, each sub-grader's score and what went wrong."""

    reward: float
    sub_rewards: dict[str, float] = field(default_factory=dict)
    errors: dict[str, bool | str | None] = field(default_factory=dict)


def _lowest(grader: SubGrader) -> float:
    return grader.range[0] if isinstance(grader, ScoreModelGrader) else 0.0


async def run_grader(grader: Grader, item: Mapping[str, Any], output_text: str, *, chat: ChatFactory | None) -> GradeOutcome:
    """Grade one sample as training would, reporting OpenAI's error flags instead of raising them."""
    outcome = GradeOutcome(reward=0.0, errors={
        "formula_parse_error": False, "invalid_variable_error": False, "sample_parse_error": False,
        "model_grader_server_error": False, "model_grader_server_error_details": None, "other_error": False,
    })
    source = GraderSource("run", grader, chat=chat)
    input_ = RewardInput(prompt="", completion=output_text, completion_ids=[], extras=dict(item))
    try:
        scores = await source.sub_scores([input_], step=0)
    except MissingField as exc:
        outcome.errors["invalid_variable_error"] = True
        outcome.errors["other_error"] = str(exc)
        return outcome
    except RewardError as exc:
        outcome.errors["model_grader_server_error"] = True
        outcome.errors["model_grader_server_error_details"] = exc.reason
        return outcome
    outcome.errors["sample_parse_error"] = source.sample_parse_errors > 0
    outcome.sub_rewards = {name: values[0] for name, values in scores.items()}
    if isinstance(grader, MultiGrader):
        try:
            outcome.reward = evaluate_formula(grader.formula(), outcome.sub_rewards)
        except FormulaError:
            outcome.errors["formula_parse_error"] = True
    else:
        outcome.reward = outcome.sub_rewards[grader.name]
    return outcome


# --- a batch, as a reward source ---------------------------------------------------------------------


class GraderSource:
    """A `RewardSource` for one grader.

    A completion whose grader needs ``sample.output_json`` and is not JSON scores the grader's lowest value
    (OpenAI's sample_parse_error); a formula with no finite value (say log(0)) scores 0. A dataset row without
    a referenced field is a `RewardError` naming it (job creation checks every row, so only a dataset edited
    behind the service's back gets there).
    """

    def __init__(self, name: str, grader: Grader, *, chat: ChatFactory | None, timeout_s: float = RULE_TIMEOUT_S) -> None:
        self.name = name
        self.grader = grader
        self.timeout_s = timeout_s
        self.sample_parse_errors = 0
        self.formula_errors = 0
        self._parts = sub_graders(grader)
        self._chat: dict[str, RewardSource] = {}
        for key, sub in self._parts.items():
            if isinstance(sub, ScoreModelGrader):
                if chat is None:
                    raise RewardError(name, f"score_model grader {key!r} needs a chat client, and none was given")
                self._chat[key] = chat(sub)
        self._formula = grader.formula() if isinstance(grader, MultiGrader) else None

    async def __call__(self, items: Sequence[RewardInput], *, step: int) -> list[float | None]:
        try:
            scores = await self.sub_scores(items, step=step)
        except MissingField as exc:
            raise RewardError(self.name, f"dataset row has no field for {exc}") from exc
        if self._formula is None:
            return list(scores[self.grader.name])
        totals: list[float | None] = []
        for i in range(len(items)):
            try:
                totals.append(evaluate_formula(self._formula, {k: v[i] for k, v in scores.items()}))
            except FormulaError:
                self.formula_errors += 1
                totals.append(0.0)
        return totals

    async def sub_scores(self, items: Sequence[RewardInput], *, step: int) -> dict[str, list[float]]:
        """Each sub-grader's scores; a score_model abstention counts as its lowest score."""
        local = {k: g for k, g in self._parts.items() if not isinstance(g, ScoreModelGrader)}
        remote = [k for k, g in self._parts.items() if isinstance(g, ScoreModelGrader)]
        ready = {k: self._json_ready(items, self._parts[k]) for k in remote}  # raises MissingField before any call
        local_call = asyncio.wait_for(asyncio.to_thread(self._score_local, local, items), self.timeout_s)
        try:
            local_scores, answers = await asyncio.gather(
                local_call, asyncio.gather(*(self._chat[k](ready[k], step=step) for k in remote))
            )
        except TimeoutError as exc:
            raise RewardTimedOut(self.name, f"grading {len(items)} completions took longer than {self.timeout_s:g}s") from exc
        scores: dict[str, list[float]] = dict(local_scores)
        for key, answer in zip(remote, answers, strict=True):
            low = _lowest(self._parts[key])
            scores[key] = [low if value is None or not math.isfinite(value) else value for value in answer]
        return {key: scores[key] for key in self._parts}

    def _json_ready(self, items: Sequence[RewardInput], grader: SubGrader) -> Sequence[RewardInput]:
        # The chat source renders the messages itself; a sample it cannot render (not JSON) is sent as is and
        # its reply is replaced by the lowest score below: counting it here keeps graders/run's flag right.
        for item in items:
            try:
                for message in grader.input if isinstance(grader, ScoreModelGrader) else ():
                    render(message.content, item.extras, Sample(item.completion))
            except SampleNotJson:
                self.sample_parse_errors += 1
        return items

    def _score_local(self, graders: Mapping[str, SubGrader], items: Sequence[RewardInput]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for key, grader in graders.items():
            assert isinstance(grader, StringCheckGrader | TextSimilarityGrader)
            values: list[float] = []
            for item in items:
                try:
                    values.append(grade_local(grader, item.extras, Sample(item.completion)))
                except SampleNotJson:
                    self.sample_parse_errors += 1
                    values.append(0.0)
            out[key] = values
        return out
