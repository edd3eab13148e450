"""Graders against OpenAI's graders guide: the expected scores are the documented ones (string_check's four
operations, templates of item/sample, output_json only for a JSON sample, the multigrader's formula over
named graders, similarity metrics scoring identical text 1 and disjoint text 0), not read off our code."""

from __future__ import annotations

import asyncio
import math
import pickle
import random
import time
import tracemalloc
from typing import Any

import pytest

from contract.graders import (
    MAX_RENDERED_CHARS,
    FormulaError,
    GraderInputTooLarge,
    GraderInvalid,
    GraderLimits,
    MissingField,
    Sample,
    evaluate_formula,
    parse_formula,
    parse_grader,
    parse_reference,
    render,
)
from contract.reward_types import RewardInput
from outbound.graders import GraderSource, run_grader, similarity


def score(grader: dict[str, Any], sample: str, item: dict[str, Any]) -> float:
    return asyncio.run(run_grader(parse_grader(grader), item, sample, chat=None)).reward


def string_check(operation: str, input_: str = "{{sample.output_text}}", reference: str = "{{item.reference_answer}}") -> dict[str, Any]:
    return {"type": "string_check", "name": "check", "operation": operation, "input": input_, "reference": reference}


class TestStringCheck:
    # Guide: eq = input matches reference (case-sensitive); ne = does not match; like = input contains the
    # reference (case-sensitive); ilike = contains, not case-sensitive. Pass 1, fail 0.
    @pytest.mark.parametrize(("operation", "sample", "reference", "expected"), [
        ("eq", "Paris", "Paris", 1.0),
        ("eq", "paris", "Paris", 0.0),
        ("ne", "London", "Paris", 1.0),
        ("ne", "Paris", "Paris", 0.0),
        ("like", "The capital is Paris.", "Paris", 1.0),
        ("like", "The capital is paris.", "Paris", 0.0),
        ("ilike", "THE CAPITAL IS PARIS.", "Paris", 1.0),
        ("ilike", "The capital is Lyon.", "Paris", 0.0),
    ])
    def test_operations(self, operation: str, sample: str, reference: str, expected: float) -> None:
        assert score(string_check(operation), sample, {"reference_answer": reference}) == expected


class TestTemplates:
    def test_item_fields_by_json_path(self) -> None:
        item = {"answer": {"city": "Paris", "alternatives": ["Lutetia", "Paname"]}}
        assert score(string_check("eq", reference="{{ item.answer.city }}"), "Paris", item) == 1.0
        assert score(string_check("eq", reference="{{item.answer.alternatives[1]}}"), "Paname", item) == 1.0

    def test_output_json_only_for_a_json_sample(self) -> None:
        grader = string_check("eq", "{{sample.output_json.city}}", "{{item.city}}")
        assert score(grader, '{"city": "Paris"}', {"city": "Paris"}) == 1.0
        outcome = asyncio.run(run_grader(parse_grader(grader), {"city": "Paris"}, "Paris", chat=None))
        assert outcome.reward == 0.0 and outcome.errors["sample_parse_error"] is True

    def test_a_missing_item_field_is_an_invalid_variable(self) -> None:
        outcome = asyncio.run(run_grader(parse_grader(string_check("eq")), {"other": "x"}, "x", chat=None))
        assert outcome.reward == 0.0 and outcome.errors["invalid_variable_error"] is True

    @pytest.mark.parametrize("template", ["{{answer}}", "{{sample.output_tools}}", "{{item}}", "{{ctx.x}}"])
    def test_undocumented_references_are_refused(self, template: str) -> None:
        with pytest.raises(GraderInvalid) as refused:
            parse_grader(string_check("eq", reference=template))
        assert refused.value.param == "grader.reference"


class TestTextSimilarity:
    METRICS = ["fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"]
    TEXT = "the quick brown fox jumps over the lazy dog"

    @pytest.mark.parametrize("metric", METRICS)
    def test_identical_is_one_and_disjoint_is_zero(self, metric: str) -> None:
        grader = {"type": "text_similarity", "name": "sim", "input": "{{sample.output_text}}",
                  "reference": "{{item.ref}}", "evaluation_metric": metric}
        assert score(grader, self.TEXT, {"ref": self.TEXT}) == pytest.approx(1.0)
        assert score(grader, "zzz yyy xxx www vvv", {"ref": self.TEXT}) == pytest.approx(0.0, abs=0.35 if metric == "fuzzy_match" else 1e-9)

    def test_partial_overlap_is_between(self) -> None:
        grader = {"type": "text_similarity", "name": "sim", "input": "{{sample.output_text}}",
                  "reference": "{{item.ref}}", "evaluation_metric": "rouge_1"}
        # Unigram F1: 4 of 4 candidate words in an 8-word reference: precision 1, recall 0.5 -> 2/3.
        assert score(grader, "the quick brown fox", {"ref": "the quick brown fox jumps over a dog"}) == pytest.approx(2 / 3)


class TestMulti:
    # The guide's multigrader: a fuzzy name match and an exact email match, averaged by calculate_output.
    GRADER = {
        "type": "multi",
        "name": "user",
        "graders": {
            "name": {"type": "text_similarity", "name": "name", "input": "{{sample.output_json.name}}",
                     "reference": "{{item.name}}", "evaluation_metric": "fuzzy_match"},
            "email": {"type": "string_check", "name": "email", "input": "{{sample.output_json.email}}",
                      "reference": "{{item.email}}", "operation": "eq"},
        },
        "calculate_output": "(name + email) / 2",
    }
    ITEM = {"name": "John Doe", "email": "john.doe@example.com"}

    def test_all_right_and_half_right(self) -> None:
        assert score(self.GRADER, '{"name": "John Doe", "email": "john.doe@example.com"}', self.ITEM) == 1.0
        assert score(self.GRADER, '{"name": "John Doe", "email": "jd@example.com"}', self.ITEM) == 0.5

    @pytest.mark.parametrize(("formula", "expected"), [
        ("2 ^ 3", 8.0), ("min(a, b) + max(a, b)", 1.5), ("abs(a - b)", 0.5), ("floor(b * 3) + ceil(b)", 2.0),
        ("sqrt(4) * exp(0) + log(1)", 2.0), ("-a + +b", -0.5),
    ])
    def test_documented_operators_and_functions(self, formula: str, expected: float) -> None:
        assert evaluate_formula(parse_formula(formula, {"a", "b"}), {"a": 1.0, "b": 0.5}) == pytest.approx(expected)

    @pytest.mark.parametrize("formula", ["a / (b - b)", "log(a - a)", "sqrt(-a)", "10 ^ 400"])
    def test_no_finite_value(self, formula: str) -> None:
        with pytest.raises(FormulaError):
            evaluate_formula(parse_formula(formula, {"a", "b"}), {"a": 1.0, "b": 0.5})

    @pytest.mark.parametrize("formula", [
        "__import__('os')", "a.real", "[a][0]", "a if b else 0", "a < b", "(lambda: 1)()", "min(a, key=b)",
        "'x'", "True + a", "a and b", "f(a)",
    ])
    def test_only_arithmetic_is_parsed(self, formula: str) -> None:
        with pytest.raises(ValueError):
            parse_formula(formula, {"a", "b"})


class TestAsRewardSource:
    def test_scores_a_batch_and_a_formula_without_value_scores_zero(self) -> None:
        grader = parse_grader({**TestMulti.GRADER, "calculate_output": "email / (name - name) + email"})
        source = GraderSource("grader:user", grader, chat=None)
        items = [RewardInput(prompt="p", completion=c, completion_ids=[], extras=TestMulti.ITEM)
                 for c in ('{"name": "John Doe", "email": "john.doe@example.com"}', "not json")]
        values = asyncio.run(source(items, step=1))
        assert values == [0.0, 0.0] and source.formula_errors == 2 and source.sample_parse_errors == 2
        plain = GraderSource("grader:user", parse_grader(TestMulti.GRADER), chat=None)
        assert asyncio.run(plain(items, step=1)) == [1.0, 0.0]
        assert all(math.isfinite(v) for v in asyncio.run(plain(items, step=2)) if v is not None)


# --- bounded work (issue 30): rendered size, linear metrics ------------------------------------------


class TestRenderedSize:
    AMPLIFIER = "{{item.a}}" * 2000  # 20,000 characters: the longest template a grader may have

    def test_a_repeated_large_field_is_refused_naming_the_field_and_limit(self) -> None:
        item = {"a": "x" * 100_000}
        with pytest.raises(GraderInputTooLarge) as refused:
            render(self.AMPLIFIER, item, Sample("s"), field="reference", max_chars=MAX_RENDERED_CHARS)
        assert refused.value.field == "reference" and refused.value.limit == MAX_RENDERED_CHARS
        assert "GRPO_GRADER_MAX_RENDERED_CHARS" in str(refused.value)

    def test_rendering_stops_at_the_limit_instead_of_building_the_whole_text(self) -> None:
        # 2,000 x 100 KB would be 200 MB of text; counted while rendering, at most the limit is ever held.
        item = {"a": "x" * 100_000}
        tracemalloc.start()
        try:
            with pytest.raises(GraderInputTooLarge):
                render(self.AMPLIFIER, item, Sample("s"), max_chars=MAX_RENDERED_CHARS)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 * MAX_RENDERED_CHARS, f"rendering held {peak} bytes"

    def test_within_the_limit_renders_as_before(self) -> None:
        assert render("{{item.a}}-{{ sample.output_text }}", {"a": [1, "é"]}, Sample("s"), max_chars=10) == '[1, "é"]-s'
        with pytest.raises(GraderInputTooLarge):
            render("{{item.a}}-{{ sample.output_text }}", {"a": [1, "é"]}, Sample("s!"), max_chars=10)

    def test_graders_run_refuses_naming_the_sub_grader(self) -> None:
        grader = parse_grader({**TestMulti.GRADER, "graders": {
            **TestMulti.GRADER["graders"],
            "name": {**TestMulti.GRADER["graders"]["name"], "reference": self.AMPLIFIER},
        }})
        with pytest.raises(GraderInputTooLarge) as refused:
            asyncio.run(run_grader(grader, {"a": "x" * 100_000, **TestMulti.ITEM}, '{"name": "n", "email": "e"}', chat=None))
        assert refused.value.field == "graders.name.reference"

    def test_training_scores_an_oversized_completion_lowest_and_counts_it(self) -> None:
        grader = parse_grader({"type": "string_check", "name": "check", "operation": "eq",
                               "input": "{{sample.output_text}}", "reference": "{{item.ref}}"})
        source = GraderSource("grader:check", grader, chat=None, limits=GraderLimits(max_rendered_chars=1024))
        items = [RewardInput(prompt="p", completion=c, completion_ids=[], extras={"ref": c})
                 for c in ("fine", "y" * 1025)]
        assert asyncio.run(source(items, step=1)) == [1.0, 0.0]
        assert source.input_too_large == 1

    def test_refusals_cross_a_process_boundary_intact(self) -> None:
        too_large = GraderInputTooLarge("input", "the rendered template", 10, "GRPO_GRADER_MAX_RENDERED_CHARS")
        copy = pickle.loads(pickle.dumps(too_large))
        assert (copy.field, copy.limit, str(copy)) == ("input", 10, str(too_large))
        missing = MissingField(parse_reference("item.a"), "a")
        assert str(pickle.loads(pickle.dumps(missing))) == str(missing)


class TestLinearMetrics:
    def test_rouge_l_matches_rouge_scores_table(self) -> None:
        # The previous definition (rouge-score's n x m table) on small inputs: same tokens, same F-measure.
        from rouge_score import rouge_scorer

        reference_scorer = rouge_scorer.RougeScorer(["rougeL"])
        rng = random.Random(30)
        words = ["the", "cat", "Sat", "on", "mat", "a", "dog", "ran", "42", "é", "x-y", ","]
        cases = [("", "a b"), ("a b", ""), ("!!", "a"), ("The cat", "the CAT"), ("a a a", "a")]
        for _ in range(300):
            cases.append((" ".join(rng.choices(words, k=rng.randint(0, 30))),
                          " ".join(rng.choices(words, k=rng.randint(0, 30)))))
        for reference, text in cases:
            expected = reference_scorer.score(reference, text)["rougeL"].fmeasure
            assert similarity("rouge_l", text, reference) == pytest.approx(expected, abs=1e-12), (reference, text)

    def test_rouge_l_of_20k_token_texts_is_fast(self) -> None:
        rng = random.Random(7)
        words = [f"w{i}" for i in range(500)]
        a, b = (" ".join(rng.choices(words, k=20_000)) for _ in range(2))
        started = time.perf_counter()
        value = similarity("rouge_l", a, b)
        assert 0.0 < value < 1.0 and time.perf_counter() - started < 5

    def test_fuzzy_match_refuses_a_text_over_its_limit(self) -> None:
        limits = GraderLimits(max_fuzzy_match_chars=100)
        assert similarity("fuzzy_match", "a" * 100, "a" * 100, limits=limits) == 1.0
        with pytest.raises(GraderInputTooLarge) as refused:
            similarity("fuzzy_match", "short", "b" * 101, limits=limits)
        assert refused.value.field == "reference" and "GRPO_GRADER_MAX_FUZZY_MATCH_CHARS" in str(refused.value)
