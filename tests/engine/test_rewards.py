"""Reward composite (validation, concurrency, abstentions), the built-ins and the reward-model source."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from contract.reward_types import RewardError, RewardInput, RewardUnavailable
from contract.spec import (
    MAX_PATTERN_LENGTH,
    BuiltinRewardSpec,
    ModelRewardSpec,
    RemoteRewardSpec,
    RewardSpec,
)
from worker.grpo.rewards import CompositeReward, FunctionSource, build_reward_sources, extract_boxed

REPO = Path(__file__).resolve().parents[2]


def make_items(completions: Sequence[str], **extras: Any) -> list[RewardInput]:
    return [
        RewardInput(
            prompt="Q: ", completion=c, completion_ids=list(range(len(c))), extras=dict(extras), index=i
        )
        for i, c in enumerate(completions)
    ]


class StaticSource:
    """Answers a fixed value list (or raises), optionally after a delay; records whether it finished."""

    def __init__(self, name: str, answer: Any = None, *, delay: float = 0.0, error: Exception | None = None):
        self.name = name
        self.answer = answer
        self.delay = delay
        self.error = error
        self.finished = False

    async def __call__(self, items: Sequence[RewardInput], *, step: int) -> Any:
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        self.finished = True
        return self.answer if self.answer is not None else [1.0] * len(items)


def builtin(name: str, **params: Any) -> CompositeReward:
    return build_reward_sources([BuiltinRewardSpec.model_validate({"name": name, "params": params})])


async def score_one(
    name: str, completions: Sequence[str], params: dict[str, Any], **extras: Any
) -> list[float]:
    result = await builtin(name, **params).score(make_items(completions, **extras), step=0)
    return result.total


class TestCompositeValidation:
    @pytest.mark.parametrize(
        ("answer", "reason"),
        [
            ([1.0, 2.0], "returned 2 values for 3 completions"),
            ([1.0, math.nan, 0.0], "value 1 is not finite"),
            ([1.0, 0.0, math.inf], "value 2 is not finite"),
            ([1.0, "0.5", 0.0], "value 1 is not a number"),
            ("1.0", "expected a list"),
        ],
    )
    async def test_bad_answer_names_source(self, answer: Any, reason: str) -> None:
        composite = CompositeReward([(StaticSource("good"), 1.0), (StaticSource("broken", answer), 1.0)])
        with pytest.raises(RewardError) as info:
            await composite.score(make_items(["a", "b", "c"]), step=0)
        assert info.value.source == "broken"
        assert reason in str(info.value)
        assert "'broken'" in str(info.value)

    async def test_raising_source_becomes_reward_error(self) -> None:
        composite = CompositeReward([(StaticSource("boom", error=ZeroDivisionError("oops")), 1.0)])
        with pytest.raises(RewardError, match=r"'boom'.*ZeroDivisionError: oops") as info:
            await composite.score(make_items(["a"]), step=0)
        assert info.value.source == "boom"
        assert isinstance(info.value.__cause__, ZeroDivisionError)

    async def test_unavailable_propagates_unchanged(self) -> None:
        error = RewardUnavailable("remote:rf_1", "gave up after 5 attempts")
        composite = CompositeReward([(StaticSource("remote:rf_1", error=error), 1.0)])
        with pytest.raises(RewardUnavailable) as info:
            await composite.score(make_items(["a"]), step=0)
        assert info.value is error

    async def test_failure_cancels_slow_sources(self) -> None:
        slow = StaticSource("slow", delay=5.0)
        composite = CompositeReward([(slow, 1.0), (StaticSource("boom", error=RuntimeError("x")), 1.0)])
        started = time.perf_counter()
        with pytest.raises(RewardError, match="boom"):
            await composite.score(make_items(["a"]), step=0)
        assert time.perf_counter() - started < 1.0
        assert not slow.finished

    def test_duplicate_names_refused(self) -> None:
        with pytest.raises(ValueError, match="listed twice: same"):
            CompositeReward([(StaticSource("same"), 1.0), (StaticSource("same"), 1.0)])


class TestCompositeSum:
    async def test_weighted_sum_ignores_none(self) -> None:
        composite = CompositeReward(
            [
                (StaticSource("a", [1.0, None, 2.0, None]), 2.0),
                (StaticSource("b", [0.5, 3.0, None, None]), -1.0),
            ]
        )
        result = await composite.score(make_items(["w", "x", "y", "z"]), step=3)
        assert result.total[:3] == [1.5, -3.0, 4.0]
        assert math.isnan(result.total[3])  # every source abstained
        assert result.per_source == {"a": [1.0, None, 2.0, None], "b": [0.5, 3.0, None, None]}

    async def test_metrics_ignore_none(self) -> None:
        composite = CompositeReward(
            [(StaticSource("a", [1.0, None, 3.0]), 1.0), (StaticSource("n", [None] * 3), 1.0)]
        )
        result = await composite.score(make_items(["x", "y", "z"]), step=0)
        assert result.metrics["reward/a/mean"] == 2.0
        assert result.metrics["reward/a/std"] == 1.0  # population std of {1, 3}
        assert math.isnan(result.metrics["reward/n/mean"])
        assert math.isnan(result.metrics["reward/n/std"])

    async def test_sources_run_concurrently(self) -> None:
        composite = CompositeReward(
            [(StaticSource("s1", delay=0.2), 1.0), (StaticSource("s2", delay=0.2), 1.0)]
        )
        started = time.perf_counter()
        result = await composite.score(make_items(["a", "b"]), step=0)
        elapsed = time.perf_counter() - started
        assert result.total == [2.0, 2.0]
        assert elapsed < 0.35, f"two 0.2 s sources took {elapsed:.3f} s: not concurrent"


class TestBoxedAnswer:
    def test_extract_nested_and_last(self) -> None:
        assert extract_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
        assert extract_boxed(r"\boxed{1} then \boxed{2}") == "2"
        assert extract_boxed(r"\boxed{3} then \boxed{4") == "3"  # unclosed last box is ignored
        assert extract_boxed("no box") is None

    async def test_seed_003_examples(self) -> None:
        good = "16 - 3 - 4 = 9.\n9 * 7 = 63.\n\\boxed{63}"
        bad = "I think she can sell about 50 eggs. \\boxed{50}"
        assert await score_one("boxed_answer", [good, bad, "63"], {}, answer="63") == [1.5, 0.5, 0.0]

    async def test_numeric_tolerance_and_text(self) -> None:
        completions = [r"\boxed{63.0}", r"\boxed{ 1,000 }", r"\boxed{63.01}", r"\boxed{}", r"\boxed{x+1}"]
        assert await score_one("boxed_answer", completions[:3], {}, answer=63) == [1.5, 0.5, 0.5]
        assert await score_one("boxed_answer", completions[1:2], {}, answer="1000") == [1.5]
        assert await score_one("boxed_answer", completions[2:3], {"tolerance": 0.05}, answer=63) == [1.5]
        assert await score_one("boxed_answer", completions[3:], {}, answer="x+1") == [0.0, 1.5]

    async def test_last_box_wins(self) -> None:
        assert await score_one("boxed_answer", [r"\boxed{5} no, \boxed{7}"], {}, answer="7") == [1.5]
        assert await score_one("boxed_answer", [r"\boxed{7} no, \boxed{5}"], {}, answer="7") == [0.5]

    async def test_custom_rewards_and_column(self) -> None:
        params = {"answer_column": "solution", "format_reward": 0.1, "correct_reward": 2.0}
        assert await score_one("boxed_answer", [r"\boxed{\frac{1}{2}}"], params, solution=r"\frac{1}{2}") == [
            2.1
        ]

    async def test_missing_column_names_it(self) -> None:
        with pytest.raises(RewardError, match=r"'boxed_answer'.*no column 'answer'.*columns: target"):
            await score_one("boxed_answer", [r"\boxed{1}"], {}, target="1")


class TestOtherBuiltins:
    async def test_exact_match(self) -> None:
        completions = ["  Paris\n", "paris", "Lyon"]
        assert await score_one("exact_match", completions, {}, answer="Paris") == [1.0, 0.0, 0.0]
        assert await score_one("exact_match", completions, {"case_sensitive": False}, answer="Paris") == [
            1.0,
            1.0,
            0.0,
        ]
        assert await score_one("exact_match", completions, {"strip": False}, answer="Paris") == [
            0.0,
            0.0,
            0.0,
        ]

    async def test_exact_match_missing_column(self) -> None:
        with pytest.raises(RewardError, match="no column 'label'"):
            await score_one("exact_match", ["x"], {"answer_column": "label"}, answer="x")

    async def test_regex_match(self) -> None:
        completions = ["answer: 42", "42", "none"]
        assert await score_one("regex_match", completions, {"pattern": r"\d+"}) == [1.0, 1.0, 0.0]
        assert await score_one("regex_match", completions, {"pattern": r"\d+", "fullmatch": True}) == [
            0.0,
            1.0,
            0.0,
        ]

    async def test_length_penalty(self) -> None:
        completions = ["abcd", "abcdefgh", "ab"]  # make_items gives len(text) token ids
        params = {"target_length": 4, "scale": 2.0, "unit": "chars"}
        assert await score_one("length_penalty", completions, params) == [0.0, -2.0, -1.0]
        items = [RewardInput(prompt="", completion="abcdefgh", completion_ids=[1, 2])]
        result = await builtin("length_penalty", target_length=4, unit="tokens").score(items, step=0)
        assert result.total == [-0.5]


class TestBuildRewardSources:
    async def test_mixed_specs(self) -> None:
        remote_source = StaticSource("remote:rf_1", [0.25, None])
        specs: list[RewardSpec] = [
            BuiltinRewardSpec.model_validate(
                {"name": "regex_match", "weight": 2.0, "params": {"pattern": "yes"}}
            ),
            RemoteRewardSpec(reward_function_id="rf_1", weight=4.0),
        ]
        built: list[RemoteRewardSpec] = []

        def remote(spec: RemoteRewardSpec) -> StaticSource:
            built.append(spec)
            return remote_source

        composite = build_reward_sources(specs, remote=remote)
        assert composite.names == ["regex_match", "remote:rf_1"]
        assert built == [specs[1]]
        result = await composite.score(make_items(["yes", "no"]), step=0)
        assert result.total == [3.0, 0.0]

    def test_remote_without_client(self) -> None:
        with pytest.raises(RewardError, match="'remote:rf_9'.*need a client"):
            build_reward_sources([RemoteRewardSpec(reward_function_id="rf_9", weight=1.0)])

    def test_model_that_does_not_exist(self, tmp_path: Path) -> None:
        with pytest.raises(RewardError, match="the reward model could not be loaded") as info:
            build_reward_sources([ModelRewardSpec(model=str(tmp_path / "missing"), weight=1.0, batch_size=4)])
        assert info.value.code == "model_load_failed"

    @pytest.mark.parametrize("target", ["/etc/passwd", "/etc", "/proc/self"])
    def test_load_errors_never_describe_the_workers_filesystem(self, target: str) -> None:
        with pytest.raises(RewardError) as info:
            build_reward_sources([ModelRewardSpec(model=target, weight=1.0)], model_paths={target: target})
        assert str(info.value) == f"reward source 'model:{target}': the reward model could not be loaded"


# --------------------------------------------------------------------------------------------------
# Reward model
# --------------------------------------------------------------------------------------------------


def save_tiny_reward_model(out_dir: Path) -> Path:
    """A 2-layer LlamaForSequenceClassification with a char-level tokenizer, saved with save_pretrained."""
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>", model_max_length=256
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        num_labels=1,  # type: ignore[call-arg]  # a PretrainedConfig kwarg the stubs do not list
        pad_token_id=0,
        eos_token_id=2,
    )
    LlamaForSequenceClassification(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


class TestRewardModel:
    @pytest.fixture(scope="class")
    def model_dir(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        import torch

        torch.set_num_threads(1)
        return save_tiny_reward_model(tmp_path_factory.mktemp("rm"))

    async def test_scores_match_unbatched_forward(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        composite = build_reward_sources([ModelRewardSpec(model=str(model_dir), batch_size=2, weight=1.0)])
        completions = ["a", "a much longer completion", "mid size", "zz"]
        items = make_items(completions)
        result = await composite.score(items, step=0)

        # Reference: each text alone (no padding), loaded independently through from_pretrained.
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
        with torch.no_grad():
            expected = [
                float(model(**tokenizer(item.prompt + item.completion, return_tensors="pt")).logits[0, 0])
                for item in items
            ]
        assert result.total == pytest.approx(expected, abs=1e-5)
        assert len(set(result.total)) == len(completions)  # really distinct texts, distinct scores
        assert result.per_source[f"model:{model_dir}"] == result.total

    @pytest.mark.parametrize(
        ("damage", "reason"),
        [
            ("architecture", "unknown architecture 'FooForSequenceClassification'"),
            ("weights", "corrupt safetensors file"),
        ],
    )
    def test_a_model_that_does_not_load_names_the_reason(
        self, model_dir: Path, tmp_path: Path, damage: str, reason: str
    ) -> None:
        """A reward model from_pretrained cannot load fails as model_load_failed with the reason's class (as a
        base model does), and still nothing of the loader's text (paths)."""
        import json
        import shutil

        broken = Path(shutil.copytree(model_dir, tmp_path / "broken"))
        if damage == "architecture":
            config = json.loads((broken / "config.json").read_text())
            config.update(model_type="foo", architectures=["FooForSequenceClassification"])
            (broken / "config.json").write_text(json.dumps(config))
        else:
            weights = (broken / "model.safetensors").read_bytes()
            (broken / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # a download cut short
        with pytest.raises(RewardError) as info:
            build_reward_sources([ModelRewardSpec(model="rm", weight=1.0)], model_paths={"rm": str(broken)})
        assert info.value.code == "model_load_failed"
        assert str(info.value) == f"reward source 'model:rm': the reward model could not be loaded: {reason}"

    async def test_runs_off_the_event_loop(self, model_dir: Path) -> None:
        import threading

        from worker.grpo.reward_model import RewardModelSource

        source = RewardModelSource(str(model_dir), batch_size=4)
        loop_thread = threading.get_ident()
        threads: list[int] = []
        original = source.score_texts

        def spy(texts: Sequence[str]) -> list[float]:
            threads.append(threading.get_ident())
            return original(texts)

        source.score_texts = spy  # type: ignore[method-assign]
        values = await source(make_items(["x", "y"]), step=0)
        assert len(values) == 2
        assert threads and threads[0] != loop_thread


class TestUserPatterns:
    """regex_match runs user patterns on RE2: linear time, so no pattern can stall a worker."""

    def test_catastrophic_pattern_scores_in_bounded_time(self) -> None:
        # In a child process: a backtracking engine would hold the GIL for centuries, and the test with it.
        script = (
            "import asyncio, time\n"
            "from tests.engine.test_rewards import score_one\n"
            "start = time.monotonic()\n"
            "scores = asyncio.run(score_one('regex_match', ['a' * 64, 'x' * 5000 + 'ZQ'], {'pattern': '(.|.)*ZQ'}))\n"
            "assert scores == [0.0, 1.0], scores\n"
            "print(time.monotonic() - start)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert done.returncode == 0, done.stderr
        assert float(done.stdout) < 20.0

    @pytest.mark.parametrize(
        ("pattern", "reason"),
        [
            (r"(a)\1", "invalid escape sequence"),  # backreference
            (r"(?=a)b", "invalid perl operator"),  # lookahead
            ("a{1000}{1000}", "bad repetition"),
            ("(" * 3 + "a", "missing \\)"),
        ],
    )
    def test_patterns_re2_cannot_run_are_refused_with_its_reason(self, pattern: str, reason: str) -> None:
        with pytest.raises(ValidationError, match=reason):
            BuiltinRewardSpec(name="regex_match", params={"pattern": pattern})

    def test_pattern_length_is_capped(self) -> None:
        BuiltinRewardSpec(name="regex_match", params={"pattern": "a" * MAX_PATTERN_LENGTH})
        with pytest.raises(ValidationError, match="at most"):
            BuiltinRewardSpec(name="regex_match", params={"pattern": "a" * (MAX_PATTERN_LENGTH + 1)})

    def test_program_size_is_bounded(self) -> None:
        with pytest.raises(ValidationError, match="pattern too large"):
            BuiltinRewardSpec(name="regex_match", params={"pattern": r"\pL{1000}"})


def _extract_boxed_by_rescanning(text: str) -> str | None:
    """The straightforward definition (rescan from each box start, last first): the reference."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, pos = 1, start + len("\\boxed{")
        while pos < len(text):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                return text[start + len("\\boxed{") : pos]
            pos += 1
        start = text.rfind("\\boxed{", 0, start)
    return None


class TestExtractBoxedIsLinear:
    @given(st.lists(st.sampled_from(["\\boxed{", "{", "}", "a", "\\boxed", "7"]), max_size=40).map("".join))
    @settings(max_examples=400, deadline=None)
    def test_same_answer_as_rescanning(self, text: str) -> None:
        assert extract_boxed(text) == _extract_boxed_by_rescanning(text)

    def test_many_unclosed_boxes_take_linear_time(self) -> None:
        text = "\\boxed{1} " + "\\boxed{" * 40_000  # 280k characters; rescanning would take ~10^9 steps
        start = time.perf_counter()
        assert extract_boxed(text) == "1"
        assert time.perf_counter() - start < 10.0


class TestRuleTimeLimit:
    async def test_a_batch_over_the_limit_fails_with_reward_timeout(self) -> None:
        def slow(item: RewardInput) -> float:
            time.sleep(0.2)
            return 1.0

        composite = CompositeReward([(FunctionSource("slow", slow, timeout_s=0.3), 1.0)])
        start = time.monotonic()
        with pytest.raises(RewardError, match="'slow'.*longer than 0.3s") as info:
            await composite.score(make_items(["a"] * 10), step=0)  # 2 s of work
        assert info.value.code == "reward_timeout"
        assert time.monotonic() - start < 1.5

    async def test_rules_run_off_the_event_loop(self) -> None:
        loop_thread = threading.get_ident()
        seen: list[int] = []

        def record(item: RewardInput) -> float:
            seen.append(threading.get_ident())
            return 0.0

        await FunctionSource("where", record)(make_items(["a"]), step=0)
        assert seen and seen[0] != loop_thread
