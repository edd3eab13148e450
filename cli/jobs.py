"""`grpo jobs create|list|get|estimate|set-budget|watch|cancel|pause|resume|delete|events|metrics|samples|plot`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cli.output import JsonOpt, api_client, console, emit
from client.sdk import GRPOClient
from contract.api.jobs import EventOut, JobOut, SampleOut

app = typer.Typer(help="Training jobs.", no_args_is_help=True)
COLUMNS = ["id", "name", "status", "base_model", "progress", "attempt", "error", "created_at", "finished_at"]
LIST_COLUMNS = ["id", "name", "status", "progress", "created_at"]
SAMPLE_COLUMNS = ["step", "prompt", "completion", "reward", "rewards"]
OUTCOME_EXIT = {"succeeded": 0, "failed": 1, "cancelled": 3, "paused": 4}


def load_spec(path: Path) -> dict[str, Any]:
    """A job spec from YAML or JSON; validated by the server (422 names the field)."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise typer.BadParameter(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{path}: a job spec is a mapping, got {type(data).__name__}")
    data.pop("output_dir", None)  # local-only (`grpo train`) key
    return data


@app.command()
def create(
    file: Path = typer.Option(..., "-f", "--file", exists=True, dir_okay=False, help="Job spec YAML/JSON."),
    idempotency_key: str | None = typer.Option(None, help="Retry-safe key (one is generated if omitted)."),
    watch_: bool = typer.Option(False, "--watch", help="Follow the job until it ends."),
    as_json: JsonOpt = False,
) -> None:
    """Submit a job."""
    with api_client() as client:
        job = client.create_job(load_spec(file), idempotency_key)
        emit(job, COLUMNS, as_json=as_json)
        if watch_:
            raise typer.Exit(follow(client, job))


@app.command("list")
def list_(status: str | None = None, limit: int = 20, after: str | None = None, as_json: JsonOpt = False) -> None:
    """List jobs, newest first."""
    with api_client() as client:
        emit(client.list_jobs(status, limit, after).data, LIST_COLUMNS, as_json=as_json)


@app.command()
def get(job_id: str, as_json: JsonOpt = False) -> None:
    """Show a job: status, progress, latest metrics, error."""
    with api_client() as client:
        job = client.get_job(job_id)
        used = client.get_job_usage(job_id)
    if as_json:
        typer.echo(json.dumps({**job.model_dump(mode="json"), "usage": used.model_dump(mode="json", exclude={"steps"})},
                              indent=2))
        return
    emit(job, COLUMNS, as_json=False)
    if job.metrics:
        console.print({k: v for k, v in sorted(job.metrics.items()) if v is not None})
    console.print({"usage": used.totals.model_dump(), "budget": used.budget.model_dump(mode="json")})


@app.command()
def estimate(
    file: Path = typer.Option(..., "-f", "--file", exists=True, dir_okay=False, help="Job spec YAML/JSON."),
    as_json: JsonOpt = False,
) -> None:
    """Expected steps, tokens and device-seconds of a spec, before running it (nothing is created)."""
    with api_client() as client:
        result = client.estimate_job(load_spec(file))
    emit(result, ["steps", "tokens_generated", "tokens_trained", "tokens", "reward_calls", "device_seconds",
                  "calibration"], as_json=as_json)


@app.command("set-budget")
def set_budget(
    job_id: str,
    max_tokens: int | None = typer.Option(None, help="Most tokens (generated + trained) the job may use."),
    max_device_seconds: float | None = typer.Option(None, help="Most device-seconds the job may use."),
    clear: bool = typer.Option(False, "--clear", help="Remove the job's budget."),
    resume: bool = typer.Option(False, "--resume", help="Then resume the job (paused with budget_exhausted)."),
    as_json: JsonOpt = False,
) -> None:
    """Replace a job's budget (validated by the server: 422 names the field)."""
    if clear == (max_tokens is not None or max_device_seconds is not None):
        raise typer.BadParameter("give --max-tokens and/or --max-device-seconds, or --clear")
    budget = None if clear else {"max_tokens": max_tokens, "max_device_seconds": max_device_seconds}
    with api_client() as client:
        job = client.set_job_budget(job_id, budget)
        if resume:
            job = client.resume_job(job_id)
    emit(job, COLUMNS, as_json=as_json)


@app.command()
def watch(job_id: str) -> None:
    """Follow a job live (progress bar with reward, KL, ETA); exits with the job's outcome (0 = succeeded)."""
    with api_client() as client:
        raise typer.Exit(follow(client, client.get_job(job_id)))


def follow(client: GRPOClient, job: JobOut) -> int:
    total = job.progress.total_steps
    columns = (
        TextColumn("[bold]{task.fields[status]}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total}"),
        TextColumn("reward {task.fields[reward]}  kl {task.fields[kl]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    status = str(job.status)
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(job.id, total=total, completed=job.progress.step, status=status, reward="-", kl="-")
        for event in client.stream_job(job.id):
            status = _apply(bar, task, event, status)
    console.print(f"{job.id}: {status}")
    return OUTCOME_EXIT.get(status, 2)


def _apply(bar: Progress, task: Any, event: EventOut, status: str) -> str:
    if event.type == "metrics":
        metrics = event.data.get("metrics", {})
        bar.update(
            task,
            completed=event.data.get("step", 0),
            reward=_fmt(metrics.get("reward/mean")),
            kl=_fmt(metrics.get("kl")),
        )
        if "total_steps" in event.data:
            bar.update(task, total=event.data["total_steps"])
        evals = {k.removeprefix("eval/"): v for k, v in metrics.items()
                 if k.startswith("eval/") and (k.endswith("accuracy") or "pass@" in k or k.endswith("eval/reward/mean"))}
        if evals:
            bar.console.print(f"[dim]step {event.data.get('step', 0)} eval[/dim] "
                              + "  ".join(f"{name} {value:.3f}" for name, value in sorted(evals.items())))
    elif event.type == "status":
        status = str(event.data.get("to", status))
        bar.update(task, status=status)
        bar.console.print(f"[dim]{event.created_at:%H:%M:%S}[/dim] {event.message}")
    else:
        bar.console.print(f"[dim]{event.created_at:%H:%M:%S}[/dim] {event.type}: {event.message}")
    return status


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


@app.command()
def cancel(job_id: str, as_json: JsonOpt = False) -> None:
    """Cancel a job (a queued job never starts; a running one stops at its next step)."""
    with api_client() as client:
        emit(client.cancel_job(job_id), COLUMNS, as_json=as_json)


@app.command()
def pause(job_id: str, as_json: JsonOpt = False) -> None:
    """Pause a running job at its next step (after a checkpoint)."""
    with api_client() as client:
        emit(client.pause_job(job_id), COLUMNS, as_json=as_json)


@app.command()
def resume(job_id: str, as_json: JsonOpt = False) -> None:
    """Resume a paused job from its last checkpoint."""
    with api_client() as client:
        emit(client.resume_job(job_id), COLUMNS, as_json=as_json)


@app.command()
def delete(job_id: str) -> None:
    """Delete a finished job with its checkpoints (files included)."""
    with api_client() as client:
        client.delete_job(job_id)
    typer.echo(f"deleted {job_id}")


@app.command()
def events(job_id: str, after: int | None = None, limit: int = 100, as_json: JsonOpt = False) -> None:
    """List a job's events."""
    with api_client() as client:
        emit(client.list_job_events(job_id, after, limit).data, ["id", "type", "message", "created_at"], as_json=as_json)


@app.command()
def metrics(
    job_id: str,
    names: str | None = typer.Option(None, help="Comma-separated metric names (default: all)."),
    since_step: int | None = None,
    as_json: JsonOpt = False,
) -> None:
    """Print metric time series."""
    with api_client() as client:
        out = client.get_job_metrics(job_id, names.split(",") if names else None, since_step)
    if as_json:
        emit(out, [], as_json=True)
        return
    for name, series in sorted(out.series.items()):
        console.print(f"[bold]{name}[/bold]: " + ", ".join(f"{s}:{v:.4g}" for s, v in zip(series.steps, series.values, strict=True)))


@app.command()
def samples(job_id: str, step: int | None = None, as_json: JsonOpt = False) -> None:
    """Show logged sample completions with their rewards; a multi-turn sample as its conversation."""
    with api_client() as client:
        data = client.list_job_samples(job_id, step).data
    single = [s for s in data if s.episode is None]
    if as_json or single:
        emit(data if as_json else single, SAMPLE_COLUMNS, as_json=as_json)
    if not as_json:
        for sample in data:
            if sample.episode is not None:
                print_episode(sample)


def print_episode(sample: SampleOut) -> None:
    """A multi-turn sample as a readable conversation: the prompt, each turn, the rewards."""
    assert sample.episode is not None
    episode = sample.episode
    console.print(f"[bold]step {sample.step}[/bold]  reward {sample.reward}  {sample.rewards}")
    console.print(f"[dim]prompt[/dim] {sample.prompt}", markup=False)
    for turn in episode.turns:
        if turn.role == "assistant":
            console.print("[cyan]policy[/cyan]", end=" ")
            console.print(turn.text, markup=False)
            for call in turn.tool_calls:
                console.print(f"  -> {call.name}({json.dumps(call.arguments)})", markup=False)
        else:
            reward = "" if turn.reward is None else f"  (reward {turn.reward:g})"
            masked = "" if turn.tokens else "  [not appended]"
            console.print(f"[magenta]{turn.name}[/magenta]", end=" ")
            console.print(f"{turn.text}{reward}{masked}", markup=False)
    outcome = f"failed: {episode.error}" if episode.error else f"environment reward {episode.reward}"
    console.print(f"[dim]{outcome} ({episode.reward_mode})[/dim]\n")


@app.command()
def plot(job_id: str, out: Path = typer.Option(Path("reward_curve.png"), "--out", "-o")) -> None:
    """Render reward mean ± std, KL and completion length over steps to a PNG."""
    from service.plots import render_metrics_png  # matplotlib is slow to import: only this command needs it

    with api_client() as client:
        series = client.get_job_metrics(job_id).series
    out.write_bytes(render_metrics_png(series, title=job_id))
    typer.echo(str(out))
