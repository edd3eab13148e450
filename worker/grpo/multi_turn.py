"""Multi-turn rollouts: the policy calls an environment's tools over several turns before its reward arrives.

Per group member one episode (`worker.grpo.environment`). A turn samples from the whole sequence so far (prompt,
the policy's earlier turns, the tool results), through the backend's sampling (native or vLLM) as token ids. The
calls in the turn are parsed (`worker.grpo.tool_calls`), sent to the member's session, and each result is appended
as a `tool` message whose tokens are a *suffix* computed by the chat template on a stand-in conversation (TRL's
`_get_tool_suffix_ids`): the ids the policy sampled are never decoded and tokenised again, so the loss trains on
exactly them (re-tokenising a conversation changes ids for most tokenizers). Tool tokens are masked out of the loss
and the KL (`Rollout.tool_mask`).

Bounds: `max_completion_length` counts every turn's tokens and every tool result's; `max_turns` policy turns; a
tool result that would pass the budget ends the episode before it is appended. Members run in waves of at most
the environment's session count, each wave's turns sampled as one batch: a wave holds its sessions from reset to
close, so a server with fewer sessions than the batch has members is never waited on by the batch itself.

Failures: a member whose episode fails (the server errors, times out, answers garbage) keeps what it sampled, gets
no environment reward and is counted in `env/errors`; when not one member of a wave can open an episode because the
server is busy or down, the step raises `EnvironmentOutage` (the job pauses, as for reward endpoints).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from contract.config import GRPOConfig
from outbound.openenv_session import EnvironmentOutage
from worker.grpo.data import PromptRow
from worker.grpo.environment import (
    EnvironmentBusy,
    EnvironmentDown,
    EpisodeError,
    MultiTurnSettings,
    RewardMode,
    ToolEnvironment,
    ToolResult,
    ToolSession,
)
from worker.grpo.modeling import ModelBundle
from worker.grpo.rollout import Rollout, eos_token_ids, tokenize_prompts
from worker.grpo.tool_calls import ParsedTurn, ToolCall, ToolFormat, parse_turn, tool_format

T = TypeVar("T")
# (sequences, token budgets, seeds) -> per sequence the sampled ids (EOS included when reached) and their
# log-probs under the sampler (None: the policy samples itself)
Continue = Callable[[list[list[int]], list[int], list[int]], list[tuple[list[int], list[float] | None]]]
# Runs a coroutine on the backend's event loop (the reward loop), from the trainer's thread
RunAsync = Callable[[Coroutine[Any, Any, Any]], "Future[Any]"]


@dataclass
class _Member:
    """One group member's episode while it runs."""

    prompt_ids: list[int]
    seed: int
    ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # 1: the policy's token, 0: the environment's
    logps: list[float] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    session: ToolSession | None = None
    error: str | None = None
    done: bool = False
    truncated: bool = False
    env_reward: float | None = None

    def record(self, reward_mode: RewardMode) -> dict[str, Any]:
        """The episode as stored with samples: its turns, its error, its environment reward."""
        return {"turns": self.turns, "error": self.error, "reward": self.env_reward, "reward_mode": reward_mode}


class SamplingBackend(Protocol):
    """What a multi-turn rollout asks of the trainer's backend."""

    def continue_sequences(
        self, sequences: list[list[int]], budgets: list[int], seeds: list[int]
    ) -> list[tuple[list[int], list[float] | None]]: ...

    def score(self, coro: Coroutine[Any, Any, T]) -> Future[T]: ...


class MultiTurnRollout:
    """Multi-turn rollouts of already-drawn rows: `generate(rows, seeds)` gives the step's Rollout."""

    @classmethod
    def on(
        cls, backend: SamplingBackend, models: ModelBundle, config: GRPOConfig, environment: ToolEnvironment, *,
        distributed: bool,
    ) -> MultiTurnRollout:
        """Episodes on `environment`, sampled through `backend`; NoToolFormat when the tokenizer has none."""
        if distributed or config.async_generation or config.generation != "sample":
            raise ValueError("multi-turn rollouts sample turn by turn on one device: generation 'sample', "
                             "no async_generation")
        return cls(
            models.tokenizer, config, environment, backend.continue_sequences,
            backend.score, eos_token_ids(models.policy, models.tokenizer), device=models.policy.device,
            with_logprobs=config.use_vllm,
        )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        config: GRPOConfig,
        environment: ToolEnvironment,
        sample: Continue,
        run: RunAsync,
        eos_ids: Sequence[int],
        *,
        device: torch.device | str = "cpu",
        with_logprobs: bool = False,
    ) -> None:
        """`sample` continues sequences through the backend; `run` runs the environment's coroutines on the
        backend's event loop; `with_logprobs`: another engine samples (vLLM), so its log-probs are kept."""
        self.tokenizer, self.config, self.environment = tokenizer, config, environment
        self.settings: MultiTurnSettings = environment.settings
        self.sample, self.run, self.eos_ids = sample, run, list(eos_ids)
        self.device, self.with_logprobs = torch.device(device), with_logprobs
        self.format: ToolFormat = tool_format(tokenizer.chat_template)  # NoToolFormat: the job fails at start
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0])
        self._tools: list[dict[Any, Any] | Callable[..., Any]] | None = None

    def generate(self, rows: list[PromptRow], seeds: list[int]) -> tuple[Rollout, list[str]]:
        """G episodes per row; returns the rollout and each row's rendered prompt (for reward sources)."""
        group = self.config.num_generations
        members: list[_Member] = []
        prompts: list[str] | None = None
        width = max(1, self.environment.max_sessions)
        for start in range(0, len(rows) * group, width):
            wave = list(range(start, min(start + width, len(rows) * group)))
            opened = self._open(rows, wave)
            if prompts is None:  # the first open session told the tools, which the prompt lists
                prompts = [self._render(row) for row in rows]
            wave_members = self._members(prompts, seeds, wave)
            for member, (session, error) in zip(wave_members, opened, strict=True):
                member.session, member.error = session, error
                member.done = session is None
            self._turns(wave_members)
            self._finish(wave_members)
            members.extend(wave_members)
        assert prompts is not None  # rows is not empty
        failed = [m.error for m in members if m.error is not None]
        if failed and self.environment.report is not None:
            self.environment.report(failed)
        return self._rollout(members, prompts), prompts

    # --- episodes ---------------------------------------------------------------------------------

    def _open(self, rows: list[PromptRow], wave: list[int]) -> list[tuple[ToolSession | None, str | None]]:
        """Open the wave's episodes (reset with each row's fields); then read the tools once per run (a run whose
        first waves cannot tell them renders its prompts without tools until one can)."""
        group = self.config.num_generations

        async def one(index: int) -> tuple[ToolSession | None, str | None, BaseException | None]:
            try:
                return await self.environment.open(rows[index // group].extras), None, None
            except EpisodeError as exc:
                return None, str(exc), exc

        async def all_of() -> list[tuple[ToolSession | None, str | None, BaseException | None]]:
            return list(await asyncio.gather(*(one(i) for i in wave)))

        opened = self.run(all_of()).result()
        if all(session is None for session, _, _ in opened):
            unavailable = [exc for _, _, exc in opened if isinstance(exc, EnvironmentBusy | EnvironmentDown)]
            if len(unavailable) == len(opened):
                raise EnvironmentOutage(self.environment.name, str(unavailable[0]))
        results = [(session, error) for session, error, _ in opened]
        for index, (session, _) in enumerate(results):
            if self._tools is not None or session is None:
                continue
            try:  # an episode that cannot list its tools fails alone; the next open one is asked
                self._tools = list(self.run(self.environment.tools(session)).result())
            except EpisodeError as exc:
                self.run(session.close()).result()
                results[index] = (None, str(exc))
        return results

    def _render(self, row: PromptRow) -> str:
        messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
        rendered = self.tokenizer.apply_chat_template(
            messages, tools=self._tools or None, tokenize=False, add_generation_prompt=True
        )
        if not isinstance(rendered, str):
            raise TypeError(f"chat template rendered {type(rendered).__name__}, expected str")
        return rendered

    def _members(self, prompts: list[str], seeds: list[int], wave: list[int]) -> list[_Member]:
        group = self.config.num_generations
        ids, mask = tokenize_prompts(self.tokenizer, prompts, self.config.max_prompt_length)
        prompt_ids = [row[keep.bool()].tolist() for row, keep in zip(ids, mask, strict=True)]
        return [
            _Member(prompt_ids[i // group], (seeds[i // group] + (i % group) * 1_000_003) % 2**63) for i in wave
        ]

    # --- the turn loop ----------------------------------------------------------------------------

    def _turns(self, members: list[_Member]) -> None:
        budget = self.config.max_completion_length
        for turn in range(self.settings.max_turns):
            active = [m for m in members if not m.done and len(m.ids) < budget]
            if not active:
                return
            samples = self.sample(
                [m.prompt_ids + m.ids for m in active],
                [budget - len(m.ids) for m in active],
                [(m.seed + turn * 7_919) % 2**63 for m in active],
            )
            calling: list[tuple[_Member, ParsedTurn]] = []
            for member, (ids, logps) in zip(active, samples, strict=True):
                parsed = self._take_turn(member, ids, logps)
                if parsed is None or turn == self.settings.max_turns - 1 or member.session is None:
                    member.done = True
                else:
                    calling.append((member, parsed))
            if calling:
                self.run(self._call_tools(calling)).result()

    def _take_turn(self, member: _Member, ids: list[int], logps: list[float] | None) -> ParsedTurn | None:
        """Append a sampled turn; its tool calls, or None when it ends the episode (an answer, or out of budget)."""
        member.ids += ids
        member.sampled += [1] * len(ids)
        member.logps += logps if logps is not None else [0.0] * len(ids)
        ended = bool(ids) and ids[-1] in self.eos_ids
        parsed = parse_turn(str(self.tokenizer.decode(ids, skip_special_tokens=False)), self.format)
        member.turns.append({
            "role": "assistant",
            "text": str(self.tokenizer.decode(ids, skip_special_tokens=True)),
            "tokens": len(ids),
            "masked": False,
            "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in parsed.calls],
        })
        if not ended:
            member.truncated = True
            return None
        return parsed if parsed.wants_tools else None

    async def _call_tools(self, calling: list[tuple[_Member, ParsedTurn]]) -> None:
        await asyncio.gather(*(self._member_calls(member, parsed) for member, parsed in calling))

    async def _member_calls(self, member: _Member, parsed: ParsedTurn) -> None:
        """Run one member's calls in order and append their results as one suffix of tool messages."""
        assert member.session is not None
        results: list[tuple[str, ToolResult]] = [("unparsed", ToolResult(f"error: {e}", error=e)) for e in parsed.errors]
        try:
            for call in parsed.calls:
                results.append((call.name, await member.session.call(call)))
        except EpisodeError as exc:
            member.error, member.done = str(exc), True
            return
        member.step_rewards += [result.reward for _, result in results if result.reward is not None]
        done = any(result.done for _, result in results)
        suffix = self._suffix(parsed.calls[0] if parsed.calls else ToolCall("unparsed"), results)
        fits = len(member.ids) + len(suffix) < self.config.max_completion_length
        appended = fits and not done
        for name, result in results:
            member.turns.append({
                "role": "tool", "name": name, "text": result.text, "error": result.error, "reward": result.reward,
                "masked": True, "tokens": 0,
            })
        if appended:
            member.turns[-1]["tokens"] = len(suffix)  # the suffix holds every result of the turn
            member.ids += suffix
            member.sampled += [0] * len(suffix)
            member.logps += [0.0] * len(suffix)
        member.done = not appended

    def _suffix(self, call: ToolCall, results: list[tuple[str, ToolResult]]) -> list[int]:
        """The tokens of the tool messages after an assistant turn that ended with EOS: a stand-in conversation
        rendered with and without them; what follows its last EOS is the suffix (generation prompt included)."""
        stand_in: list[dict[str, Any]] = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [call.as_message_call()]},
        ]
        messages = [{"role": "tool", "name": name, "content": result.text} for name, result in results]
        prefix = self._template_ids(stand_in, generation_prompt=False)
        full = self._template_ids(stand_in + messages, generation_prompt=True)
        ends = [i for i, token in enumerate(prefix) if token in self.eos_ids]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template renders tool messages by changing the turns before them")
        return full[len(prefix):]

    def _template_ids(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=self._tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )
        return list(self.tokenizer(str(text), add_special_tokens=False)["input_ids"])

    def _finish(self, members: list[_Member]) -> None:
        """Close the wave's sessions and settle each member's environment reward."""

        async def close_all() -> None:
            await asyncio.gather(*(m.session.close() for m in members if m.session is not None))

        self.run(close_all()).result()
        for member in members:
            if member.error is not None:
                continue  # no environment reward: that source abstains for this member
            final = member.session.final_reward() if member.session is not None else None
            if final is not None:
                member.env_reward = final
            elif member.step_rewards:
                rewards = member.step_rewards
                member.env_reward = rewards[-1] if self.settings.reward_mode == "final" else sum(rewards)
            else:
                member.env_reward = 0.0  # an episode that ended without a reward earned nothing

    # --- the batch the loss sees ------------------------------------------------------------------

    def _rollout(self, members: list[_Member], prompts: list[str]) -> Rollout:
        group = self.config.num_generations
        prompt_ids, prompt_mask = tokenize_prompts(self.tokenizer, prompts, self.config.max_prompt_length)
        width = max(1, max(len(m.ids) for m in members))
        completion_ids = torch.full((len(members), width), self.pad_id, dtype=torch.long)
        completion_mask = torch.zeros((len(members), width), dtype=torch.long)
        tool_mask = torch.zeros((len(members), width), dtype=torch.long)
        logps = torch.zeros((len(members), width), dtype=torch.float32)
        for row, member in enumerate(members):
            length = len(member.ids)
            completion_ids[row, :length] = torch.tensor(member.ids, dtype=torch.long)
            completion_mask[row, :length] = 1
            tool_mask[row, :length] = torch.tensor(member.sampled, dtype=torch.long)
            logps[row, :length] = torch.tensor(member.logps, dtype=torch.float32)
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(group, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(group, dim=0),
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            is_truncated=torch.tensor([m.truncated for m in members]),
            completion_texts=[str(self.tokenizer.decode(m.ids, skip_special_tokens=True)) for m in members],
            group_size=group,
            sampler_logps=logps if self.with_logprobs else None,
            tool_mask=tool_mask,
            episodes=[m.record(self.settings.reward_mode) for m in members],
        ).to(self.device)
