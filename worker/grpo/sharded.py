"""FSDP2 in a distributed job (worker.grpo.distributed, `fsdp`): the policy sharded in place, and the names its
state dicts use (the policy's own, under the wrapper's `policy.` prefix), so that checkpoints hold the policy's
names whatever scheme wrote them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from worker.grpo.logprobs import completion_logprobs
from worker.grpo.module_options import decoder_layers

T = TypeVar("T")


class ShardedPolicy(torch.nn.Module):
    """A model (the policy, or the reference) sharded with FSDP2 in place: every decoder layer is a unit of its
    own, gathered only while it runs, and this wrapper is the root unit (embeddings, final norm, LM head). The
    model sits inside unchanged otherwise (its class is what selects the engine's paths). Every forward of it
    goes through this root, `completion_logprobs` or `run`, so that the root's parameters are gathered around
    it; a forward without gradient frees them after (one with gradient keeps them for its backward, which
    reduce-scatters the gradients). Its forwards are collectives: every rank runs the same ones in order."""

    def __init__(self, model: Any) -> None:
        # FSDP2 is slow to import: only the ranks of an fsdp job pay for it.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        super().__init__()
        self.policy = model
        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)
        register_fsdp_forward_method(self, "completion_logprobs")
        register_fsdp_forward_method(self, "_run")

    def completion_logprobs(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        logps, entropy = completion_logprobs(self.policy, *args, **kwargs)
        # Fresh tensors, not views: FSDP's backward hooks sit on the outputs (an in-place op on a view drops them).
        return logps.clone(), None if entropy is None else entropy.clone()

    def logprobs(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """`completion_logprobs`, the root freed after when no gradient is taken."""
        out = self.completion_logprobs(*args, **kwargs)
        if not torch.is_grad_enabled():
            self.reshard()  # type: ignore[operator]  # FSDPModule's, mixed in by fully_shard
        return out

    def run(self, compute: Callable[[], T]) -> T:
        """`compute()`, a computation without gradient that calls the model's own forward (sampling, greedy
        decoding), as a forward of the root: the root's parameters gathered around it and freed after, each
        layer's gathered by its own forward. The first forward through a ShardedPolicy must be one of its own
        (FSDP takes the first unit that runs as the root)."""
        with torch.no_grad():
            out = self._run(compute)
        self.reshard()  # type: ignore[operator]  # FSDPModule's, mixed in by fully_shard
        return out

    def _run(self, compute: Callable[[], T]) -> T:
        return compute()


def meta_copy(model: Any) -> Any:
    """`model`'s structure with every parameter and buffer on the meta device (no data): what a consolidated
    checkpoint saves its configs from (the model's, and peft's adapter config). Call it before sharding."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
            if isinstance(tensor, torch.nn.Parameter)
            else empty
        )
    return copy.deepcopy(model, memo)


_PREFIX = "policy."


def policy_name(name: str) -> str:
    """A ShardedPolicy parameter's name in the policy itself."""
    return name.removeprefix(_PREFIX)


def sharded_name(name: str) -> str:
    return _PREFIX + name


def renamed(state: dict[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    """A model state dict, or an optimiser state dict keyed by name (get_state_dict's forms), renamed."""
    if "param_groups" in state:
        return {
            "state": {rename(k): v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [rename(p) for p in g["params"]]} for g in state["param_groups"]],
        }
    return {rename(k): v for k, v in state.items()}


def keyed_by_name(state: dict[str, Any], model: Any) -> dict[str, Any]:
    """An optimizer.state_dict() over `model`'s trainable parameters, keyed by parameter name."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def keyed_by_position(state: dict[str, Any], model: Any) -> dict[str, Any]:
    """The inverse of `keyed_by_name`: an optimiser state keyed by parameter name, keyed by position."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    positions = {name: index for index, name in enumerate(names)}
    return {
        "state": {positions[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [positions[n] for n in group["params"]]} for group in state["param_groups"]],
    }
