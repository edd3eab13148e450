"""Resume: 4 steps in one run == 2 steps, checkpoint, resume in a fresh process, 2 more steps."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.preloaded import Preloaded
from tests.engine.trainer_helpers import small_config, spread_reward, word_rows
from worker.grpo.checkpoint import CheckpointCorrupt
from worker.grpo.trainer import GRPOTrainer

REPO_ROOT = Path(__file__).resolve().parents[2]

# Everything that carries state across steps: linear decay, KL reference, mu = 2 with mini-batches.
SETTINGS: dict[str, dict[str, Any]] = {
    "full": {
        "max_steps": 4,
        "checkpoint_every": 2,
        "save_total_limit": None,
        "beta": 0.04,
        "num_iterations": 2,
        "mini_batch_size": 4,
        "lr_scheduler": "linear",
        "warmup_steps": 1,
    },
    "lora": {
        "max_steps": 4,
        "checkpoint_every": 2,
        "save_total_limit": None,
        "beta": 0.04,
        "lora": {"r": 4, "alpha": 8},
        "lr_scheduler": "cosine",
    },
    # Asynchronous generation at max_staleness 0: the batch in flight at the stop is dropped and sampled again
    # from the checkpoint's prompt cursor and weights.
    "async": {
        "max_steps": 4,
        "checkpoint_every": 2,
        "save_total_limit": None,
        "beta": 0.04,
        "lr_scheduler": "linear",
        "async_generation": True,
        "max_staleness": 0,
    },
}

# Run in a fresh process: resume from argv[1] into argv[2] with the settings in argv[3].
RESUME_SCRIPT = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(int(sys.argv[5]))  # the parent's: two or more threads train the halves side by side
from tests.engine.trainer_helpers import small_config, spread_reward, word_rows
from worker.grpo.trainer import GRPOTrainer
checkpoint, output, settings, models = sys.argv[1:5]
result = GRPOTrainer(small_config(**json.loads(settings)), base_model="builtin:tiny", train_rows=word_rows(),
                     reward=spread_reward(), output_dir=Path(output), model_cache_dir=Path(models),
                     resume_from=Path(checkpoint)).train()
print(json.dumps({"step": result.step, "history": result.history}))
"""


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    name = (
        "adapter_model.safetensors"
        if (checkpoint / "adapter_model.safetensors").exists()
        else "model.safetensors"
    )
    return load_file(checkpoint / name)


def _comparable(metrics: dict[str, float]) -> dict[str, float]:
    """Timings differ between runs by nature (and with them how busy each thread was and how many batches
    waited); everything else must match."""
    timing = {"tokens_per_s", "async/producer_busy", "async/trainer_busy", "async/queue_depth"}
    return {k: v for k, v in metrics.items() if not k.startswith("time/") and k not in timing}


@pytest.fixture(scope="module")
def engine() -> Iterator[Preloaded]:
    """The fresh processes: forked from one that imported the engine once (and ran nothing), instead of each
    importing it again."""
    with Preloaded(["worker.grpo.trainer", "tests.engine.trainer_helpers"],
                   {**os.environ, "PYTHONPATH": str(REPO_ROOT)}) as python:
        yield python


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "lora", "async"])
def test_resume_in_a_fresh_process_continues_exactly(
    tmp_path: Path, tiny_model_dir: Path, engine: Preloaded, kind: str
) -> None:
    models = tiny_model_dir.parent
    settings = SETTINGS[kind]
    common: dict[str, Any] = {
        "base_model": "builtin:tiny",
        "train_rows": word_rows(),
        "reward": spread_reward(),
        "model_cache_dir": models,
    }

    straight = GRPOTrainer(small_config(**settings), output_dir=tmp_path / "straight", **common).train()

    polls = iter([False, False, True])
    first_half = GRPOTrainer(
        small_config(**settings), output_dir=tmp_path / "split", should_stop=lambda: next(polls), **common
    ).train()
    assert first_half.stopped and first_half.step == 2

    completed = engine.run(
        RESUME_SCRIPT,
        [
            str(first_half.last_checkpoint),
            str(tmp_path / "split"),
            json.dumps(settings),
            str(models),
            str(torch.get_num_threads()),  # the same layout of work as the runs here
        ],
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    resumed = json.loads(completed.stdout.strip().splitlines()[-1])
    assert resumed["step"] == 4

    expected, got = (
        _weights(tmp_path / "straight" / "checkpoint-4"),
        _weights(tmp_path / "split" / "checkpoint-4"),
    )
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=0, msg=name)
    assert [_comparable(m) for m in resumed["history"]] == [_comparable(m) for m in straight.history]


def test_resume_refuses_a_checkpoint_with_a_flipped_byte(tmp_path: Path, tiny_model_dir: Path) -> None:
    common: dict[str, Any] = {
        "base_model": "builtin:tiny",
        "train_rows": word_rows(),
        "reward": spread_reward(),
        "model_cache_dir": tiny_model_dir.parent,
        "output_dir": tmp_path / "run",
    }
    result = GRPOTrainer(small_config(max_steps=1), **common).train()
    assert result.last_checkpoint is not None
    weights = result.last_checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x10
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="model.safetensors does not match its sha256"):
        GRPOTrainer(small_config(max_steps=2), resume_from=result.last_checkpoint, **common)
