"""`grpo train --config job.yaml`: clear errors on bad input, and the example run learns end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.trainer_helpers import shared_model_cache
from worker.grpo import local
from worker.grpo.checkpoint import latest_checkpoint, load_checkpoint, verify_manifest
from worker.grpo.local import EXIT_BAD_INPUT, EXIT_OK, load_local_job, run_local
from worker.grpo.tool_tasks import split

REPO_ROOT = Path(__file__).resolve().parents[2]
GRPO = Path(sys.executable).parent / "grpo"  # the console script of the same virtualenv

VALID_SPEC = """
base_model: builtin:tiny
train_dataset: train.jsonl
rewards:
  - {type: builtin, name: regex_match, params: {pattern: "^a"}}
hyperparameters: {max_steps: 2, num_generations: 2, prompts_per_step: 1, max_completion_length: 2}
"""


def _job(tmp_path: Path, spec: str, rows: list[str] | None = None) -> Path:
    (tmp_path / "train.jsonl").write_text("\n".join(rows or ['{"prompt": "hi"}']) + "\n", encoding="utf-8")
    path = tmp_path / "job.yaml"
    path.write_text(spec, encoding="utf-8")
    return path


class TestBadInput:
    def test_valid_spec_paths_are_relative_to_the_yaml_file(self, tmp_path: Path) -> None:
        job = load_local_job(_job(tmp_path, VALID_SPEC + "output_dir: out\n"), None)
        assert job.output_dir == tmp_path / "out"
        assert [row.prompt for row in job.train_rows] == ["hi"]
        assert load_local_job(tmp_path / "job.yaml", tmp_path / "cli").output_dir == tmp_path / "cli"

    @pytest.mark.parametrize(
        ("spec", "rows", "message"),
        [
            ("base_model: [unclosed", None, "not valid YAML"),
            ("- a list", None, "must hold a mapping"),
            (VALID_SPEC.replace("max_steps: 2", "max_steps: -1"), None, "hyperparameters.max_steps"),
            (VALID_SPEC.replace("builtin:tiny", "builtin:huge"), None, "unknown builtin model"),
            (VALID_SPEC + "surprise: 1\n", None, "surprise"),
            (
                VALID_SPEC,
                ['{"prompt": "ok"}', '{"question": "no prompt"}'],
                "line 2: missing required column",
            ),
            (VALID_SPEC.replace("train.jsonl", "missing.jsonl"), None, "cannot read file"),
        ],
    )
    def test_bad_input_exits_2_naming_the_problem(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        spec: str,
        rows: list[str] | None,
        message: str,
    ) -> None:
        assert run_local(_job(tmp_path, spec, rows), tmp_path / "out") == EXIT_BAD_INPUT
        assert message in capsys.readouterr().out
        assert not (tmp_path / "out").exists()

    def test_cli_exit_code_and_message(self, tmp_path: Path) -> None:
        path = _job(tmp_path, VALID_SPEC, ['{"prompt": ""}'])
        completed = subprocess.run(
            [str(GRPO), "train", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert completed.returncode == 2, completed.stdout + completed.stderr
        assert "line 1: 'prompt' is an empty string" in completed.stdout


@pytest.mark.slow
def test_example_tiny_yaml_trains_and_reward_rises(tmp_path: Path) -> None:
    # A copy of examples/ so the run cannot write into the checkout.
    examples = tmp_path / "examples"
    shutil.copytree(REPO_ROOT / "examples", examples, ignore=shutil.ignore_patterns("__pycache__"))
    output = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [str(GRPO), "train", "--config", str(examples / "tiny.yaml"), "--output-dir", str(output)],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
        env=env,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "GRPO run summary" in completed.stdout

    checkpoint = latest_checkpoint(output)
    assert checkpoint is not None and checkpoint.name == "checkpoint-30"
    verify_manifest(checkpoint)
    rewards = [m["reward/mean"] for m in load_checkpoint(checkpoint).trainer_state["history"]]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(json.dumps({"first5": first, "last5": last}))
    assert last > first + 0.3, rewards


TOOLS_SPEC = """
base_model: builtin:tiny-tools
train_dataset: train.jsonl
environment: {environment_id: "examples.environments.arithmetic:Arithmetic", max_turns: 3}
rewards: [{type: environment}]
hyperparameters: {max_steps: 1, num_generations: 2, prompts_per_step: 2, max_completion_length: 160,
                  log_completions_every: 1, log_completions_count: 4}
"""


@pytest.mark.slow
def test_a_local_environment_class_runs_the_multi_turn_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # examples.environments.arithmetic is found from the working directory
    monkeypatch.setenv("GRPO_MODEL_CACHE_DIR", str(shared_model_cache()))
    rows = [json.dumps(item.row()) for item in split()[0][:2]]
    assert run_local(_job(tmp_path, TOOLS_SPEC, rows), tmp_path / "out") == EXIT_OK
    assert (tmp_path / "out" / "checkpoint-1").is_dir()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("examples.environments.arithmetic:Arithmetic", "examples.environments.arithmetic:Nope"),
         "environment.environment_id: 'examples.environments.arithmetic:Nope': examples.environments.arithmetic has "
         "no class Nope"),
        (("builtin:tiny-tools", "builtin:tiny"), "no tool-call format"),
    ],
)
def test_a_bad_local_environment_or_a_model_without_tools_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], change: tuple[str, str],
    message: str,
) -> None:
    monkeypatch.chdir(REPO_ROOT)
    spec = TOOLS_SPEC.replace(*change)
    assert run_local(_job(tmp_path, spec, [json.dumps(split()[0][0].row())]), tmp_path / "out") == EXIT_BAD_INPUT
    assert message in capsys.readouterr().out.replace("\n", "")


def test_the_parent_imports_no_torch_and_the_rank_module_imports_the_engine() -> None:
    """The parent of a multi-device `grpo train` only launches its ranks: importing torch there would cost every
    run seconds of CPU for nothing. The ranks' module imports the engine at the top, so that their launcher
    (worker.grpo.rank_fork) loads it once for all of them instead of each rank loading it after the fork."""
    code = (
        "import importlib, sys, worker.grpo.local as local; print(sorted({'torch', 'transformers'} & set(sys.modules)));"
        " importlib.import_module(local.RANK_MODULE); print('worker.grpo.trainer' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["[]", "True"]


def test_a_multi_device_run_launches_the_rank_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[tuple[str, list[str], int]] = []

    def run_ranks(module: str, args: list[str], *, nproc_per_node: int, run_id: str) -> int:
        launched.append((module, list(args), nproc_per_node))
        return 0

    monkeypatch.setattr(local, "run_ranks", run_ranks)
    spec = VALID_SPEC.replace("prompts_per_step: 1", "prompts_per_step: 2") + "resources: {devices: 2}\n"
    config = _job(tmp_path, spec)
    assert run_local(config, tmp_path / "out") == 0
    assert launched == [(local.RANK_MODULE, [str(config), str(tmp_path / "out")], 2)]
