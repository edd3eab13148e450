"""Evaluating OpenAI graders (contract.graders): the worker's reward source and the service's graders/run.

Here rather than in the engine so that the service's ``POST /openai/v1/fine_tuning/alpha/graders/run`` grades
with the very code training uses (the service does not import the worker); the engine builds `GraderSource`
next to its built-in rule rewards (`worker.grpo.rewards.build_reward_sources`).

`grade_local` scores one completion with a string_check or text_similarity grader; `GraderSource` scores a
batch: the rule graders through `score_local` (by default in a thread under the rule deadline; the service
runs it in a child process it can kill, `service.openai.grading`), score_model graders through the chat source
the worker builds (`outbound.rewards.chat`, same SSRF policy, retries and breaker as reward endpoints), then a
multi grader's formula per completion. `run_grader` is the same evaluation for one sample, with OpenAI's
per-grader detail, for `POST /openai/v1/fine_tuning/alpha/graders/run`.

Bounded work (`contract.graders.GraderLimits`): every rendered template stops at `max_rendered_chars`, and the
metrics take time and memory linear in it (rouge_l's longest common subsequence is rapidfuzz's bit-parallel
one over the tokens, not an n x m table), except fuzzy_match, whose partial matching grows faster than the
square of the length and is given texts of at most `max_fuzzy_match_chars`. A text over a limit is refused by
graders/run (`GraderInputTooLarge`) and scores the grader's lowest value in training (`input_too_large`).

The metric libraries that are slow to import (sacrebleu, nltk, rouge-score) are imported on first use, so that
neither the service nor the worker pays for them unless a grader uses them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rapidfuzz import fuzz
from rapidfuzz.distance import LCSseq

from contract.graders import (
    FormulaError,
    Grader,
    GraderInputTooLarge,
    GraderLimits,
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
    templates,
)
from contract.reward_types import RewardError, RewardInput, RewardSource, RewardTimedOut

__all__ = [
    "GraderSource", "GradeOutcome", "LocalRunner", "LocalScores", "grade_local", "run_grader", "score_local",
    "similarity",
]

log = logging.getLogger(__name__)

RULE_TIMEOUT_S = 60.0

# Builds the source that scores completions with one score_model grader (the worker's outbound chat client).
ChatFactory = Callable[[ScoreModelGrader], RewardSource]


# --- text similarity ------------------------------------------------------------------------------


def similarity(metric: str, text: str, reference: str, *, limits: GraderLimits = GraderLimits()) -> float:
    """The score in [0, 1] of `text` against `reference` under one of OpenAI's metrics.

    Raises GraderInputTooLarge for a fuzzy_match text over `limits.max_fuzzy_match_chars`."""
    if metric == "fuzzy_match":
        for name, value in (("input", text), ("reference", reference)):
            if len(value) > limits.max_fuzzy_match_chars:
                raise GraderInputTooLarge(
                    name, f"the rendered {name} ({len(value)} characters) of a fuzzy_match",
                    limits.max_fuzzy_match_chars, "GRPO_GRADER_MAX_FUZZY_MATCH_CHARS",
                )
        return float(fuzz.WRatio(text, reference)) / 100.0
    if metric == "bleu":
        import sacrebleu  # slow to import: on first use (see the module docstring)

        return float(sacrebleu.sentence_bleu(text, [reference]).score) / 100.0
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu  # slow to import: on first use

        return float(sentence_gleu([reference.split()], text.split()))
    if metric == "rouge_l":
        return rouge_l(reference, text)
    if metric.startswith("rouge_"):
        return _rouge(metric.removeprefix("rouge_"))(reference, text)
    raise ValueError(f"unknown evaluation metric {metric!r}")


@functools.cache
def _rouge(kind: str) -> Callable[[str, str], float]:
    from rouge_score import rouge_scorer  # slow to import: on first use

    name = f"rouge{kind}"  # n-gram overlap: counts, linear in the tokens
    scorer = rouge_scorer.RougeScorer([name])
    return lambda reference, text: float(scorer.score(reference, text)[name].fmeasure)


@functools.cache
def _rouge_tokenize() -> Callable[[str], list[str]]:
    from rouge_score import tokenizers  # slow to import: on first use

    return tokenizers.DefaultTokenizer(use_stemmer=False).tokenize  # type: ignore[no-any-return]


def rouge_l(reference: str, text: str) -> float:
    """rouge-score's rougeL F-measure (same tokens, same formula), its longest common subsequence computed by
    rapidfuzz's bit-parallel LCSseq over the token sequences: memory linear in the tokens, where rouge-score
    fills an n x m table of Python ints (3,000 tokens each: 6 s; 20,000 each: tens of GB)."""
    tokenize = _rouge_tokenize()
    target, prediction = tokenize(reference), tokenize(text)
    if not target or not prediction:
        return 0.0
    common = LCSseq.similarity(target, prediction)
    precision, recall = common / len(prediction), common / len(target)
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def _string_check(grader: StringCheckGrader, text: str, reference: str) -> float:
    if grader.operation == "eq":
        return float(text == reference)
    if grader.operation == "ne":
        return float(text != reference)
    if grader.operation == "like":
        return float(reference in text)
    return float(reference.casefold() in text.casefold())


def grade_local(
    grader: StringCheckGrader | TextSimilarityGrader, item: Mapping[str, Any], sample: Sample,
    limits: GraderLimits = GraderLimits(),
) -> float:
    """Score one completion. Raises MissingField (the dataset's fault), SampleNotJson or GraderInputTooLarge."""
    cap = limits.max_rendered_chars
    text = render(grader.input, item, sample, field="input", max_chars=cap)
    reference = render(grader.reference, item, sample, field="reference", max_chars=cap)
    if isinstance(grader, StringCheckGrader):
        return _string_check(grader, text, reference)
    return similarity(grader.evaluation_metric, text, reference, limits=limits)


@dataclass
class LocalScores:
    """What `score_local` found: each rule grader's scores, and the completions it could not score."""

    scores: dict[str, list[float]]
    sample_parse_errors: int = 0
    too_large: list[tuple[str, GraderInputTooLarge]] = field(default_factory=list)  # (grader key, refusal)


def score_local(
    graders: Mapping[str, SubGrader], items: Sequence[RewardInput], limits: GraderLimits
) -> LocalScores:
    """Score `items` with the rule graders (string_check, text_similarity). A completion that is not JSON where
    a template reads output_json, or whose text is over a limit, scores 0. Raises MissingField. Module-level
    and picklable, arguments and result alike: the service runs it in a child process."""
    out = LocalScores(scores={})
    for key, grader in graders.items():
        assert isinstance(grader, StringCheckGrader | TextSimilarityGrader)
        values: list[float] = []
        for item in items:
            try:
                values.append(grade_local(grader, item.extras, Sample(item.completion), limits))
            except SampleNotJson:
                out.sample_parse_errors += 1
                values.append(0.0)
            except GraderInputTooLarge as exc:
                out.too_large.append((key, exc))
                values.append(0.0)
        out.scores[key] = values
    return out


# Runs `score_local` off the event loop with a deadline; raises TimeoutError when the deadline passes.
LocalRunner = Callable[
    [Mapping[str, SubGrader], Sequence[RewardInput], GraderLimits, float], Awaitable[LocalScores]
]


async def in_thread(
    graders: Mapping[str, SubGrader], items: Sequence[RewardInput], limits: GraderLimits, timeout_s: float
) -> LocalScores:
    """The worker's runner: a thread (the limits bound its work; a thread past its deadline cannot be stopped,
    it is abandoned)."""
    return await asyncio.wait_for(asyncio.to_thread(score_local, graders, items, limits), timeout_s)


# --- one sample, with detail (graders/run) ----------------------------------------------------------


@dataclass
class GradeOutcome:
    """OpenAI's graders/run answer, in our terms: the reward, each sub-grader's score and what went wrong."""

    reward: float
    sub_rewards: dict[str, float] = field(default_factory=dict)
    errors: dict[str, bool | str | None] = field(default_factory=dict)


def _lowest(grader: SubGrader) -> float:
    return grader.range[0] if isinstance(grader, ScoreModelGrader) else 0.0


async def run_grader(
    grader: Grader, item: Mapping[str, Any], output_text: str, *, chat: ChatFactory | None,
    limits: GraderLimits = GraderLimits(), local: LocalRunner = in_thread, timeout_s: float = RULE_TIMEOUT_S,
) -> GradeOutcome:
    """Grade one sample as training would, reporting OpenAI's error flags instead of raising them; raises
    GraderInputTooLarge (its field relative to the grader: ``input``, ``graders.<key>.reference``) before
    any chat endpoint is called when a template renders past a limit.

    A chat endpoint's failure is reported by its error code (and HTTP status) only: the message, which can
    quote the endpoint's answer, stays in this process's log, so a tenant cannot read a private address's
    answer back through a grader (development mode admits private addresses)."""
    outcome = GradeOutcome(reward=0.0, errors={
        "formula_parse_error": False, "invalid_variable_error": False, "sample_parse_error": False,
        "model_grader_server_error": False, "model_grader_server_error_details": None, "other_error": False,
    })
    source = GraderSource("run", grader, chat=chat, limits=limits, local=local, timeout_s=timeout_s,
                          too_large="raise")
    input_ = RewardInput(prompt="", completion=output_text, completion_ids=[], extras=dict(item))
    try:
        scores = await source.sub_scores([input_], step=0)
    except MissingField as exc:
        outcome.errors["invalid_variable_error"] = True
        outcome.errors["other_error"] = str(exc)
        return outcome
    except RewardError as exc:
        log.warning("graders/run: %s", exc)
        outcome.errors["model_grader_server_error"] = True
        outcome.errors["model_grader_server_error_details"] = public_reason(exc)
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


_PUBLIC_REASONS = {
    "reward_endpoint_http_error": "the endpoint answered HTTP {status}",
    "reward_endpoint_grpc_error": "the endpoint answered gRPC {status}",
    "reward_endpoint_invalid_response": "the endpoint answered, but not a chat completion in the expected shape",
    "reward_endpoint_unavailable": "no usable answer from the endpoint (connection failed, timed out, or a "
    "429/5xx status)",
    "reward_endpoint_url_rejected": "the endpoint's address is refused by the URL policy",
}


def public_reason(exc: RewardError) -> str:
    """What a tenant is told of a failed grading call: which source, the error code and the HTTP or gRPC status
    where the endpoint answered one; never the endpoint's words (a body excerpt, a redirect's location, gRPC
    details), nor the address its host resolved to. The whole message goes to the log."""
    if isinstance(exc, RewardTimedOut):
        return exc.reason  # ours, not the endpoint's
    what = _PUBLIC_REASONS.get(exc.code, "the call failed").format(status=getattr(exc, "status", "?"))
    return f"{exc.source}: {what} ({exc.code}); the service's log has the details"


# --- a batch, as a reward source ---------------------------------------------------------------------


class GraderSource:
    """A `RewardSource` for one grader.

    A completion whose grader needs ``sample.output_json`` and is not JSON scores the grader's lowest value
    (OpenAI's sample_parse_error); so does one whose rendered template or compared text is over a limit of
    `limits` (counted in `input_too_large`), unless `too_large` is "raise" (graders/run: a refusal naming the
    limit). A formula with no finite value (say log(0)) scores 0. A dataset row without a referenced field is a
    `RewardError` naming it (job creation checks every row, so only a dataset edited behind the service's back
    gets there). `local` runs the rule graders (a thread by default, a killable child process in the service).
    """

    def __init__(
        self, name: str, grader: Grader, *, chat: ChatFactory | None, timeout_s: float = RULE_TIMEOUT_S,
        limits: GraderLimits = GraderLimits(), local: LocalRunner = in_thread,
        too_large: Literal["lowest", "raise"] = "lowest",
    ) -> None:
        self.name = name
        self.grader = grader
        self.timeout_s = timeout_s
        self.limits = limits
        self._local = local
        self._too_large = too_large
        self.sample_parse_errors = 0
        self.formula_errors = 0
        self.input_too_large = 0
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
        # Raises MissingField (or, for graders/run, GraderInputTooLarge) before any call.
        ready = {k: self._json_ready(items, k) for k in remote}
        try:
            local_scores, answers = await asyncio.gather(
                self._run_local(local, items), asyncio.gather(*(self._chat[k](ready[k], step=step) for k in remote))
            )
        except TimeoutError as exc:
            raise RewardTimedOut(self.name, f"grading {len(items)} completions took longer than {self.timeout_s:g}s") from exc
        scores: dict[str, list[float]] = dict(local_scores)
        for key, answer in zip(remote, answers, strict=True):
            low = _lowest(self._parts[key])
            scores[key] = [low if value is None or not math.isfinite(value) else value for value in answer]
        return {key: scores[key] for key in self._parts}

    async def _run_local(self, graders: Mapping[str, SubGrader], items: Sequence[RewardInput]) -> dict[str, list[float]]:
        if not graders:
            return {}
        found = await self._local(graders, items, self.limits, self.timeout_s)
        self.sample_parse_errors += found.sample_parse_errors
        for key, refusal in found.too_large:
            self._refused(key, refusal)
        return found.scores

    def _refused(self, key: str, refusal: GraderInputTooLarge) -> None:
        """A text over a limit: graders/run refuses the request, training scores the completion lowest."""
        if isinstance(self.grader, MultiGrader):
            refusal = refusal.within(f"graders.{key}")
        if self._too_large == "raise":
            raise refusal
        if not self.input_too_large:
            log.warning("grader %s: %s; such completions score the lowest value", self.name, refusal)
        self.input_too_large += 1

    def _json_ready(self, items: Sequence[RewardInput], key: str) -> Sequence[RewardInput]:
        # The chat source renders the messages itself; a sample it cannot render (not JSON, or over the limit)
        # is not sent and its reply is replaced by the lowest score below: counting it here keeps graders/run's
        # flags right, and refuses an oversized one before any call.
        grader = self._parts[key]
        assert isinstance(grader, ScoreModelGrader)
        for item in items:
            try:
                for field_name, template in templates(grader):
                    render(template, item.extras, Sample(item.completion), field=field_name,
                           max_chars=self.limits.max_rendered_chars)
            except SampleNotJson:
                self.sample_parse_errors += 1
            except GraderInputTooLarge as exc:
                self._refused(key, exc)
        return items
