"""The fused backend's schedule: ModuleBackend's phases over two CPU lanes (package docstring: why)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from functools import partial

import torch
from torch import Tensor

from worker.grpo.backends.fused import fast_decoder
from worker.grpo.backends.hf import Forwards, ModuleBackend
from worker.grpo.batch import HalfForward
from worker.grpo.concurrency import completed
from worker.grpo.rollout import Rollout


class FusedBackend(ModuleBackend):
    """ModuleBackend's phases, scheduled over two CPU lanes, on the fast path."""

    name = "fused"
    uses_side_lane = True

    def start_forwards(self, rollout: Rollout, timings: dict[str, float]) -> Forwards:
        """The reference log-probs (started on the side lane) and the old ones; where the backward runs in
        halves (`_halves`), the first pass's policy forward too, half by half beside the reference."""
        halves = self._halves(rollout)
        # Both halves run on one gathering of the policy's weights (a copy of every layer's), made
        # with every thread before the reference forward takes the side lane's core.
        net = None if halves is None else fast_decoder.DecoderFunctional(self.parallel.train_model)
        reference = self._start_reference(rollout)
        if halves is None:
            return Forwards(reference, self.old_logps(rollout, reference))
        started = time.perf_counter()
        parts = [
            HalfForward(rows, *self._policy_forward(rollout, rows, reference, 0, prepared=net)) for rows in halves
        ]
        logps = torch.cat([part.logps for part in parts])
        entropies = [part.entropy for part in parts if part.entropy is not None]
        entropy = torch.cat(entropies) if entropies else None
        rows = self.mini_batches(rollout.completion_ids.shape[0])[0]
        timings["time/train_s"] = time.perf_counter() - started
        return Forwards(reference, None, (rows, (logps, entropy)), parts)

    def _halves(self, rollout: Rollout) -> tuple[slice, slice] | None:
        """The rows split in two at a group boundary, when the first pass's backward runs as two halves side
        by side, each on one thread and core (`backward`): with a side lane (a CPU with two or more threads), a
        local forward on the fast path (no dropout: a half draws no random numbers), and one pass (mu = 1) over
        one mini-batch. Why: where a second thread speeds a small model's matmuls less than twofold, two
        one-thread backwards finish sooner than one over all rows on two threads (bench/README.md)."""
        total, length = rollout.completion_ids.shape[0], rollout.input_ids.shape[1]
        group = self.config.num_generations
        if (
            self.lanes.side is None
            or not self.parallel.local_forward
            or self.config.num_iterations != 1
            or len(self.mini_batches(total)) != 1
            or total // group < 2
            or not fast_decoder.supports(self.parallel.train_model, length)
        ):
            return None
        middle = total // group // 2 * group
        return slice(0, middle), slice(middle, total)

    def _start_reference(self, rollout: Rollout) -> Future[Tensor] | None:
        """Reference log-probs (N, C) when beta > 0. They need only the rollout, so with a side lane they run
        beside whatever comes next here (scoring, the old log-probs, the policy's forward). Not with a LoRA
        policy outside the fast path: its reference is the policy itself with the adapters switched off."""
        if self.config.beta == 0:
            return None
        compute = partial(self.reference_logps, rollout)
        if self.lanes.side is None or not self.models.reference_runs_beside_policy(rollout.input_ids.shape[1]):
            return completed(compute())
        return self.lanes.beside(compute)

    def backward(self, loss: Tensor, halves: list[HalfForward] | None) -> None:
        """`loss.backward()`, or for a forward run in halves (`start_forwards`): the loss's gradient with
        respect to each half's outputs here, then each half's backward to the weights on a lane of its own,
        the second on the side lane. Each half's gradients are its own tensors, added here in a fixed order:
        two backwards accumulating into the same .grad would add in the order they happen to finish, and the
        step would not be reproducible bit for bit."""
        if halves is None:
            loss.backward()
            return
        outputs = [part.outputs() for part in halves]
        flat = torch.autograd.grad(loss, [t for ts in outputs for t in ts], allow_unused=True)
        params = self.parallel.trainable_parameters()

        def gradients(index: int) -> tuple[Tensor | None, ...]:
            start = sum(len(ts) for ts in outputs[:index])
            pairs = [
                (t, g)
                for t, g in zip(outputs[index], flat[start : start + len(outputs[index])], strict=True)
                if g is not None
            ]
            if not pairs:
                return (None,) * len(params)
            return torch.autograd.grad([t for t, _ in pairs], params, [g for _, g in pairs], allow_unused=True)

        beside = self.lanes.beside(partial(gradients, 1))
        with self.lanes.own_core_while(beside):
            first = gradients(0)
        second = beside.result()
        with torch.no_grad():
            for param, a, b in zip(params, first, second, strict=True):
                grad = b if a is None else a if b is None else a.add_(b)
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
