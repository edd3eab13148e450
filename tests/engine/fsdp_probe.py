"""One rank of an fsdp job that watches its own memory (tests/engine/test_fsdp_sharding.py): `grpo train`'s
trainer, with hooks on the policy's decoder layers that count the layers whose weights are gathered whenever
one runs a forward (generation, log-probs with and without gradient, reference, evaluation), and a count of the
live tensors anywhere in the process that have a decoder weight's full shape and hold data (between steps, in a
training forward, and on rank 0 before each file of a consolidated checkpoint is written).

    python -m worker.grpo.launch ... -m tests.engine.fsdp_probe CONFIG OUTPUT RESULT_DIR

Each rank writes RESULT_DIR/rank-<r>.json."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from worker.grpo import consolidated
from worker.grpo.distributed import init_from_env, shutdown
from worker.grpo.local import load_local_job, model_cache_dir
from worker.grpo.module_options import decoder_layers
from worker.grpo.rewards import build_reward_sources
from worker.grpo.trainer import GRPOTrainer


def gathered(layer: torch.nn.Module) -> bool:
    """FSDP2 swaps a unit's sharded parameters (DTensors) for plain full tensors while it is gathered."""
    return any(not isinstance(p, DTensor) for p in layer.parameters())


def full_weight_copies(shape: torch.Size) -> int:
    """Live plain tensors of `shape` that hold data (FSDP keeps a freed gathered weight with no storage)."""
    count = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.shape == shape and not obj.is_meta:
            count += obj.untyped_storage().nbytes() > 0
    return count


def main(config: Path, output: Path, results: Path) -> None:
    ranks = init_from_env()
    job = load_local_job(config, output)
    found: dict[str, Any] = {"forwards": 0, "most_gathered": 0, "most_copies": 0, "checks": 0, "saving_checks": 0}
    trainer = GRPOTrainer(
        job.spec.hyperparameters, base_model=job.spec.base_model, train_rows=job.train_rows,
        eval_rows=job.eval_rows, reward=build_reward_sources(job.spec.rewards), output_dir=job.output_dir,
        model_cache_dir=model_cache_dir(), ranks=ranks, device="cpu",
    )
    layers = list(decoder_layers(trainer.models.policy))
    # The largest 2-D weight of a layer: every layer has one, so a full copy of the policy holds len(layers).
    # (A DTensor's shape is the full one.)
    shape = max((p.shape for p in layers[0].parameters() if p.dim() == 2), key=lambda s: s.numel())

    def check_copies() -> None:
        found["most_copies"] = max(found["most_copies"], full_weight_copies(shape))
        found["checks"] += 1

    def before_forward(layer: torch.nn.Module, _args: Any) -> None:
        found["forwards"] += 1
        found["most_gathered"] = max(found["most_gathered"], sum(gathered(other) for other in layers))
        if layer is layers[-1] and torch.is_grad_enabled() and found["checks"] < 3:
            check_copies()  # in the middle of a training forward too

    for layer in layers:
        layer.register_forward_pre_hook(before_forward)
    write_shard = consolidated.save_file

    def checked_write(*args: Any, **kwargs: Any) -> None:  # rank 0 writing the consolidated checkpoint
        found["saving_checks"] += 1
        check_copies()
        write_shard(*args, **kwargs)

    consolidated.save_file = checked_write
    trainer.on_metrics = lambda step, metrics, samples: check_copies()  # between steps (and after evaluations)
    trainer.train()
    check_copies()
    found["layers"] = len(layers)
    found["describe"] = trainer.parallel.describe()
    (results / f"rank-{ranks.rank}.json").write_text(json.dumps(found))
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
