"""The official `openai` SDK, given only base_url and api_key, drives a live `grpo serve` through a
reinforcement fine-tuning run: upload -> create (multi grader over string_check + text_similarity) -> poll to
succeeded -> events and checkpoints; pause/resume/cancel of a second job; graders validate and run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from tests.ship.conftest import GRPO, Processes, clean_env, describe, free_port, run_cli, wait_http_ok

pytestmark = pytest.mark.slow

ROWS = [{"messages": [{"role": "user", "content": f"Repeat {c} {n} times."}], "answer": c * n}
        for c, n in (("a", 2), ("b", 3), ("c", 1), ("d", 2))]
GRADER = {
    "type": "multi",
    "name": "repeat",
    "graders": {
        "exact": {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                  "reference": "{{item.answer}}", "operation": "eq"},
        "close": {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}",
                  "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match"},
    },
    "calculate_output": "0.7 * exact + 0.3 * close",
}


def test_openai_sdk_runs_a_reinforcement_job(tmp_path: Path, processes: Processes, instruct_model: Path) -> None:
    started = time.monotonic()
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    os.symlink(instruct_model, data / "models" / instruct_model.name)  # the worker finds it built
    api_port = free_port()
    env = clean_env(GRPO_ENV="development", GRPO_DATA_DIR=str(data), GRPO_API_PORT=str(api_port),
                    GRPO_GRPC_PORT=str(free_port()))
    serve = processes.start("serve", [*GRPO, "serve", "--worker", "--migrate"], env)
    wait_http_ok(f"http://127.0.0.1:{api_port}/readyz", serve, timeout=60)
    created = run_cli(env, "admin", "create-tenant", "openai-sdk")
    assert created.returncode == 0, describe(created)
    client = OpenAI(base_url=f"http://127.0.0.1:{api_port}/openai/v1",
                    api_key=created.stdout.strip().splitlines()[-1])

    # --- files
    body = "".join(json.dumps(row) + "\n" for row in ROWS).encode()
    file = client.files.create(file=("repeat.jsonl", body), purpose="fine-tune")
    assert file.status == "processed" and file.bytes == len(body) and file.id.startswith("file-")
    assert [f.id for f in client.files.list()] == [file.id]
    assert client.files.content(file.id).content == body

    # --- graders: validate and run on the same code training uses
    validated = client.fine_tuning.alpha.graders.validate(grader=GRADER)  # type: ignore[arg-type]
    assert validated.grader is not None
    run = client.fine_tuning.alpha.graders.run(grader=GRADER, model_sample="aa", item=ROWS[0])  # type: ignore[arg-type]
    assert run.reward == pytest.approx(1.0) and run.sub_rewards == {"exact": 1.0, "close": 1.0}
    wrong = client.fine_tuning.alpha.graders.run(grader=GRADER, model_sample="zz", item=ROWS[0])  # type: ignore[arg-type]
    assert wrong.reward == pytest.approx(0.0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.alpha.graders.validate(grader={**GRADER, "calculate_output": "exact +"})  # type: ignore[arg-type]
    assert refused.value.param == "grader.calculate_output"

    # --- a job that trains to the end, and one that is paused, resumed and cancelled while it waits for the
    # (single) worker
    method = {"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": {
        "n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.5}}}
    job = client.fine_tuning.jobs.create(model="builtin:tiny-instruct", training_file=file.id, seed=0,
                                         method=method)  # type: ignore[arg-type]
    other = client.fine_tuning.jobs.create(model="builtin:tiny-instruct", training_file=file.id,
                                           method=method)  # type: ignore[arg-type]
    assert job.status == "queued" and job.method is not None and job.method.type == "reinforcement"
    assert job.training_file == file.id
    assert client.fine_tuning.jobs.pause(other.id).status == "paused"
    assert client.fine_tuning.jobs.resume(other.id).status == "queued"
    assert client.fine_tuning.jobs.cancel(other.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.fine_tuning.jobs.create(model="builtin:tiny-instruct", training_file=file.id,
                                       method={"type": "supervised"})
    assert unsupported.value.param == "method.type"

    deadline = time.monotonic() + 240
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, (job.status, processes.logs()[-4000:])
        time.sleep(1)
    assert job.status == "succeeded", (job.error, processes.logs())
    trained = time.monotonic() - started

    # --- events and checkpoints
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    assert any(e.type == "metrics" for e in events), events
    assert all(e.object == "fine_tuning.job.event" for e in events)
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert checkpoints and checkpoints[0].step_number == 2, checkpoints
    assert job.fine_tuned_model == checkpoints[0].fine_tuned_model_checkpoint
    # The jobs are ordinary jobs: our own API lists both.
    listed = {j.id: j.status for j in client.fine_tuning.jobs.list()}
    assert listed == {job.id: "succeeded", other.id: "cancelled"}
    print(f"openai SDK end to end: trained in {trained:.1f}s, all in {time.monotonic() - started:.1f}s")
