"""Under fsdp no rank ever holds the policy's weights whole: on 2 ranks (gloo, CPU) over a 6-layer model, with a
reference model (beta > 0), an evaluation and a checkpoint after each step, every forward of a decoder layer finds
at most two layers gathered (the one running, and the next that FSDP prefetches), and no full copy of the
decoder's weights lives anywhere in a rank's process, while training or while writing a consolidated checkpoint
(tests/engine/fsdp_probe.py watches from inside each rank)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

import yaml

from tests.engine.test_distributed import REPO_ROOT, SPEC, WORDS
from tests.engine.test_hf_architectures import build
from worker.grpo.launch import launch_command

LAYERS = 6


def test_no_rank_holds_the_whole_policy_outside_one_layers_gather(tmp_path: Path) -> None:
    model = build("phi3", tmp_path / "phi3", layers=LAYERS)  # the hf backend's module forward
    rows = "".join(json.dumps({"prompt": f"{w}: ", "answer": "a"}) + "\n" for w in WORDS)
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "eval.jsonl").write_text(rows)
    spec = json.loads(json.dumps(SPEC))
    spec.update(base_model=str(model), eval_dataset="eval.jsonl", resources={"devices": 2})
    spec["hyperparameters"].update(parallelism="fsdp", max_steps=2, eval_every=1, eval_samples=2)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(spec))
    results = tmp_path / "results"
    results.mkdir()
    command = launch_command(
        "tests.engine.fsdp_probe", [str(config), str(tmp_path / "out"), str(results)], nproc_per_node=2,
        run_id=secrets.token_hex(16),
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        found = json.loads((results / f"rank-{rank}.json").read_text())
        print(f"rank {rank}: {found}")
        assert found["describe"] == f"fsdp over 2 ranks: {LAYERS + 1} FSDP units"
        assert found["layers"] == LAYERS
        assert found["forwards"] > 100  # generation, log-probs, reference and evaluation all ran through the hooks
        assert 1 <= found["most_gathered"] <= 2
        assert found["checks"] >= 4
        assert found["most_copies"] < LAYERS  # a full copy of the decoder would hold LAYERS of them at least
        if rank == 0:  # it writes the checkpoints (after each step), one shard per unit
            assert found["saving_checks"] == 2 * (LAYERS + 1)
