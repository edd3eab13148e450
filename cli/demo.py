"""`grpo demo`: the whole product end to end on embedded defaults, in a few minutes on a laptop CPU.

Stages (each printed; any failure exits non-zero and everything started is stopped):
migrate + tenant/key -> `grpo serve` (REST + gRPC + embedded worker, SQLite, embedded broker, local storage)
-> example reward server (signature-verifying, exact match) -> upload train and held-out eval datasets ->
register the endpoint -> submit a job on `builtin:tiny-instruct` (one per seed with `--seeds N`) -> live
progress -> held-out accuracy before and after -> download the final checkpoint -> load it with from_pretrained
and answer held-out questions -> evaluate the checkpoint and the base model through the evaluations API and
compare them -> training-curve PNG (reward, KL, length, held-out eval).

The task is conditional ("Larger of 6 and 7?" -> "7") with an exact-match reward, so a rising reward means
the model answers the question asked. The model starts warm (supervised on synthetic tasks, partly right on
the held-out questions, which it never saw); GRPO sharpens what it can sometimes do into what it does.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Final

import httpx
import typer
from rich.console import Console

from cli.jobs import follow
from client.sdk import APIError, GRPOClient
from contract.api.datasets import DatasetOut
from contract.api.jobs import JobOut, MetricSeries

console = Console()
PYTHON = sys.executable
DEMO_TASK: Final = "larger"
DEMO_QUESTIONS_SHOWN = 6
DEMO_STEPS = 120
DEMO_LEARNING_RATE = 1e-3
DEMO_BETA = 0.0


def demo(
    out: Path = typer.Option(Path("demo-out"), "--out", help="Working directory (wiped first)."),
    model: str = typer.Option(
        "builtin:tiny-instruct", "--model", help="Base model: builtin:tiny-instruct, a Hugging Face id or a local path."
    ),
    steps: int = typer.Option(DEMO_STEPS, "--steps", help="Training steps."),
    seeds: int = typer.Option(1, "--seeds", min=1, max=10, help="Train once per seed (0, 1, ...), print each."),
) -> None:
    """Run the main job end to end on embedded defaults and print the outcome."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = _demo_env(out)
    with ExitStack() as stack:
        try:
            _run(stack, out.resolve(), env, model, steps, seeds)
        except (APIError, DemoFailed, httpx.HTTPError, subprocess.CalledProcessError) as exc:
            console.print(f"[red]demo failed:[/red] {exc}")
            raise typer.Exit(1) from None


class DemoFailed(Exception):
    pass


def _stage(text: str) -> None:
    console.rule(f"[bold cyan]{text}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _demo_env(out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    env.update(
        GRPO_DATA_DIR=str((out / "data").resolve()),
        GRPO_API_PORT=str(_free_port()),
        GRPO_GRPC_PORT=str(_free_port()),
        GRPO_ENV="development",
    )
    return env


def _grpo(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([PYTHON, "-m", "cli", *args], env=env, check=True, capture_output=True, text=True)
    return done.stdout.strip()


@contextmanager
def _process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as handle:
        process = subprocess.Popen(args, env=env, stdout=handle, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DemoFailed(f"process exited with {process.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise DemoFailed(f"{url} not ready after {timeout:.0f}s; see {log}")


def _wait_started(
    client: GRPOClient, job_id: str, serve: subprocess.Popen[bytes], log: Path, timeout: float = 180
) -> None:
    """Fail fast (instead of waiting forever) when no worker picks the job up."""
    deadline = time.monotonic() + timeout
    while client.get_job(job_id).status == "queued":
        if serve.poll() is not None or time.monotonic() > deadline:
            raise DemoFailed(f"no worker started {job_id} within {timeout:.0f}s; see {log}")
        time.sleep(0.5)


def write_demo_datasets(directory: Path) -> tuple[Path, Path]:
    """(train, held-out eval) JSONL of the demo task; the eval questions were never trained on, not even
    by the warm model's supervised training (worker.grpo.synthetic)."""
    from worker.grpo.synthetic import split  # the engine's package loads only when the demo runs (torch-free)

    train, held_out = split(DEMO_TASK)
    paths = directory / f"{DEMO_TASK}-train.jsonl", directory / f"{DEMO_TASK}-eval.jsonl"
    for path, items in zip(paths, (train, held_out), strict=True):
        path.write_text("".join(json.dumps(item.row()) + "\n" for item in items))
    return paths


def demo_hyperparameters(steps: int) -> dict[str, object]:
    """A warm model needs a small learning rate with warm-up: Adam's first steps are full size, and a few
    of them at 2e-3 undo a partly trained model. The linear decay keeps the late steps from undoing solved
    prompts (with a constant rate held-out accuracy oscillated around 80-87 %). beta 0: no reference model,
    as in DAPO and TRL's default."""
    return {
        "max_steps": steps,
        "num_generations": 8,
        "prompts_per_step": 16,
        "max_completion_length": 4,
        "learning_rate": DEMO_LEARNING_RATE,
        "warmup_steps": 10,
        "lr_scheduler": "linear",
        "beta": DEMO_BETA,
        "temperature": 1.0,
        "eval_every": 10,
        "eval_samples": 64,
        "checkpoint_every": steps,
        "save_total_limit": 2,
        "log_completions_every": 10,
        "seed": 0,
    }


def _run(stack: ExitStack, out: Path, env: dict[str, str], model: str, steps: int, seeds: int) -> None:
    client, serve, serve_log = _serve(stack, out, env)
    train, held_out = _upload_datasets(client, out)
    reward_function_id = _reward_endpoint(stack, client, out, env)
    outcomes: list[tuple[int, float, float]] = []
    for seed in range(seeds):
        job = _submit(client, model, steps, train.id, held_out.id, reward_function_id, seed)
        _wait_started(client, job.id, serve, serve_log)
        series = _follow(client, job, held_out)
        accuracy = series["eval/accuracy"].values
        outcomes.append((seed, accuracy[0], accuracy[-1]))
    if seeds > 1:
        for seed, before, after in outcomes:
            console.print(f"[bold]seed {seed}: held-out accuracy {before:.0%} -> {after:.0%}")
    checkpoint_dir, checkpoint_id = _download_final_checkpoint(client, job.id, out)
    _answer_held_out(checkpoint_dir)
    _compare_with_base(client, model, checkpoint_id, held_out, reward_function_id)
    _plot(out, job.id, series, checkpoint_dir)


def _serve(
    stack: ExitStack, out: Path, env: dict[str, str]
) -> tuple[GRPOClient, subprocess.Popen[bytes], Path]:
    """Stages 1-2: the schema, a tenant and its key (added to `env`), then `grpo serve` until it is ready."""
    api_url = f"http://127.0.0.1:{env['GRPO_API_PORT']}"
    _stage("1/9 database and API key")
    _grpo(env, "migrate")
    api_key = _grpo(env, "admin", "create-tenant", "demo").splitlines()[-1]
    env.update(GRPO_API_URL=api_url, GRPO_API_KEY=api_key)
    console.print(f"tenant 'demo', key {api_key[:12]}...  data in {env['GRPO_DATA_DIR']}")

    _stage("2/9 grpo serve (REST + gRPC + embedded worker)")
    serve_log = out / "serve.log"
    serve = stack.enter_context(
        _process([PYTHON, "-m", "cli", "serve", "--worker", "--no-migrate"], env, serve_log)
    )
    _wait_http(f"{api_url}/readyz", serve, serve_log)
    console.print(f"REST {api_url}  gRPC 127.0.0.1:{env['GRPO_GRPC_PORT']}  (logs: {serve_log})")
    return stack.enter_context(GRPOClient(api_url, api_key)), serve, serve_log


def _upload_datasets(client: GRPOClient, out: Path) -> tuple[DatasetOut, DatasetOut]:
    """Stage 3: (train, held-out eval)."""
    _stage("3/9 datasets")
    train_path, eval_path = write_demo_datasets(out)
    train = client.upload_dataset(train_path, name=f"{DEMO_TASK}-train")
    held_out = client.upload_dataset(eval_path, name=f"{DEMO_TASK}-eval")
    console.print(f"{train.id}: {train.num_rows} training questions; {held_out.id}: {held_out.num_rows} held-out")
    return train, held_out


def _reward_endpoint(stack: ExitStack, client: GRPOClient, out: Path, env: dict[str, str]) -> str:
    """Stage 4: register the example reward server and start it with the signing secret; its id."""
    _stage("4/9 reward endpoint (example server, exact match, verifies every signature)")
    reward_port = _free_port()
    created = client.register_reward_function(
        "exact-answer", f"http://127.0.0.1:{reward_port}/score", max_batch_size=64, max_concurrency=4
    )
    reward_log = out / "reward_server.log"
    reward_env = {**env, "GRPO_REWARD_SECRET": created.signing_secret}
    server = stack.enter_context(
        _process(
            [PYTHON, "examples/reward_server.py", "--port", str(reward_port), "--task", "exact"],
            reward_env,
            reward_log,
        )
    )
    _wait_http(f"http://127.0.0.1:{reward_port}/healthz", server, reward_log, timeout=30)
    console.print(f"{created.id} -> {created.url}")
    return created.id


def _submit(
    client: GRPOClient, model: str, steps: int, train_id: str, held_out_id: str, reward_function_id: str, seed: int
) -> JobOut:
    """Stage 5 begins: the job, trained on `train_id` and evaluated on `held_out_id`."""
    _stage(f"5/9 job (seed {seed})")
    job = client.create_job(
        {
            "name": f"demo-{DEMO_TASK}",
            "base_model": model,
            "train_dataset": train_id,
            "eval_dataset": held_out_id,
            "rewards": [{"type": "remote", "reward_function_id": reward_function_id, "weight": 1.0}],
            "hyperparameters": {**demo_hyperparameters(steps), "seed": seed},
        }
    )
    console.print(f"{job.id} queued")
    return job


def _follow(client: GRPOClient, job: JobOut, held_out: DatasetOut) -> dict[str, MetricSeries]:
    """Stage 5 goes on: live progress until the job ends, then held-out accuracy before and after; its metrics."""
    outcome = follow(client, job)
    if outcome != 0:
        events = client.list_job_events(job.id).data
        raise DemoFailed(f"job ended {client.get_job(job.id).status}: " + "; ".join(e.message for e in events[-5:]))
    series = client.get_job_metrics(job.id).series
    accuracy = series.get("eval/accuracy")
    if accuracy is None or not accuracy.steps:
        raise DemoFailed("the job recorded no held-out accuracy")
    console.print(
        f"[bold]held-out accuracy ({held_out.num_rows} questions never trained on): "
        f"{accuracy.values[0]:.0%} at step {accuracy.steps[0]} -> {accuracy.values[-1]:.0%} at step {accuracy.steps[-1]}"
    )
    return series


def _download_final_checkpoint(client: GRPOClient, job_id: str, out: Path) -> tuple[Path, str]:
    """Stage 6: the job's last checkpoint, downloaded under `out`; its directory and id."""
    _stage("6/9 download the final checkpoint")
    checkpoints = client.list_checkpoints(job_id).data
    if not checkpoints:
        raise DemoFailed("the job recorded no checkpoint")
    final = checkpoints[-1]
    checkpoint_dir = client.download_checkpoint(final.id, out / "checkpoint")
    console.print(f"{final.id} (step {final.step}, {final.total_bytes} bytes) -> {checkpoint_dir}")
    return checkpoint_dir, final.id


def _answer_held_out(checkpoint_dir: Path) -> None:
    """Stage 7: the downloaded checkpoint, loaded with from_pretrained, answers held-out questions."""
    _stage("7/9 load it with from_pretrained and answer held-out questions")
    # The engine's modules, and torch with them, load only here: never when the CLI or the API is imported.
    from worker.grpo.sample import answer_questions
    from worker.grpo.synthetic import held_out_items

    shown = held_out_items(DEMO_TASK)[:DEMO_QUESTIONS_SHOWN]
    answers = answer_questions(checkpoint_dir, [item.question for item in shown], max_new_tokens=4)
    for item, answer in zip(shown, answers, strict=True):
        mark = "[green]right[/green]" if answer.strip() == item.answer else f"[red]wrong (expected {item.answer})[/red]"
        console.print(f"{item.question!r} -> {answer!r}  {mark}")


def _compare_with_base(
    client: GRPOClient, model: str, checkpoint_id: str, held_out: DatasetOut, reward_function_id: str
) -> None:
    """Stage 8: the base model and the checkpoint evaluated on the held-out set (greedy, the reward endpoint),
    and their paired comparison."""
    _stage("8/9 evaluate the checkpoint against the base model (evaluations API)")
    ids = []
    for source in (model, f"checkpoint:{checkpoint_id}"):
        spec = {"model": source, "dataset": held_out.id, "temperature": 0, "max_tokens": 4,
                "rewards": [{"type": "remote", "reward_function_id": reward_function_id}]}
        evaluation = client.wait_evaluation(client.create_evaluation(spec).id)
        if evaluation.results is None or evaluation.results.accuracy is None:
            raise DemoFailed(f"evaluation {evaluation.id} of {source} ended {evaluation.status}: {evaluation.error}")
        interval = evaluation.results.accuracy_interval
        bounds = f" [{interval.low:.0%}, {interval.high:.0%}]" if interval is not None else ""
        console.print(f"{evaluation.id} {source}: accuracy {evaluation.results.accuracy:.0%}{bounds}")
        ids.append(evaluation.id)
    diff = client.compare_evaluations(ids[0], ids[1])
    console.print(
        f"[bold]checkpoint - base: {diff.difference:+.0%} (95 % interval {diff.interval.low:+.0%} to "
        f"{diff.interval.high:+.0%}; {diff.test} p = {diff.p_value:.2g}); {diff.b_better} questions now right, "
        f"{diff.a_better} now wrong"
    )


def _plot(out: Path, job_id: str, series: dict[str, MetricSeries], checkpoint_dir: Path) -> None:
    """Stage 8: the training curves as a PNG, and the training reward's first and last steps."""
    _stage("9/9 training curves")
    from service.plots import render_metrics_png  # matplotlib is slow to import: only when needed

    png = out / "training_curves.png"
    png.write_bytes(render_metrics_png(series, title=f"{job_id} (demo)"))
    rewards = series["reward/mean"].values
    first, last = sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-5:]) / len(rewards[-5:])
    console.print(f"training reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f}")
    console.print(f"curves (reward, KL, length, held-out eval): {png}\ncheckpoint: {checkpoint_dir}")
