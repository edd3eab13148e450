"""Values the ranks of a job exchange through collectives, without pickle.

`torch.distributed`'s object collectives (`broadcast_object_list`, `all_gather_object`) unpickle what a
peer sends: a process that joins the job's group, or writes into its store, would run code in every rank.
Here a value is serialised with `torch.save` and read back with `torch.load(weights_only=True)`, which
rebuilds tensors and plain containers (dict, list, tuple, str, int, float, bool, None) and refuses any
other global. Callers turn their dataclasses into such plain values and back (e.g. worker.grpo.distributed's
batch gathering). The bytes travel as uint8 tensors: a length first, then the payload.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist


def dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """A value `dumps` wrote; tensors and plain containers only (anything else raises UnpicklingError)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _device() -> torch.device:
    """NCCL moves only CUDA tensors; gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_value(value: Any, src: int = 0) -> Any:
    """Rank `src`'s `value` on every rank (a collective: every rank calls it; the others pass anything)."""
    device = _device()
    payload = dumps(value) if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    if dist.get_rank() == src:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src)
    return value if dist.get_rank() == src else loads(data.cpu().numpy().tobytes())


def all_gather_values(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a collective)."""
    device = _device()
    world = dist.get_world_size()
    payload = dumps(value)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    data = torch.zeros(longest, dtype=torch.uint8, device=device)
    data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(data) for _ in range(world)]
    dist.all_gather(parts, data)
    mine = dist.get_rank()
    return [
        value if rank == mine else loads(part[: int(sizes[rank].item())].cpu().numpy().tobytes())
        for rank, part in enumerate(parts)
    ]
