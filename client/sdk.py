"""Python client for the REST API (sync `GRPOClient` here, async `AsyncGRPOClient` in client.async_sdk), typed
with the API's own schemas.

Every endpoint is described once, as a `Call` built by a function in `client.calls.calls`; the two clients only
differ in how they send it (client.http). Idempotent calls (GET, and POST /v1/jobs, which always carries an
Idempotency-Key) are retried on connection errors, 429 and 502/503/504 with exponential backoff; others only on a
429 that carries Retry-After (a rate limit: the request was refused before it ran). A Retry-After is honoured
(waited, not guessed) up to `max_retry_after` seconds; a longer one is returned as the APIError at once.

    client = GRPOClient("http://127.0.0.1:8000", api_key="grpo_sk_...")
    dataset = client.upload_dataset("train.jsonl")
    job = client.create_job({"base_model": "builtin:tiny", "train_dataset": dataset.id, ...})
    for event in client.stream_job(job.id): ...
    for event, progress in client.watch_job(job.id): print(progress.metrics)   # one entry per step
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt

from client.calls import Call, T, calls, query_params
from client.http import (
    APIError,
    Retryable,
    RetryPolicy,
    SSEParser,
    connection_settings,
    needs_retry,
    parse_answer,
    raise_for_error,
)
from contract.api.api_keys import ApiKeyList, ApiKeyWithSecret
from contract.api.checkpoints import CheckpointList, CheckpointOut
from contract.api.datasets import DatasetList, DatasetOut
from contract.api.environments import EnvironmentList, EnvironmentOut, EnvironmentWithSecret
from contract.api.evaluations import ComparisonOut, EvaluationItemList, EvaluationList, EvaluationOut
from contract.api.jobs import EventList, EventOut, JobList, JobOut, MetricsOut, SampleList
from contract.api.quotas import QuotaLimits, QuotasOut
from contract.api.rewards import (
    RewardFunctionList,
    RewardFunctionOut,
    RewardFunctionWithSecret,
    RewardTestResult,
)
from contract.api.usage import Estimate, JobUsage, UsageReport
from contract.api.webhooks import DeliveryList, WebhookList, WebhookOut, WebhookWithSecret
from contract.evaluation import EvaluationSpec
from contract.spec import JobBudget, JobSpec

# APIError is defined with the rest of the HTTP handling (client.http) and is part of this module's API.
__all__ = ["APIError", "GRPOClient", "JobProgress", "UnsafeCheckpointPath", "checkpoint_file_targets"]


class UnsafeCheckpointPath(ValueError):
    """A checkpoint lists a file whose path would be written outside the download's destination directory."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"checkpoint file path {path!r} refused: {reason}; nothing was downloaded")
        self.path = path
        self.reason = reason


def checkpoint_file_targets(dest_dir: str | Path, paths: Iterable[str]) -> list[Path]:
    """Where each listed checkpoint file goes under `dest_dir`, every path checked before anything is written.

    A listed path must be relative, made of plain names (no `..`, no drive, no backslash, no NUL), and, once the
    symbolic links already under `dest_dir` are followed, still land inside it. Raises UnsafeCheckpointPath
    naming the first path that would not: the listing comes from the server, and a client must not let it
    write anywhere else on the machine.
    """
    root = Path(dest_dir).resolve()
    targets: list[Path] = []
    for path in paths:
        pure = PurePosixPath(path)
        if not path or "\x00" in path or "\\" in path:
            raise UnsafeCheckpointPath(path, "empty, or contains a NUL or a backslash")
        if pure.is_absolute() or PureWindowsPath(path).anchor:
            raise UnsafeCheckpointPath(path, "an absolute path")
        if ".." in pure.parts:
            raise UnsafeCheckpointPath(path, "it contains '..'")
        if not pure.parts:
            raise UnsafeCheckpointPath(path, "it names no file")
        target = root.joinpath(*pure.parts)
        resolved = target.resolve()
        if resolved == root or not resolved.is_relative_to(root):
            raise UnsafeCheckpointPath(path, "it leads outside the destination through a symbolic link")
        targets.append(target)
    return targets


@dataclass
class JobProgress:
    """A job's per-step metrics as its event stream reports them, each step counted once.

    After a worker crash the next attempt resumes from the last checkpoint and re-runs the steps after it, so a
    live stream carries their `metrics` events twice (the replayed log does not: those are `superseded`).
    The new attempt's claim event (`status` to `running`, or `lease_taken_over`) names its `resume_step`:
    `apply` then drops the later steps, which the new attempt reports again.
    """

    metrics: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> that step's metrics
    attempt: int = 0
    status: str | None = None

    def apply(self, event: EventOut) -> None:
        if event.superseded or event.attempt < self.attempt:
            return  # a late event of an attempt that has been replaced
        self.attempt = max(self.attempt, event.attempt)
        resume_step = event.data.get("resume_step")
        if event.type in ("status", "lease_taken_over") and isinstance(resume_step, int):
            self.metrics = {step: values for step, values in self.metrics.items() if step <= resume_step}
        if event.type == "status":
            self.status = str(event.data.get("to", self.status))
        elif event.type == "metrics" and isinstance(event.data.get("step"), int):
            self.metrics[event.data["step"]] = dict(event.data.get("metrics", {}))

    @property
    def steps(self) -> list[int]:
        return sorted(self.metrics)


class GRPOClient:
    """Synchronous client. Base URL and key default to $GRPO_API_URL and $GRPO_API_KEY."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 4,
        max_retry_after: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`transport` replaces httpx's network transport (tests, proxies, custom TLS). A rate-limited call (429 with
        Retry-After) is retried after the time the server names, up to `max_retry_after` seconds."""
        url, headers = connection_settings(base_url, api_key)
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout, transport=transport)
        self._retries = retries
        self._max_retry_after = max_retry_after

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GRPOClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _send(self, call: Call[T]) -> httpx.Response:
        response = self._http.request(
            call.method, call.path, params=call.params, json=call.json, headers=call.headers
        )
        if needs_retry(call, response):
            raise Retryable(response)
        return response

    def _run(self, call: Call[T]) -> T:
        policy = RetryPolicy(call, self._max_retry_after)
        retrying = Retrying(
            retry=retry_if_exception(policy.should_retry),
            wait=policy.wait,
            stop=stop_after_attempt(self._retries),
            reraise=True,
        )
        try:
            response = retrying(self._send, call)
        except Retryable as exc:
            response = exc.response
        return parse_answer(call, response)

    # --- datasets
    def upload_dataset(self, path: str | Path, name: str | None = None) -> DatasetOut:
        path = Path(path)
        with path.open("rb") as handle:
            files = {"file": (path.name, handle, "application/x-ndjson")}
            response = self._http.post("/v1/datasets", files=files, data=query_params(name=name))
        raise_for_error(response)
        return DatasetOut.model_validate(response.json())

    def list_datasets(self, limit: int = 20, after: str | None = None) -> DatasetList:
        return self._run(calls.list_datasets(limit, after))

    def get_dataset(self, dataset_id: str) -> DatasetOut:
        return self._run(calls.get_dataset(dataset_id))

    def delete_dataset(self, dataset_id: str) -> None:
        self._run(calls.delete_dataset(dataset_id))

    # --- environments
    def register_environment(self, name: str, url: str, **options: Any) -> EnvironmentWithSecret:
        return self._run(calls.register_environment(name, url, **options))

    def list_environments(self, limit: int = 20, after: str | None = None) -> EnvironmentList:
        return self._run(calls.list_environments(limit, after))

    def get_environment(self, environment_id: str) -> EnvironmentOut:
        return self._run(calls.get_environment(environment_id))

    def check_environment(self, environment_id: str) -> EnvironmentOut:
        return self._run(calls.check_environment(environment_id))

    def delete_environment(self, environment_id: str) -> None:
        self._run(calls.delete_environment(environment_id))

    def rotate_environment_secret(self, environment_id: str) -> EnvironmentWithSecret:
        return self._run(calls.rotate_environment_secret(environment_id))

    # --- reward functions
    def register_reward_function(self, name: str, url: str, **options: Any) -> RewardFunctionWithSecret:
        return self._run(calls.register_reward_function(name, url, **options))

    def list_reward_functions(self, limit: int = 20, after: str | None = None) -> RewardFunctionList:
        return self._run(calls.list_reward_functions(limit, after))

    def get_reward_function(self, reward_function_id: str) -> RewardFunctionOut:
        return self._run(calls.get_reward_function(reward_function_id))

    def delete_reward_function(self, reward_function_id: str) -> None:
        self._run(calls.delete_reward_function(reward_function_id))

    def rotate_reward_secret(self, reward_function_id: str) -> RewardFunctionWithSecret:
        return self._run(calls.rotate_reward_secret(reward_function_id))

    def test_reward_function(self, reward_function_id: str, items: list[dict[str, Any]]) -> RewardTestResult:
        return self._run(calls.test_reward_function(reward_function_id, items))

    # --- jobs
    def create_job(self, spec: JobSpec | dict[str, Any], idempotency_key: str | None = None) -> JobOut:
        return self._run(calls.create_job(spec, idempotency_key))

    def list_jobs(self, status: str | None = None, limit: int = 20, after: str | None = None) -> JobList:
        return self._run(calls.list_jobs(status, limit, after))

    def get_job(self, job_id: str) -> JobOut:
        return self._run(calls.get_job(job_id))

    def cancel_job(self, job_id: str) -> JobOut:
        return self._run(calls.job_action(job_id, "cancel"))

    def pause_job(self, job_id: str) -> JobOut:
        return self._run(calls.job_action(job_id, "pause"))

    def resume_job(self, job_id: str) -> JobOut:
        return self._run(calls.job_action(job_id, "resume"))

    def delete_job(self, job_id: str) -> None:
        """Delete a finished job and its checkpoints (files included)."""
        self._run(calls.delete_job(job_id))

    # --- usage and budgets
    def estimate_job(self, spec: JobSpec | dict[str, Any]) -> Estimate:
        """Expected steps, tokens and device-seconds of a spec; nothing is created."""
        return self._run(calls.estimate_job(spec))

    def set_job_budget(self, job_id: str, budget: JobBudget | dict[str, Any] | None) -> JobOut:
        """Replace a job's budget (None removes it); then `resume_job` a job paused with budget_exhausted."""
        return self._run(calls.set_job_budget(job_id, budget))

    def get_job_usage(self, job_id: str) -> JobUsage:
        return self._run(calls.get_job_usage(job_id))

    def get_usage(
        self, start: datetime | None = None, end: datetime | None = None, group_by: str = "day"
    ) -> UsageReport:
        """Your usage in [start, end) (default: this UTC month), by `day` or by `job`."""
        return self._run(calls.get_usage(start, end, group_by))

    def list_job_events(
        self, job_id: str, after: int | None = None, limit: int = 100, include_superseded: bool = False
    ) -> EventList:
        return self._run(calls.list_job_events(job_id, after, limit, include_superseded))

    def get_job_metrics(
        self, job_id: str, names: list[str] | None = None, since_step: int | None = None
    ) -> MetricsOut:
        return self._run(calls.get_job_metrics(job_id, names, since_step))

    def list_job_samples(self, job_id: str, step: int | None = None, after: int | None = None) -> SampleList:
        return self._run(calls.list_job_samples(job_id, step, after))

    def get_job_plot(self, job_id: str) -> bytes:
        """The training curves as PNG bytes (GET /v1/jobs/{id}/plot.png)."""
        response = self._http.get(f"/v1/jobs/{job_id}/plot.png")
        raise_for_error(response)
        return response.content

    def stream_job(self, job_id: str, last_event_id: int | None = None) -> Iterator[EventOut]:
        """Follow the job's Server-Sent Events until it ends, reconnecting from the last event seen."""
        last = last_event_id
        while True:
            headers = {"Last-Event-ID": str(last)} if last is not None else {}
            try:
                with self._http.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers, timeout=None) as r:
                    if r.status_code >= 400:
                        r.read()
                        raise_for_error(r)
                    parser = SSEParser()
                    for line in r.iter_lines():
                        if (event := parser.feed(line)) is not None:
                            last = event.id
                            yield event
                return
            except httpx.TransportError:
                continue  # the server went away mid-stream: reconnect from `last`

    def watch_job(self, job_id: str) -> Iterator[tuple[EventOut, JobProgress]]:
        """`stream_job` with the job's progress so far after each event (see `JobProgress`: no step twice)."""
        progress = JobProgress()
        for event in self.stream_job(job_id):
            progress.apply(event)
            yield event, progress

    # --- checkpoints
    def list_checkpoints(self, job_id: str) -> CheckpointList:
        return self._run(calls.list_checkpoints(job_id))

    def tinker_checkpoints(self, tinker_path: str) -> CheckpointList:
        """The checkpoints of a tinker:// path saved through the Tinker API (the last is what the path loads)."""
        return self._run(calls.tinker_checkpoints(tinker_path))

    def get_checkpoint(self, checkpoint_id: str) -> CheckpointOut:
        return self._run(calls.get_checkpoint(checkpoint_id))

    def download_checkpoint_file(self, checkpoint_id: str, path: str, dest: str | Path) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with self._http.stream("GET", f"/v1/checkpoints/{checkpoint_id}/files/{path}", timeout=None) as r:
            if r.status_code >= 400:
                r.read()
                raise_for_error(r)
            with dest.open("wb") as out:
                for chunk in r.iter_bytes(1 << 20):
                    out.write(chunk)
        return dest

    def download_checkpoint(self, checkpoint_id: str, dest_dir: str | Path) -> Path:
        """Download every manifest file of a checkpoint into dest_dir (ready for from_pretrained). Raises
        UnsafeCheckpointPath, before writing anything, if a listed path would land outside dest_dir."""
        dest_dir = Path(dest_dir)
        files = self.get_checkpoint(checkpoint_id).files
        targets = checkpoint_file_targets(dest_dir, [item.path for item in files])
        for item, target in zip(files, targets, strict=True):
            self.download_checkpoint_file(checkpoint_id, item.path, target)
        return dest_dir

    def download_checkpoint_archive(self, checkpoint_id: str, dest: str | Path) -> Path:
        dest = Path(dest)
        with self._http.stream("GET", f"/v1/checkpoints/{checkpoint_id}/archive", timeout=None) as r:
            if r.status_code >= 400:
                r.read()
                raise_for_error(r)
            with dest.open("wb") as out:
                for chunk in r.iter_bytes(1 << 20):
                    out.write(chunk)
        return dest

    # --- evaluations
    def create_evaluation(self, spec: EvaluationSpec | dict[str, Any]) -> EvaluationOut:
        """Evaluate a model on a dataset (docs/evaluations.md); runs on the workers like a job."""
        return self._run(calls.create_evaluation(spec))

    def list_evaluations(self, limit: int = 20, after: str | None = None) -> EvaluationList:
        return self._run(calls.list_evaluations(limit, after))

    def get_evaluation(self, evaluation_id: str) -> EvaluationOut:
        return self._run(calls.get_evaluation(evaluation_id))

    def list_evaluation_items(self, evaluation_id: str, limit: int = 100, after: int | None = None) -> EvaluationItemList:
        return self._run(calls.list_evaluation_items(evaluation_id, limit, after))

    def cancel_evaluation(self, evaluation_id: str) -> EvaluationOut:
        return self._run(calls.cancel_evaluation(evaluation_id))

    def resume_evaluation(self, evaluation_id: str) -> EvaluationOut:
        return self._run(calls.resume_evaluation(evaluation_id))

    def wait_evaluation(self, evaluation_id: str) -> EvaluationOut:
        """Block until the evaluation succeeds, fails or is cancelled (its job's event stream then closes)."""
        for _event in self.stream_job(evaluation_id):
            pass
        return self.get_evaluation(evaluation_id)

    def compare_evaluations(self, evaluation_a: str, evaluation_b: str, seed: int = 0) -> ComparisonOut:
        """b against a, paired over the items both scored: the difference, its interval, a paired test."""
        return self._run(calls.compare_evaluations(evaluation_a, evaluation_b, seed))

    # --- webhooks
    def create_webhook(self, url: str, description: str | None = None) -> WebhookWithSecret:
        return self._run(calls.create_webhook(url, description))

    def list_webhooks(self, limit: int = 20, after: str | None = None) -> WebhookList:
        return self._run(calls.list_webhooks(limit, after))

    def get_webhook(self, webhook_id: str) -> WebhookOut:
        return self._run(calls.get_webhook(webhook_id))

    def delete_webhook(self, webhook_id: str) -> None:
        self._run(calls.delete_webhook(webhook_id))

    def rotate_webhook_secret(self, webhook_id: str) -> WebhookWithSecret:
        """A new signing secret (shown once); deliveries carry both signatures until `previous_secret_expires_at`."""
        return self._run(calls.rotate_webhook_secret(webhook_id))

    def list_webhook_deliveries(self, webhook_id: str, limit: int = 20, after: int | None = None) -> DeliveryList:
        return self._run(calls.list_webhook_deliveries(webhook_id, limit, after))

    # --- API keys (an `admin` key)
    def create_api_key(
        self, name: str, scopes: list[str] | None = None, expires_at: datetime | None = None
    ) -> ApiKeyWithSecret:
        """A new key of your tenant; `.key` is the only time it is shown."""
        return self._run(calls.create_api_key(name, scopes, expires_at))

    def list_api_keys(self, limit: int = 20, after: str | None = None) -> ApiKeyList:
        return self._run(calls.list_api_keys(limit, after))

    def revoke_api_key(self, api_key_id: str) -> None:
        self._run(calls.revoke_api_key(api_key_id))

    # --- quotas (an `admin` key; another tenant's needs an operator tenant's key)
    def get_tenant_quotas(self, tenant_id: str) -> QuotasOut:
        return self._run(calls.get_tenant_quotas(tenant_id))

    def set_tenant_quotas(self, tenant_id: str, limits: QuotaLimits | dict[str, Any]) -> QuotasOut:
        """Replace the tenant's overrides (None in a field: the service default)."""
        return self._run(calls.set_tenant_quotas(tenant_id, limits))
