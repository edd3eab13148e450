"""`grpo evals create|list|get|items|cancel|resume|compare`: evaluations of models on datasets
(docs/evaluations.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.jobs import load_spec
from cli.output import JsonOpt, api_client, console, emit
from contract.api.evaluations import ComparisonOut, EvaluationOut

app = typer.Typer(help="Evaluations of models on datasets, and comparisons.", no_args_is_help=True)
COLUMNS = ["id", "name", "status", "model", "dataset", "samples_per_item", "progress", "error", "created_at"]
LIST_COLUMNS = ["id", "name", "status", "model", "progress", "created_at"]
ITEM_COLUMNS = ["index", "score", "rewards", "completions"]
COMPARISON_COLUMNS = ["metric", "items", "mean_a", "mean_b", "difference", "interval", "test", "p_value",
                      "b_better", "a_better"]
OUTCOME_EXIT = {"succeeded": 0, "failed": 1, "cancelled": 3}


def _show(evaluation: EvaluationOut, *, as_json: bool) -> None:
    emit(evaluation, COLUMNS, as_json=as_json)
    if evaluation.results is not None and not as_json:
        console.print(evaluation.results.model_dump())


@app.command()
def create(
    file: Path = typer.Option(..., "-f", "--file", exists=True, dir_okay=False, help="Evaluation spec YAML/JSON."),
    wait: bool = typer.Option(False, "--wait", help="Wait until it ends and print the results."),
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a model on a dataset."""
    with api_client() as client:
        evaluation = client.create_evaluation(load_spec(file))
        if wait:
            evaluation = client.wait_evaluation(evaluation.id)
        _show(evaluation, as_json=as_json)
    if wait:
        raise typer.Exit(OUTCOME_EXIT.get(str(evaluation.status), 2))


@app.command("list")
def list_(limit: int = 20, after: str | None = None, as_json: JsonOpt = False) -> None:
    """List evaluations, newest first."""
    with api_client() as client:
        emit(client.list_evaluations(limit, after).data, LIST_COLUMNS, as_json=as_json)


@app.command()
def get(evaluation_id: str, as_json: JsonOpt = False) -> None:
    """Show an evaluation and, once it succeeded, its results."""
    with api_client() as client:
        _show(client.get_evaluation(evaluation_id), as_json=as_json)


@app.command()
def items(evaluation_id: str, limit: int = 100, after: int | None = None, as_json: JsonOpt = False) -> None:
    """An evaluation's items in dataset order: completions, rewards, score."""
    with api_client() as client:
        emit(client.list_evaluation_items(evaluation_id, limit, after).data, ITEM_COLUMNS, as_json=as_json)


@app.command()
def cancel(evaluation_id: str, as_json: JsonOpt = False) -> None:
    """Cancel an evaluation (a running one stops after its current batch)."""
    with api_client() as client:
        _show(client.cancel_evaluation(evaluation_id), as_json=as_json)


@app.command()
def resume(evaluation_id: str, as_json: JsonOpt = False) -> None:
    """Resume a paused evaluation after its last recorded item."""
    with api_client() as client:
        _show(client.resume_evaluation(evaluation_id), as_json=as_json)


@app.command()
def compare(evaluation_a: str, evaluation_b: str, seed: int = 0, as_json: JsonOpt = False) -> None:
    """Compare b with a, paired over the items both scored."""
    with api_client() as client:
        comparison: ComparisonOut = client.compare_evaluations(evaluation_a, evaluation_b, seed)
    emit(comparison, COMPARISON_COLUMNS, as_json=as_json)
    if comparison.flipped and not as_json:
        emit(comparison.flipped, ["index", "score_a", "score_b", "prompt"], as_json=False)
