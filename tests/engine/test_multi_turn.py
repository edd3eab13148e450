"""Multi-turn rollouts (worker.grpo.multi_turn): tool calls parsed, results appended as suffix tokens, the
environment's tokens out of the loss, the sampled ids kept end to end, failures per member.

The turn loop's bookkeeping is checked with a scripted sampler (the policy's turns given as token ids) over real
tokenizers and real environments: a Python class in process, and the example calculator as an OpenEnv server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from contract.config import GRPOConfig
from outbound.openenv_session import EnvironmentConfig, EnvironmentOutage, EpisodeFailed
from tests.engine.trainer_helpers import shared_model_cache
from worker.grpo.batch import loss_mask_for
from worker.grpo.data import PromptRow
from worker.grpo.environment import LocalEnvironment, MultiTurnSettings, OpenEnvEnvironment
from worker.grpo.multi_turn import MultiTurnRollout
from worker.grpo.pretrained import build_smollm2
from worker.grpo.rewards import CompositeReward, EnvironmentReward
from worker.grpo.tiny import build_tokenizer
from worker.grpo.tool_calls import HERMES_LINES_TEMPLATE, NoToolFormat, ToolCall, parse_turn, tool_format
from worker.grpo.tool_tasks import split
from worker.grpo.trainer import GRPOTrainer
from worker.grpo.warm_tools import build_tools_model

# --- parsing ----------------------------------------------------------------------------------------------------


def test_hermes_calls_are_parsed_with_their_arguments() -> None:
    text = 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' \
           '<tool_call>\n{"name": "submit", "arguments": "{\\"answer\\": \\"5\\"}"}\n</tool_call>'
    parsed = parse_turn(text, "hermes")
    assert parsed.calls == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("submit", {"answer": "5"})]
    assert parsed.errors == []


def test_a_call_that_is_not_json_is_an_error_for_the_policy_to_read() -> None:
    parsed = parse_turn('<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>', "hermes")
    assert parsed.calls == [] and len(parsed.errors) == 1 and parsed.wants_tools
    assert parse_turn('<tool_call>["add"]</tool_call>', "hermes").errors == ["tool call not understood: a call is "
                                                                             "a JSON object with a name"]


def test_llama3_calls_are_a_turn_of_json_and_plain_text_is_an_answer() -> None:
    call = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}<|eom_id|>'
    assert parse_turn(call, "llama3").calls == [ToolCall("add", {"a": 1, "b": 2})]
    assert not parse_turn("The answer is 3.<|eot_id|>", "llama3").wants_tools


def test_the_format_comes_from_the_chat_template_and_none_is_a_clear_error() -> None:
    assert tool_format(HERMES_LINES_TEMPLATE) == "hermes"
    assert tool_format("{{ '<|start_header_id|>ipython<|end_header_id|>' }}") == "llama3"
    with pytest.raises(NoToolFormat, match="no tool-call format"):
        tool_format(build_tokenizer().chat_template)
    with pytest.raises(NoToolFormat, match="no chat template"):
        tool_format(None)


# --- the loop ---------------------------------------------------------------------------------------------------


class Adder:
    """A TRL environment_factory-style class: `add` is a tool, `submit` ends with the reward."""

    def __init__(self) -> None:
        self.expected = ""
        self.submitted = ""

    def reset(self, **row: Any) -> None:
        self.expected = str(row["answer"])

    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    def submit(self, answer: str) -> str:
        """The final answer."""
        self.submitted = answer
        return "ok"

    def get_reward(self) -> float:
        return 1.0 if self.submitted == self.expected else 0.0


class Loop:
    """The backend's event loop stand-in: a real asyncio loop on its own thread, as the reward loop is."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture
def loop() -> Iterator[Loop]:
    running = Loop()
    yield running
    running.close()


def scripted(tokenizer: Any, turns: list[str], eos: int) -> Any:
    """A sampler that answers the k-th turn of every sequence with turns[k] (EOS appended), seen by how many
    tool results the sequence holds; records what it was asked."""
    asked: list[tuple[list[int], int]] = []

    def sample(sequences: list[list[int]], budgets: list[int], seeds: list[int]) -> list[tuple[list[int], None]]:
        out = []
        for sequence, budget in zip(sequences, budgets, strict=True):
            asked.append((sequence, budget))
            k = tokenizer.decode(sequence).count("tool: ")
            ids = list(tokenizer(turns[min(k, len(turns) - 1)], add_special_tokens=False)["input_ids"]) + [eos]
            out.append((ids[:budget], None))
        return out

    sample.asked = asked  # type: ignore[attr-defined]
    return sample


def tiny_tools_tokenizer() -> Any:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = HERMES_LINES_TEMPLATE
    return tokenizer


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
SUBMIT = '<tool_call>{"name": "submit", "arguments": {"answer": "5"}}</tool_call>'
ROWS = [PromptRow(prompt=[{"role": "user", "content": "2+3?"}], extras={"answer": "5"})]


def rollout_of(loop: Loop, environment: Any, turns: list[str], *, max_turns: int = 4, budget: int = 400,
               group: int = 2, tokenizer: Any = None) -> tuple[Any, Any]:
    tokenizer = tokenizer or tiny_tools_tokenizer()
    config = GRPOConfig(num_generations=group, max_completion_length=budget, prompts_per_step=1, max_steps=1)
    sample = scripted(tokenizer, turns, tokenizer.eos_token_id)
    environment.settings = MultiTurnSettings(max_turns=max_turns)
    engine = MultiTurnRollout(tokenizer, config, environment, sample, loop.run, [tokenizer.eos_token_id])
    rollout, _ = engine.generate(ROWS, [7])
    return rollout, sample


def test_a_tool_turn_then_an_answer_masks_exactly_the_tool_results(loop: Loop) -> None:
    tokenizer = tiny_tools_tokenizer()
    rollout, sample = rollout_of(loop, LocalEnvironment(Adder), [CALL, SUBMIT, "5"], tokenizer=tokenizer)
    ids = rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist()
    eos = tokenizer.eos_token
    # the call, its result (masked), the submit call, its result (masked), the answer without a call
    assert tokenizer.decode(ids) == f"{CALL}{eos}\ntool: 5\nassistant: {SUBMIT}{eos}\ntool: ok\nassistant: 5{eos}"
    masked = tokenizer.decode([t for t, m in zip(ids, rollout.tool_mask[0].tolist(), strict=False) if m == 0])
    assert masked == "\ntool: 5\nassistant: \ntool: ok\nassistant: "
    loss_mask = loss_mask_for(rollout, torch.ones(1, dtype=torch.bool), mask_truncated=False)
    assert torch.equal(loss_mask, rollout.tool_mask * rollout.completion_mask)  # the batch the loss sees
    assert int(loss_mask[0].sum()) == len(ids) - len(masked)
    episode = rollout.episodes[0]
    assert [t["role"] for t in episode["turns"]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    first_suffix = len("\ntool: 5\nassistant: ")
    assert episode["turns"][1] == {"role": "tool", "name": "add", "text": "5", "error": None, "reward": None,
                                   "masked": True, "tokens": first_suffix}
    assert episode["turns"][0]["tool_calls"] == [{"name": "add", "arguments": {"a": 2, "b": 3}}]
    assert episode["reward"] == 1.0 and episode["error"] is None  # get_reward()
    # The second turn was sampled from the prompt, the first turn's ids and the suffix: nothing re-tokenised.
    (prompt, _), (second, _) = sample.asked[0], sample.asked[2]  # both members' first turns, then turn 2
    assert second == prompt + ids[: len(CALL) + 1 + first_suffix]


def test_max_turns_and_the_token_budget_bound_the_episode(loop: Loop) -> None:
    rollout, _ = rollout_of(loop, LocalEnvironment(Adder), [CALL], max_turns=3)
    turns = rollout.episodes[0]["turns"]
    assert [t["role"] for t in turns].count("assistant") == 3  # the third turn's call is not run
    assert rollout.episodes[0]["reward"] == 0.0
    short, _ = rollout_of(loop, LocalEnvironment(Adder), [CALL], budget=len(CALL) + 10)
    assert bool(short.is_truncated[0]) is False  # the turn ended; its result did not fit, so the episode ends
    assert int(short.completion_mask[0].sum()) == len(CALL) + 1 and int(short.tool_mask[0].sum()) == len(CALL) + 1


class Broken(Adder):
    def add(self, a: int, b: int) -> int:
        """Fails."""
        raise RuntimeError("overflow")


def test_a_tool_error_is_read_by_the_policy_and_a_bad_call_too(loop: Loop) -> None:
    rollout, _ = rollout_of(loop, LocalEnvironment(Broken), [CALL, '<tool_call>{"name": </tool_call>', SUBMIT])
    tools = [t for t in rollout.episodes[0]["turns"] if t["role"] == "tool"]
    assert tools[0]["text"] == "error: overflow" and tools[0]["error"] == "overflow"
    assert tools[1]["name"] == "unparsed" and tools[1]["text"].startswith("error: tool call not understood")
    assert rollout.episodes[0]["error"] is None  # the episode went on to submit


def test_rows_go_to_reset_and_a_failing_reset_fails_only_that_member(loop: Loop) -> None:
    class Picky(Adder):
        opened = 0

        def reset(self, **row: Any) -> None:
            Picky.opened += 1
            if Picky.opened == 2:
                raise ValueError("no such row")
            super().reset(**row)

    rollout, _ = rollout_of(loop, LocalEnvironment(Picky), [CALL, SUBMIT])
    first, second = rollout.episodes
    assert first["reward"] == 1.0 and first["error"] is None
    assert second["reward"] is None and "no such row" in second["error"]
    assert second["turns"] == [] and int(rollout.completion_mask[1].sum()) == 0  # nothing sampled, nothing trained


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_smollm2(shared_model_cache()))
    # SmolLM2's own template renders no tools; ChatML with Hermes calls, as Qwen2.5's does.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
        "{% for c in m.tool_calls or [] %}{{ '<tool_call>' + (c['function'] | tojson) + '</tool_call>' }}{% endfor %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    return tokenizer


def test_sampled_ids_are_kept_where_decode_then_encode_would_change_them(loop: Loop, smollm2_tokenizer: Any) -> None:
    tokenizer = smollm2_tokenizer
    # The policy spells "add" one character at a time: a valid sample, which BPE would encode as other ids.
    head, tail = CALL.split("add", 1)
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in "add"]
    call_ids = (tokenizer(head, add_special_tokens=False)["input_ids"] + spelled
                + tokenizer(tail, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    assert tokenizer.decode(call_ids) == CALL + tokenizer.eos_token
    assert tokenizer(tokenizer.decode(call_ids), add_special_tokens=False)["input_ids"] != call_ids
    answer = tokenizer("5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    calls = iter([call_ids, call_ids, answer, answer])  # both members call, then both answer

    def sample(sequences: list[list[int]], budgets: list[int], seeds: list[int]) -> list[tuple[list[int], None]]:
        return [(next(calls), None) for _ in sequences]

    config = GRPOConfig(num_generations=2, max_completion_length=200, prompts_per_step=1, max_steps=1)
    engine = MultiTurnRollout(tokenizer, config, LocalEnvironment(Adder), sample, loop.run, [tokenizer.eos_token_id])
    rollout, _ = engine.generate(ROWS, [1])
    ids = rollout.completion_ids[0].tolist()
    sampled = [t for t, m in zip(ids, rollout.tool_mask[0].tolist(), strict=True) if m == 1]
    assert sampled == call_ids + answer  # the loss trains on exactly the sampled ids, across both turns
    assert ids[: len(call_ids)] == call_ids
    suffix = ids[len(call_ids): len(ids) - len(answer)]
    assert tokenizer.decode(suffix) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


# --- a real OpenEnv server ----------------------------------------------------------------------------------------


def test_the_calculator_over_openenv_runs_each_member_in_its_own_episode(loop: Loop, calculator_url: str) -> None:
    config = EnvironmentConfig(environment_id="env_calc", url=calculator_url, secret="whsec_" + "A" * 32, allow_private=True)
    turns = [CALL, SUBMIT]
    rollout, _ = rollout_of(loop, OpenEnvEnvironment(config, max_sessions=1), turns, group=3)
    for episode in rollout.episodes:
        tools = [t for t in episode["turns"] if t["role"] == "tool"]
        assert [t["name"] for t in tools] == ["add", "submit"]
        assert tools[0]["text"] == "5.0" and tools[1]["reward"] == 1.0
        assert episode["reward"] == 1.0 and episode["error"] is None


def test_a_server_that_is_down_for_the_whole_wave_is_an_outage(loop: Loop) -> None:
    from tests.worker.procs import free_port

    config = EnvironmentConfig(environment_id="env_gone", url=f"http://127.0.0.1:{free_port()}", secret="whsec_" + "A" * 32,
                               allow_private=True, max_attempts=2, backoff_s=0.01, backoff_max_s=0.02)
    with pytest.raises(EnvironmentOutage, match="env_gone"):
        rollout_of(loop, OpenEnvEnvironment(config, max_sessions=4), [CALL])


def test_tool_schemas_come_from_the_class(loop: Loop) -> None:
    environment = LocalEnvironment(Adder)
    session = loop.run(environment.open({"answer": "5"})).result()
    tools = loop.run(environment.tools(session)).result()
    assert [t["function"]["name"] for t in tools] == ["add", "submit"]
    assert tools[0]["function"]["parameters"] == {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    }


def test_native_continuations_stop_at_eos_and_at_each_budget(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.grpo.rollout import sample_continuations

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = GRPOConfig(num_generations=2, max_completion_length=64, prompts_per_step=1, max_steps=1)
    sequences = [tokenizer("ab")["input_ids"], tokenizer("hello there")["input_ids"]]
    first = sample_continuations(model, tokenizer, sequences, [5, 9], [1, 2], config)
    again = sample_continuations(model, tokenizer, sequences, [5, 9], [1, 2], config)
    assert first == again  # seeded per row
    assert len(first[0][0]) <= 5 and len(first[1][0]) <= 9
    alone = sample_continuations(model, tokenizer, sequences[1:], [9], [2], config)
    assert alone[0] == first[1]  # a row samples the same whatever else is in the batch


class FailingCalls(LocalEnvironment):
    """Tool errors of the local kind are messages; this one lets EpisodeFailed through, as the OpenEnv session does."""

    async def open(self, row: Any) -> Any:
        session = await super().open(row)
        call = session.call

        async def breaking(tool_call: ToolCall) -> Any:
            if tool_call.name == "add":
                raise EpisodeFailed("env_calc: an answer larger than 1048576 bytes")
            return await call(tool_call)

        session.call = breaking
        return session


def test_an_episode_that_breaks_mid_way_loses_its_reward_and_is_reported(loop: Loop) -> None:
    reported: list[list[str]] = []
    environment = FailingCalls(Adder)
    environment.report = reported.append
    rollout, _ = rollout_of(loop, environment, [CALL, SUBMIT])
    assert [e["error"] for e in rollout.episodes] == ["env_calc: an answer larger than 1048576 bytes"] * 2
    assert [e["reward"] for e in rollout.episodes] == [None, None]  # the environment source abstains
    assert reported == [["env_calc: an answer larger than 1048576 bytes"] * 2]  # one report per batch
    assert int(rollout.tool_mask.sum()) == int(rollout.completion_mask.sum())  # only the sampled turn is kept


def test_a_trainer_with_an_environment_trains_on_episodes_and_evaluates_episodes(tmp_path: Path) -> None:
    train, held_out = split()
    to_row = lambda item: PromptRow(item.row()["prompt"], {"answer": item.answer})  # noqa: E731
    config = GRPOConfig(num_generations=2, prompts_per_step=2, max_steps=1, max_completion_length=160, eval_every=1,
                        eval_samples=3, checkpoint_every=100, log_completions_every=1, log_completions_count=4)
    trainer = GRPOTrainer(
        config, base_model=str(build_tools_model(shared_model_cache())), train_rows=[to_row(i) for i in train[:4]],
        eval_rows=[to_row(i) for i in held_out[:3]], reward=CompositeReward([(EnvironmentReward(), 1.0)]),
        output_dir=tmp_path, environment=LocalEnvironment(Adder),
    )
    result = trainer.train()
    step = result.history[0]
    assert step["env/episodes"] == 4.0 and step["env/errors"] == 0.0
    for evaluation in result.evaluations.values():  # before training and after step 1: episodes, not completions
        assert set(evaluation) == {"eval/reward/mean", "eval/accuracy", "eval/pass@2"}
