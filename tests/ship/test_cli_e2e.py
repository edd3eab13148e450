"""The `grpo` CLI, run as a user would (subprocesses, GRPO_API_URL/GRPO_API_KEY), drives a live
`grpo serve` through upload -> register -> create -> watch -> list -> download, and the checkpoint loads."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.openenv_servers import CALCULATOR, openenv_python
from tests.ship.conftest import (
    GRPO,
    PYTHON,
    Processes,
    clean_env,
    describe,
    free_port,
    run_cli,
    wait_http_ok,
)

pytestmark = pytest.mark.slow

LETTERS = "abcd"


def write_dataset(path: Path) -> Path:
    """'Repeat the letter' prompts with the `answer` column the example reward server scores against."""
    rows = [{"prompt": f"Repeat the letter {c}: ", "answer": c} for c in LETTERS * 2]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_spec(path: Path, dataset_id: str, reward_function_id: str) -> Path:
    spec = {
        "name": "cli-e2e",
        "base_model": "builtin:tiny",
        "train_dataset": dataset_id,
        "rewards": [{"type": "remote", "reward_function_id": reward_function_id, "weight": 1.0}],
        "hyperparameters": {
            "max_steps": 3,
            "num_generations": 4,
            "prompts_per_step": 2,
            "max_completion_length": 8,
            "checkpoint_every": 3,
            "log_completions_every": 3,
            "seed": 0,
        },
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def cli_json(env: dict[str, str], *args: str) -> object:
    done = run_cli(env, *args, "--json")
    assert done.returncode == 0, describe(done)
    return json.loads(done.stdout)


def test_cli_upload_register_create_watch_download(tmp_path: Path, processes: Processes) -> None:
    started = time.monotonic()
    api_port = free_port()
    env = clean_env(
        GRPO_ENV="development",
        GRPO_DATA_DIR=str(tmp_path / "data"),
        GRPO_API_PORT=str(api_port),
        GRPO_GRPC_PORT=str(free_port()),
    )
    api_url = f"http://127.0.0.1:{api_port}"

    # --- a live `grpo serve` (REST + gRPC + embedded worker on SQLite and the embedded broker)
    serve = processes.start("serve", [*GRPO, "serve", "--worker", "--migrate"], env)
    # The example OpenEnv environment, its own process, starting while the service does.
    env_port = free_port()
    calculator = processes.start("calculator", [openenv_python(), "-m", "uvicorn", CALCULATOR, "--host", "127.0.0.1",
                                                "--port", str(env_port)], env)
    wait_http_ok(f"{api_url}/readyz", serve, timeout=60)
    created = run_cli(env, "admin", "create-tenant", "ship-e2e")
    assert created.returncode == 0, describe(created)
    cli_env = {**env, "GRPO_API_URL": api_url, "GRPO_API_KEY": created.stdout.strip().splitlines()[-1]}

    stages = {"serve ready + tenant": time.monotonic() - started}

    # --- upload and register (independent: run side by side, each CLI start costs seconds on a busy machine),
    # then start the reward server with the secret shown once
    reward_port = free_port()
    with ThreadPoolExecutor(2) as pool:
        upload = pool.submit(
            cli_json, cli_env, "datasets", "upload", str(write_dataset(tmp_path / "letters.jsonl"))
        )
        register = pool.submit(
            cli_json, cli_env, "rewards", "register", "repeat-letter", f"http://127.0.0.1:{reward_port}/score"
        )
        dataset, reward = upload.result(), register.result()
    assert isinstance(dataset, dict) and dataset["num_rows"] == 2 * len(LETTERS), dataset
    assert isinstance(reward, dict) and reward["signing_secret"], reward
    server = processes.start(
        "reward_server",
        [PYTHON, "examples/reward_server.py", "--port", str(reward_port), "--task", "repeat_letter"],
        {**env, "GRPO_REWARD_SECRET": reward["signing_secret"]},
    )
    wait_http_ok(f"http://127.0.0.1:{reward_port}/healthz", server, timeout=30)
    stages["upload + register + reward server"] = time.monotonic() - started

    # --- an environment: registered (its /health and /schema read by the service), listed, checked again
    wait_http_ok(f"http://127.0.0.1:{env_port}/health", calculator, timeout=60)
    environment = cli_json(cli_env, "envs", "register", "calculator", f"http://127.0.0.1:{env_port}")
    assert isinstance(environment, dict) and environment["health"]["status"] == "healthy", environment
    assert environment["signing_secret"].startswith("whsec_") and "tool_name" in str(environment["schemas"])
    checked = cli_json(cli_env, "envs", "check", environment["id"])
    assert isinstance(checked, dict) and checked["health"]["checked_at"] >= environment["health"]["checked_at"]
    stages["environment"] = time.monotonic() - started

    # --- create -> watch (exit code is the job's outcome: 0 = succeeded)
    spec = write_spec(tmp_path / "spec.yaml", dataset["id"], reward["id"])
    job = cli_json(cli_env, "jobs", "create", "-f", str(spec))
    assert isinstance(job, dict) and job["status"] == "queued", job
    watched = run_cli(cli_env, "jobs", "watch", job["id"], timeout=150)
    assert watched.returncode == 0, describe(watched) + processes.logs()
    assert f"{job['id']}: succeeded" in watched.stdout, describe(watched)
    stages["create + watch"] = time.monotonic() - started

    # --- tables at 80 columns show whole ids; samples name the reward of each source (one here)
    narrow = {**cli_env, "COLUMNS": "80"}
    for args, ids in ((["datasets", "list"], [dataset["id"]]), (["jobs", "list"], [job["id"]])):
        listed = run_cli(narrow, *args)
        assert listed.returncode == 0, describe(listed)
        assert all(len(line) <= 80 for line in listed.stdout.splitlines()), describe(listed)
        assert all(i in listed.stdout for i in ids), describe(listed)
    samples = run_cli({**cli_env, "COLUMNS": "200"}, "jobs", "samples", job["id"])
    assert samples.returncode == 0 and f"remote:{reward['id']}=" in samples.stdout, describe(samples)

    # --- checkpoints list -> download, and the directory loads with transformers
    checkpoints = cli_json(cli_env, "checkpoints", "list", job["id"])
    assert isinstance(checkpoints, list) and [c["step"] for c in checkpoints] == [3], checkpoints
    out = tmp_path / "checkpoint"
    downloaded = run_cli(cli_env, "checkpoints", "download", checkpoints[0]["id"], "--out", str(out))
    assert downloaded.returncode == 0, describe(downloaded)
    assert Path(downloaded.stdout.strip()) == out and (out / "config.json").is_file(), describe(downloaded)

    # The remote reward really scored completions: the server saw signed requests (logged by uvicorn).
    assert "POST /score" in server.log(), server.log()

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0
    stages["list + download + load"] = time.monotonic() - started

    # --- evaluate the checkpoint on the dataset with the signed remote reward; compare it with itself
    eval_spec = tmp_path / "eval.yaml"
    eval_spec.write_text(yaml.safe_dump({
        "model": f"checkpoint:{checkpoints[0]['id']}", "dataset": dataset["id"], "samples_per_item": 2,
        "max_tokens": 4, "rewards": [{"type": "remote", "reward_function_id": reward["id"]}],
    }))
    evaluated = run_cli(cli_env, "evals", "create", "-f", str(eval_spec), "--wait", "--json", timeout=150)
    assert evaluated.returncode == 0, describe(evaluated) + processes.logs()
    evaluation = json.loads(evaluated.stdout)
    assert evaluation["status"] == "succeeded" and evaluation["results"]["items"] == 2 * len(LETTERS), evaluation
    assert evaluation["results"]["samples"] == 4 * len(LETTERS)
    items = cli_json(cli_env, "evals", "items", evaluation["id"])
    assert isinstance(items, list) and all(list(i["sources"][0]) == [f"remote:{reward['id']}"] for i in items)
    compared = cli_json(cli_env, "evals", "compare", evaluation["id"], evaluation["id"])
    assert isinstance(compared, dict) and compared["difference"] == 0, compared
    stages["evaluate + compare"] = time.monotonic() - started

    # --- delete: the finished job and its checkpoints are gone
    deleted = run_cli(cli_env, "jobs", "delete", job["id"])
    assert deleted.returncode == 0 and f"deleted {job['id']}" in deleted.stdout, describe(deleted)
    gone = run_cli(cli_env, "jobs", "get", job["id"])
    assert gone.returncode != 0, describe(gone)
    print("CLI end to end, seconds since start: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
