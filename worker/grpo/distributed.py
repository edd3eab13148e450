"""One job on several devices: the torch.distributed plumbing the trainer calls (docs/distributed.md).

Every rank runs the same GRPOTrainer loop in lockstep. What differs from one process:

- data: all ranks draw the same global prompts (same sampler, same seed) and each generates and scores
  its contiguous share of whole groups; a group's sampling is seeded by its global position, so the
  same group samples the same tokens on 1 or N ranks (`group_seeds`);
- gradients: the loss is normalised by global counts (token-level losses divide by the step's tokens
  over all ranks, times the world size because gradients are averaged), so the averaged gradient is
  the one a single process computes for the whole batch;
- `ddp`: every rank holds the whole model and optimiser. Through the module forward (the `hf` backend),
  `DistributedDataParallel` wraps the log-prob forward (`LogprobModule`) and averages the gradients in
  its backward hooks, bucket by bucket while the backward runs, on the last mini-batch of each update
  (`no_sync` before). The `fused` backend computes through the weights directly, where no module forward
  exists for DDP's hooks to see: after the backward passes of an update one all-reduce per bucket of
  gradients averages them (`_average_gradients`);
- `fsdp`: the policy itself is sharded with FSDP2 (`fully_shard`, worker.grpo.sharded), through the module
  forward only (the `hf` backend): every decoder layer is a unit of its own, gathered for its forward and
  backward and freed after, then the root; parameters, gradients and AdamW state are sharded. Generation,
  log-probs with and without gradient, evaluation and the reference model (sharded the same way; LoRA's is
  the policy with its adapters off) all run through the sharded module, so every forward is a collective:
  every rank runs the same forwards in the same order (decoding continues until every rank's rows are
  finished, evaluation generates on every rank). The consolidated checkpoint is written from the shards a
  decoder layer at a time (worker.grpo.consolidated); with use_vllm each rank generates with an engine of its
  own, fed the same way after every step (worker.grpo.vllm_rollout);
- metrics: the step's batch is gathered so that the reported metrics are those of the global batch;
  rank 0's metrics dict is broadcast so every rank takes the same health decisions;
- control: only rank 0 talks to the outside world (hooks, scoring the evaluation); its stop decision is
  broadcast.

A collective that waits longer than the process group's timeout raises on the ranks still alive: a
dead or hung rank ends the attempt in bounded time (the launcher then stops the others).

The sharded policy of `fsdp` and its state dicts' names are in worker.grpo.sharded; the global batch for the
metrics in worker.grpo.global_batch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from worker.grpo.batch import StepBatch
from worker.grpo.consolidated import write_consolidated
from worker.grpo.full_weights import gathered_layer
from worker.grpo.global_batch import gather_batch
from worker.grpo.logprobs import completion_logprobs
from worker.grpo.loss import STEP_TOKEN_LOSSES
from worker.grpo.modeling import ModelBundle
from worker.grpo.sharded import (
    ShardedPolicy,
    keyed_by_name,
    keyed_by_position,
    meta_copy,
    policy_name,
    renamed,
    sharded_name,
)
from worker.grpo.wire import all_gather_values, broadcast_value

T = TypeVar("T")
# Optimisation stats (worker.grpo.loss) that are means over the loss tokens: merged weighted by each
# rank's tokens. `*_min` / `*_max` take the extreme over ranks; the rest are per-sequence means of equal
# shares or the same on every rank (learning rate, gradient norm): a plain mean.
TOKEN_MEAN_STATS = frozenset(
    {"kl", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region", "cispo_clip_ratio", "entropy_mask/kept_fraction"}
)
SHARDED_DIR = "distributed"
DEFAULT_TIMEOUT_S = 600.0
# Gradients are averaged in buckets of this many elements (one all-reduce each).
_BUCKET_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in the job. One process: rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str | None = None  # this rank's device; None = the trainer's default (one process)
    node: int = 0  # this rank's node (torchrun's GROUP_RANK)
    local_world_size: int = 1  # ranks on this node

    @property
    def one_node(self) -> bool:
        """Every rank runs on this machine (and so shares its filesystem)."""
        return self.local_world_size == self.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S, *, cpu: bool = False) -> Ranks:
    """Join the process group the launcher (worker.grpo.launch) describes in the environment: NCCL
    with one GPU per rank (LOCAL_RANK), gloo on CPU (`cpu`, or no GPU). The group meets in node 0's
    store, under the attempt's run id; every rank waits there for the whole world for at most
    GRPO_JOIN_TIMEOUT_S (a node that never arrives ends the attempt). `timeout_s` bounds every
    collective: a rank that died or hangs makes the others raise after it. Without a launcher
    (WORLD_SIZE unset or 1): one process, no group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    node, local_world_size = int(os.environ.get("GROUP_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size == 1:
        return Ranks()
    if torch.cuda.is_available() and not cpu:
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", f"cuda:{local_rank}"
    else:
        backend, device = "gloo", "cpu"
    if not dist.is_initialized():
        store = _join_store(world_size, float(os.environ.get("GRPO_JOIN_TIMEOUT_S", timeout_s)), timeout_s)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
    return Ranks(rank, world_size, local_rank, device, node, local_world_size)


def _join_store(world_size: int, join_timeout_s: float, timeout_s: float) -> dist.Store:
    """The job's store, as a client (node 0's launcher serves it), under the attempt's run id; returns
    once every rank of the world has arrived."""
    client = dist.TCPStore(
        os.environ["GRPO_STORE_HOST"], int(os.environ["GRPO_STORE_PORT"]), None, False,
        timedelta(seconds=join_timeout_s),
    )
    store = dist.PrefixStore(f"grpo/{os.environ['GRPO_RUN_ID']}/", client)
    store.add("arrived", 1)
    deadline = time.monotonic() + join_timeout_s
    while store.add("arrived", 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank of {world_size} joined within {join_timeout_s:.0f} s")
        time.sleep(0.1)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def device_for(ranks: Ranks) -> str | None:
    """This rank's device, or None (the trainer's default) for one process."""
    return ranks.device


@contextmanager
def main_first(ranks: Ranks) -> Iterator[None]:
    """Rank 0 runs the block first (e.g. builds a model into a shared cache), the others after it."""
    if ranks.distributed and not ranks.is_main:
        dist.barrier()
    yield
    if ranks.distributed and ranks.is_main:
        dist.barrier()


def wait_for_nodes(ranks: Ranks) -> None:
    """Across nodes, every rank waits here for the others (e.g. until each node has its own copy of a
    file rank 0 downloaded); on one node, nothing."""
    if ranks.distributed and not ranks.one_node:
        dist.barrier()


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` comes from a collective whose peer died or did not answer in time (gloo raises plain
    RuntimeErrors naming its sources; NCCL and the c10d store raise torch.distributed.DistError)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("gloo" in text or "NCCL" in text or "ProcessGroup" in text)


def local_peer_pids(ranks: Ranks) -> list[int]:
    """The process ids of the other ranks of this node (a collective: call it on every rank)."""
    parts = all_gather_values([ranks.node, os.getpid()])
    return [pid for node, pid in parts if node == ranks.node and pid != os.getpid()]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def share(total: int, ranks: Ranks) -> range:
    """This rank's contiguous share of `total` global positions (groups); equal shares."""
    if total % ranks.world_size != 0:
        raise ValueError(f"{total} groups do not split equally over {ranks.world_size} ranks")
    size = total // ranks.world_size
    return range(ranks.rank * size, (ranks.rank + 1) * size)


def group_seeds(seed: int, step: int, round_index: int, positions: range) -> list[int]:
    """One sampling seed per group, from the run's seed, the step, the generation round and the
    group's global position: independent of how many ranks share the step."""
    return [(seed * 1_000_003 + step * 101 + round_index) * 4099 + p for p in positions]


class Parallel:
    """This rank's part in training: the module that trains, gradient averaging, agreement on metrics
    and decisions, sharded checkpoints. With one process every method is the identity."""

    def __init__(
        self,
        ranks: Ranks,
        mode: Literal["single", "ddp", "fsdp"],
        models: ModelBundle,
        train_model: Any,
        loss_type: str,
        ddp: torch.nn.parallel.DistributedDataParallel | None = None,
    ) -> None:
        self.ranks = ranks
        self.mode = mode
        self.models = models
        self.train_model = train_model  # the module whose parameters the optimiser updates
        self.ddp = ddp  # DistributedDataParallel over the log-prob forward (ddp through the module forward)
        # Token-level losses divide by the global token count; averaging over ranks divides again.
        self.loss_scale = float(ranks.world_size) if loss_type in STEP_TOKEN_LOSSES else 1.0
        self.skeleton: Any = None  # fsdp: the policy's structure on the meta device (its configs, for checkpoints)

    @classmethod
    def wrap(cls, models: ModelBundle, ranks: Ranks, parallelism: Literal["ddp", "fsdp"], loss_type: str) -> Parallel:
        """Prepare `models` for this rank (rebuilding the optimiser and scheduler over the shards with fsdp).
        The library wrappers go over the module forward unless the backend's fast path computes instead
        (`models.fast`, set by the backend choice before)."""
        if not ranks.distributed:
            return cls(ranks, "single", models, models.policy, loss_type)
        _broadcast_from_main(models.policy)  # identical starting weights, whatever each rank loaded
        module_forward = models.fast is None
        if parallelism == "ddp":
            ddp = None
            if module_forward:
                device_ids = None if ranks.device in (None, "cpu") else [torch.device(ranks.device)]
                # No buffers to keep in step (a causal LM's are derived, e.g. RoPE's frequencies); broadcasting
                # them would make every forward a collective.
                ddp = torch.nn.parallel.DistributedDataParallel(
                    LogprobModule(models.policy), device_ids=device_ids, broadcast_buffers=False
                )
            return cls(ranks, "ddp", models, models.policy, loss_type, ddp)
        if not module_forward:
            raise ValueError("fsdp shards through the module forward (the hf backend), not the fused one")
        skeleton = meta_copy(models.policy)  # before sharding: the config and adapter config checkpoints save
        sharded = ShardedPolicy(models.policy)
        if models.reference is not None:
            models.reference = ShardedPolicy(models.reference)
        old = models.optimizer
        # One AdamW over the shards with the same settings; the per-tensor kernel (fused is not for DTensors).
        settings = {k: old.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
        models.optimizer = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], **settings)
        models.scheduler = torch.optim.lr_scheduler.LambdaLR(models.optimizer, models.scheduler.lr_lambdas[0])
        parallel = cls(ranks, "fsdp", models, sharded, loss_type)
        parallel.skeleton = skeleton
        return parallel

    def describe(self) -> str:
        """How this job's ranks share the work, as built (not as configured)."""
        world = f"{self.ranks.world_size} ranks"
        if self.mode == "ddp":
            how = "DistributedDataParallel over the module forward" if self.ddp is not None else (
                "gradients averaged after each update's backward passes (fused backend)"
            )
            return f"ddp over {world}: {how}"
        if self.mode == "fsdp":
            # FSDP2 is slow to import: only where fsdp runs (as ShardedPolicy); the policy's units.
            from torch.distributed.fsdp import FSDPModule

            units = sum(isinstance(module, FSDPModule) for module in self.train_model.modules())
            return f"fsdp over {world}: {units} FSDP unit{'s' if units != 1 else ''}"
        return "one process"

    # --- gradients and updates -----------------------------------------------------------------

    @property
    def local_forward(self) -> bool:
        """The training forward talks to no other rank, so this rank may run it at a moment of its own
        choosing. Not with fsdp (it all-gathers weights), nor through DistributedDataParallel, whose forward
        may sync bucket layouts with the other ranks."""
        return self.mode != "fsdp" and self.ddp is None

    def completion_logprobs(
        self, *args: Any, sync: bool = True, **kwargs: Any
    ) -> tuple[Tensor, Tensor | None]:
        """worker.grpo.logprobs.completion_logprobs of the training module (with gradient), on the backend's
        fast path where it has one (ModelBundle.fast). `sync`: this forward's backward ends an update, so
        DistributedDataParallel averages the gradients accumulated so far in it (else it defers)."""
        kwargs.setdefault("fast", self.models.fast)
        if isinstance(self.train_model, ShardedPolicy):
            return self.train_model.logprobs(*args, **kwargs)
        if self.ddp is not None and torch.is_grad_enabled():
            with nullcontext() if sync else self.ddp.no_sync():
                logps, entropy = self.ddp(*args, **kwargs)
            return logps, entropy
        return completion_logprobs(self.train_model, *args, **kwargs)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.train_model.parameters() if p.requires_grad]

    def clip_gradients(self, max_norm: float) -> float:
        """Average gradients over ranks (ddp; fsdp has reduce-scattered them), clip to the global
        norm; returns the pre-clip norm, the same on every rank."""
        params = self.trainable_parameters()
        if self.mode == "ddp" and self.ddp is None:  # DistributedDataParallel averaged them in the backward
            _average_gradients(params, self.ranks.world_size)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if self.mode == "fsdp":
            norm = norm.full_tensor()  # type: ignore[attr-defined]  # a DTensor from sharded gradients
        return float(norm)

    # --- forwards outside training ------------------------------------------------------------

    @property
    def forwards_together(self) -> bool:
        """Every forward of the policy is a collective (fsdp gathers each layer's weights for it): every rank
        runs the same forwards in the same order, evaluation included."""
        return self.mode == "fsdp"

    def run_policy(self, compute: Callable[[], T]) -> T:
        """`compute()`, which calls the policy's own forward without gradient (sampling, greedy decoding): with
        fsdp as a forward of the sharded root (worker.grpo.sharded), else as it is."""
        if isinstance(self.train_model, ShardedPolicy):
            return self.train_model.run(compute)
        return compute()

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (a collective): decoding continues while any rank's rows run."""
        if not self.ranks.distributed:
            return flag
        tensor = torch.tensor([int(flag)], device=self._device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    @property
    def lockstep(self) -> Callable[[bool], bool] | None:
        """What the decoding loops ask before stopping, when the forwards are collectives (`any_rank`)."""
        return self.any_rank if self.forwards_together else None

    @torch.no_grad()
    def reference_logps(
        self, input_ids: Tensor, attention_mask: Tensor, completion_length: int, *, temperature: float
    ) -> Tensor:
        """(N, C) log-probs under the reference policy (ModelBundle.reference_logps): with fsdp through the
        sharded reference, or the sharded policy with its LoRA adapters off."""
        if self.mode != "fsdp":
            return self.models.reference_logps(input_ids, attention_mask, completion_length, temperature=temperature)
        args = (input_ids, attention_mask, completion_length)
        if self.models.is_lora:
            with self.models.policy.disable_adapter():
                return self.train_model.logprobs(*args, temperature=temperature)[0]  # type: ignore[no-any-return]
        if not isinstance(self.models.reference, ShardedPolicy):
            raise RuntimeError("no reference model: beta == 0")
        return self.models.reference.logprobs(*args, temperature=temperature)[0]

    # --- agreement -----------------------------------------------------------------------------

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        if not self.ranks.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self._device())
        dist.all_reduce(tensor)
        return [float(v) for v in tensor.tolist()]

    def merge_stats(self, stats: dict[str, float], tokens: float) -> dict[str, float]:
        """The optimisation stats of the global batch from every rank's (`tokens`: its loss tokens)."""
        if not self.ranks.distributed:
            return stats
        parts = all_gather_values([stats, tokens])
        return merge_rank_stats([(part_stats, part_tokens) for part_stats, part_tokens in parts])

    def from_main(self, value: T) -> T:
        """Rank 0's `value` on every rank (a decision, or metrics everyone must agree on)."""
        if not self.ranks.distributed:
            return value
        return broadcast_value(value)  # type: ignore[no-any-return]

    def on_main(self, compute: Callable[[], T]) -> T:
        """`compute()` on rank 0 only (it talks to the outside world), its result on every rank."""
        value = compute() if self.ranks.is_main else None
        return self.from_main(value)  # type: ignore[return-value]  # rank 0 sent a T

    def gather_batch(self, batch: StepBatch) -> StepBatch:
        """The global batch (every rank's groups in rank order), for metrics and samples. Without
        futures or log-probs: only what the metrics read."""
        if not self.ranks.distributed:
            return batch
        return gather_batch(batch)

    # --- checkpoints ---------------------------------------------------------------------------

    @property
    def shards_on_disk(self) -> bool:
        """fsdp checkpoints keep the optimiser's shards as written by every rank, in rank 0's checkpoint
        directory: only when every rank shares this machine's filesystem. Across nodes the state is
        gathered into trainer_state.pt instead (rank 0's memory then holds all of it while saving)."""
        return self.mode == "fsdp" and self.ranks.one_node

    def save_consolidated(self, directory: Path) -> Path | None:
        """fsdp: the whole model written into `directory` from the shards, one decoder layer gathered at a time
        (worker.grpo.consolidated); a collective, returning `directory` on rank 0 and None on the others. None
        for other schemes, whose policy is whole (the checkpoint saves it)."""
        if self.mode != "fsdp":
            return None
        target = directory if self.ranks.is_main else None
        self.run_policy(
            lambda: write_consolidated(self.models, self.skeleton, target, gathered=gathered_layer)
        )  # the root's weights gathered around it
        return target

    def optimizer_state(self) -> dict[str, Any] | None:
        """The optimiser state for trainer_state.pt, or None when it is sharded (saved by `save_sharded`).
        A collective with fsdp across nodes: call it on every rank (the others get None)."""
        if self.mode != "fsdp":
            return self.models.optimizer.state_dict()
        if self.shards_on_disk:
            return None
        # torch.distributed.checkpoint is slow to import: only fsdp jobs import it, where they need it.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(
            self.train_model, self.models.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not self.ranks.is_main:
            return None
        # Keyed by position like a one-process optimizer.state_dict(), so any run reads it back.
        return keyed_by_position(renamed(full, policy_name), self.models.policy)

    def save_sharded(self, directory: Path) -> Path | None:
        """fsdp on one node: every rank writes its shards of model and optimiser under `directory`;
        None otherwise."""
        if not self.shards_on_disk:
            return None
        # Slow to import: only jobs that write sharded checkpoints import it (as in optimizer_state).
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.train_model, self.models.optimizer)
        # Saved under the policy's own names, so that a plain (unsharded) model loads them too.
        state = {"model": renamed(model_state, policy_name), "optim": renamed(optim_state, policy_name)}
        dcp.save(state, checkpoint_id=str(directory))
        dist.barrier()  # every shard is written before rank 0 moves the directory into the checkpoint
        return directory

    def load_optimizer(self, state: dict[str, Any] | None, checkpoint: Path) -> None:
        """Restore the optimiser from any checkpoint, whatever number of ranks or scheme wrote it."""
        sharded = checkpoint / SHARDED_DIR
        if sharded.is_dir():
            self._load_sharded(sharded)
        elif state is None:
            raise ValueError(f"checkpoint {checkpoint} holds no optimiser state")
        elif self.mode == "fsdp":  # a whole-model state keyed by position: re-key by name, then shard
            # Slow to import: only fsdp jobs import it (as in optimizer_state).
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            by_name = renamed(keyed_by_name(state, self.models.policy), sharded_name)
            set_optimizer_state_dict(
                self.train_model, self.models.optimizer, by_name, options=StateDictOptions(full_state_dict=True)
            )
        else:
            self.models.optimizer.load_state_dict(state)

    def _load_sharded(self, directory: Path) -> None:
        # Slow to import: only a resume from a sharded checkpoint imports it (as in optimizer_state).
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.train_model, self.models.optimizer)
        target = {"model": renamed(model_state, policy_name), "optim": renamed(optim_state, policy_name)}
        dcp.load(target, checkpoint_id=str(directory))  # in place, resharded to this run's ranks
        rename = sharded_name if self.mode == "fsdp" else policy_name
        set_state_dict(
            self.train_model, self.models.optimizer,
            model_state_dict=renamed(target["model"], rename), optim_state_dict=renamed(target["optim"], rename),
        )

    def _device(self) -> torch.device:
        return next(self.models.policy.parameters()).device


def merge_rank_stats(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Combine (stats, loss tokens) of each rank as TOKEN_MEAN_STATS says."""
    total_tokens = sum(tokens for _, tokens in parts)
    merged: dict[str, float] = {}
    for key in parts[0][0]:
        values = [stats[key] for stats, _ in parts]
        if key.endswith("_min"):
            merged[key] = min(values)
        elif key.endswith("_max"):
            merged[key] = max(values)
        elif key in TOKEN_MEAN_STATS and total_tokens > 0:
            merged[key] = sum(stats[key] * tokens for stats, tokens in parts) / total_tokens
        else:
            merged[key] = sum(values) / len(values)
    return merged


# --- DDP ---------------------------------------------------------------------------------------


class LogprobModule(torch.nn.Module):
    """The policy with `completion_logprobs` as its forward, for DistributedDataParallel: its hooks then see
    the forward whose outputs the loss is made of, the LM head included."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        return completion_logprobs(self.policy, *args, **kwargs)


@torch.no_grad()
def _broadcast_from_main(model: Any) -> None:
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


@torch.no_grad()
def _average_gradients(params: list[torch.nn.Parameter], world_size: int) -> None:
    """All-reduce the gradients as flat buckets of one dtype each, then divide by the world size."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    buckets: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    for grad in grads:
        per_kind = buckets.setdefault((grad.dtype, grad.device), [[]])
        if sum(t.numel() for t in per_kind[-1]) + grad.numel() > _BUCKET_ELEMENTS and per_kind[-1]:
            per_kind.append([])
        per_kind[-1].append(grad)
    for per_kind in buckets.values():
        for bucket in per_kind:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat)
            flat.div_(world_size)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
