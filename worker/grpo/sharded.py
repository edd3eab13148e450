"""FSDP2 in a distributed job (worker.grpo.distributed, `fsdp`): the sharded training copy of the policy,
and the names its state dicts use (the policy's own, under the copy's `policy.` prefix), so that checkpoints
hold the policy's names whatever scheme wrote them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from worker.grpo.logprobs import completion_logprobs
from worker.grpo.module_options import decoder_layers


class ShardedPolicy(torch.nn.Module):
    """The training copy of the policy sharded with FSDP2. The policy sits inside unchanged (its class
    is what selects the engine's fast path); `completion_logprobs` runs like a forward of the root unit
    and reduce-scatters the gradients in the backward pass. `per_layer` (the module forward): every
    decoder layer is a unit of its own, gathered only while it runs; else (the fused path, which reads
    every layer's weights in one function) the whole policy is one unit."""

    def __init__(self, policy: Any, *, per_layer: bool) -> None:
        # FSDP2 is slow to import: only the ranks of an fsdp job pay for it.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        super().__init__()
        self.policy = policy
        device = next(policy.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        if per_layer:
            for layer in decoder_layers(policy):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)
        register_fsdp_forward_method(self, "completion_logprobs")

    def completion_logprobs(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        logps, entropy = completion_logprobs(self.policy, *args, **kwargs)
        # Fresh tensors, not views: FSDP's backward hooks sit on the outputs (an in-place op on a view drops them).
        return logps.clone(), None if entropy is None else entropy.clone()


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
