"""Graders against OpenAI's graders guide: the expected scores are the documented ones (string_check's four
operations, templates of item/sample, output_json only for a JSON sample, the multigrader's formula over
named graders, similarity metrics scoring identical text 1 and disjoint text 0), not read off our code."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from contract.graders import FormulaError, GraderInvalid, evaluate_formula, parse_formula, parse_grader
from contract.reward_types import RewardInput
from outbound.graders import GraderSource, run_grader


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
