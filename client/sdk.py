"""Python client for the REST API (sync `GRPOClient` and async `AsyncGRPOClient`), typed with the API's own schemas.

Every endpoint is described once, as a `Call` built by a function in `_calls`; the two clients only differ in how
they send it. Idempotent calls (GET, and POST /v1/jobs, which always carries an Idempotency-Key) are retried on
connection errors, 429 and 502/503/504 with exponential backoff; others only on a 429 that carries Retry-After
(a rate limit: the request was refused before it ran). A Retry-After is honoured (waited, not guessed) up to
`max_retry_after` seconds; a longer one is returned as the APIError at once.

    client = GRPOClient("http://127.0.0.1:8000", api_key="grpo_sk_...")
    dataset = client.upload_dataset("train.jsonl")
    job = client.create_job({"base_model": "builtin:tiny", "train_dataset": dataset.id, ...})
    for event in client.stream_job(job.id): ...
    for event, progress in client.watch_job(job.id): print(progress.metrics)   # one entry per step
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from contract.api.api_keys import ApiKeyList, ApiKeyWithSecret
from contract.api.checkpoints import CheckpointList, CheckpointOut
from contract.api.datasets import DatasetList, DatasetOut
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
from contract.spec import JobBudget, JobSpec

T = TypeVar("T", bound=BaseModel)
RETRY_STATUSES = {429, 502, 503, 504}


class APIError(Exception):
    """An error answer from the API, with its stable code (error shape: docs/jobs-api.md)."""

    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details


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


class _Retryable(Exception):
    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


@dataclass
class Call(Generic[T]):
    """One HTTP request and the schema of its answer (None: no body expected)."""

    method: str
    path: str
    model: type[T] | None
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    idempotent: bool = False


def _params(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


class _calls:  # noqa: N801 - a namespace of request builders, one per endpoint
    @staticmethod
    def list_datasets(limit: int = 20, after: str | None = None) -> Call[DatasetList]:
        return Call("GET", "/v1/datasets", DatasetList, _params(limit=limit, after=after), idempotent=True)

    @staticmethod
    def get_dataset(dataset_id: str) -> Call[DatasetOut]:
        return Call("GET", f"/v1/datasets/{dataset_id}", DatasetOut, idempotent=True)

    @staticmethod
    def delete_dataset(dataset_id: str) -> Call[BaseModel]:
        return Call("DELETE", f"/v1/datasets/{dataset_id}", None)

    @staticmethod
    def register_reward_function(
        name: str,
        url: str,
        *,
        timeout_s: float | None = None,
        max_batch_size: int | None = None,
        max_concurrency: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> Call[RewardFunctionWithSecret]:
        body = _params(
            name=name, url=url, timeout_s=timeout_s, max_batch_size=max_batch_size,
            max_concurrency=max_concurrency, headers=headers,
        )
        return Call("POST", "/v1/reward-functions", RewardFunctionWithSecret, json=body)

    @staticmethod
    def list_reward_functions(limit: int = 20, after: str | None = None) -> Call[RewardFunctionList]:
        return Call(
            "GET", "/v1/reward-functions", RewardFunctionList, _params(limit=limit, after=after), idempotent=True
        )

    @staticmethod
    def get_reward_function(reward_function_id: str) -> Call[RewardFunctionOut]:
        return Call("GET", f"/v1/reward-functions/{reward_function_id}", RewardFunctionOut, idempotent=True)

    @staticmethod
    def delete_reward_function(reward_function_id: str) -> Call[BaseModel]:
        return Call("DELETE", f"/v1/reward-functions/{reward_function_id}", None)

    @staticmethod
    def rotate_reward_secret(reward_function_id: str) -> Call[RewardFunctionWithSecret]:
        return Call("POST", f"/v1/reward-functions/{reward_function_id}/rotate-secret", RewardFunctionWithSecret)

    @staticmethod
    def test_reward_function(reward_function_id: str, items: list[dict[str, Any]]) -> Call[RewardTestResult]:
        return Call(
            "POST", f"/v1/reward-functions/{reward_function_id}/test", RewardTestResult, json={"items": items}
        )

    @staticmethod
    def create_job(spec: JobSpec | dict[str, Any], idempotency_key: str | None = None) -> Call[JobOut]:
        body = spec.model_dump(mode="json", exclude_none=True) if isinstance(spec, JobSpec) else spec
        # A key is always sent, so retrying a create after a lost answer can never create a second job.
        key = idempotency_key or f"client-{uuid.uuid4()}"
        return Call("POST", "/v1/jobs", JobOut, json=body, headers={"Idempotency-Key": key}, idempotent=True)

    @staticmethod
    def list_jobs(status: str | None = None, limit: int = 20, after: str | None = None) -> Call[JobList]:
        return Call("GET", "/v1/jobs", JobList, _params(status=status, limit=limit, after=after), idempotent=True)

    @staticmethod
    def get_job(job_id: str) -> Call[JobOut]:
        return Call("GET", f"/v1/jobs/{job_id}", JobOut, idempotent=True)

    @staticmethod
    def delete_job(job_id: str) -> Call[BaseModel]:
        return Call("DELETE", f"/v1/jobs/{job_id}", None)

    @staticmethod
    def estimate_job(spec: JobSpec | dict[str, Any]) -> Call[Estimate]:
        body = spec.model_dump(mode="json", exclude_none=True) if isinstance(spec, JobSpec) else spec
        return Call("POST", "/v1/jobs/estimate", Estimate, json=body, idempotent=True)

    @staticmethod
    def set_job_budget(job_id: str, budget: JobBudget | dict[str, Any] | None) -> Call[JobOut]:
        value = budget.model_dump(mode="json", exclude_none=True) if isinstance(budget, JobBudget) else budget
        # Setting a value twice leaves the same state: safe to retry.
        return Call("PATCH", f"/v1/jobs/{job_id}", JobOut, json={"budget": value}, idempotent=True)

    @staticmethod
    def get_job_usage(job_id: str) -> Call[JobUsage]:
        return Call("GET", f"/v1/jobs/{job_id}/usage", JobUsage, idempotent=True)

    @staticmethod
    def get_usage(
        start: datetime | None = None, end: datetime | None = None, group_by: str = "day"
    ) -> Call[UsageReport]:
        params = _params(start=start and start.isoformat(), end=end and end.isoformat(), group_by=group_by)
        return Call("GET", "/v1/usage", UsageReport, params, idempotent=True)

    @staticmethod
    def job_action(job_id: str, action: str) -> Call[JobOut]:
        if action not in ("cancel", "pause", "resume"):
            raise ValueError(f"unknown job action {action!r}")
        return Call("POST", f"/v1/jobs/{job_id}/{action}", JobOut)

    @staticmethod
    def list_job_events(
        job_id: str, after: int | None = None, limit: int = 100, include_superseded: bool = False
    ) -> Call[EventList]:
        params = _params(after=after, limit=limit, include_superseded="true" if include_superseded else None)
        return Call(
            "GET", f"/v1/jobs/{job_id}/events", EventList, params, idempotent=True
        )

    @staticmethod
    def get_job_metrics(
        job_id: str, names: list[str] | None = None, since_step: int | None = None
    ) -> Call[MetricsOut]:
        params = _params(names=",".join(names) if names else None, since_step=since_step)
        return Call("GET", f"/v1/jobs/{job_id}/metrics", MetricsOut, params, idempotent=True)

    @staticmethod
    def list_job_samples(job_id: str, step: int | None = None, after: int | None = None) -> Call[SampleList]:
        return Call(
            "GET", f"/v1/jobs/{job_id}/samples", SampleList, _params(step=step, after=after), idempotent=True
        )

    @staticmethod
    def list_checkpoints(job_id: str) -> Call[CheckpointList]:
        return Call("GET", f"/v1/jobs/{job_id}/checkpoints", CheckpointList, idempotent=True)

    @staticmethod
    def get_checkpoint(checkpoint_id: str) -> Call[CheckpointOut]:
        return Call("GET", f"/v1/checkpoints/{checkpoint_id}", CheckpointOut, idempotent=True)

    @staticmethod
    def create_webhook(url: str, description: str | None = None) -> Call[WebhookWithSecret]:
        return Call("POST", "/v1/webhooks", WebhookWithSecret, json=_params(url=url, description=description))

    @staticmethod
    def list_webhooks(limit: int = 20, after: str | None = None) -> Call[WebhookList]:
        return Call("GET", "/v1/webhooks", WebhookList, _params(limit=limit, after=after), idempotent=True)

    @staticmethod
    def get_webhook(webhook_id: str) -> Call[WebhookOut]:
        return Call("GET", f"/v1/webhooks/{webhook_id}", WebhookOut, idempotent=True)

    @staticmethod
    def delete_webhook(webhook_id: str) -> Call[BaseModel]:
        return Call("DELETE", f"/v1/webhooks/{webhook_id}", None)

    @staticmethod
    def rotate_webhook_secret(webhook_id: str) -> Call[WebhookWithSecret]:
        return Call("POST", f"/v1/webhooks/{webhook_id}/rotate-secret", WebhookWithSecret)

    @staticmethod
    def list_webhook_deliveries(webhook_id: str, limit: int = 20, after: int | None = None) -> Call[DeliveryList]:
        return Call(
            "GET", f"/v1/webhooks/{webhook_id}/deliveries", DeliveryList, _params(limit=limit, after=after),
            idempotent=True,
        )

    @staticmethod
    def create_api_key(
        name: str, scopes: list[str] | None = None, expires_at: datetime | None = None
    ) -> Call[ApiKeyWithSecret]:
        body = _params(name=name, scopes=scopes, expires_at=expires_at.isoformat() if expires_at else None)
        return Call("POST", "/v1/api-keys", ApiKeyWithSecret, json=body)

    @staticmethod
    def list_api_keys(limit: int = 20, after: str | None = None) -> Call[ApiKeyList]:
        return Call("GET", "/v1/api-keys", ApiKeyList, _params(limit=limit, after=after), idempotent=True)

    @staticmethod
    def revoke_api_key(api_key_id: str) -> Call[BaseModel]:
        return Call("DELETE", f"/v1/api-keys/{api_key_id}", None)

    @staticmethod
    def get_tenant_quotas(tenant_id: str) -> Call[QuotasOut]:
        return Call("GET", f"/v1/admin/tenants/{tenant_id}/quotas", QuotasOut, idempotent=True)

    @staticmethod
    def set_tenant_quotas(tenant_id: str, limits: QuotaLimits | dict[str, Any]) -> Call[QuotasOut]:
        body = limits.model_dump(mode="json") if isinstance(limits, QuotaLimits) else limits
        # Replacing the overrides with the same values leaves the same state: safe to retry.
        return Call("PUT", f"/v1/admin/tenants/{tenant_id}/quotas", QuotasOut, json=body, idempotent=True)


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        error = response.json()["error"]
        raise APIError(response.status_code, error["code"], error["message"], error.get("details"))
    except (ValueError, KeyError, TypeError):
        raise APIError(response.status_code, "http_error", response.text[:500]) from None


def _parse(call: Call[T], response: httpx.Response) -> T:
    _raise_for_error(response)
    if call.model is None:
        return None  # type: ignore[return-value]
    return call.model.model_validate(response.json())


def retry_after_seconds(response: httpx.Response) -> float | None:
    """The response's Retry-After in seconds (delta-seconds or an HTTP date), or None."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def _needs_retry(call: Call[Any], response: httpx.Response) -> bool:
    """Whether a retry of `call` may help and is safe: a retryable status of an idempotent call, or a rate limit
    (429 with Retry-After) of any call."""
    if response.status_code not in RETRY_STATUSES:
        return False
    return call.idempotent or (response.status_code == 429 and "Retry-After" in response.headers)


class _RetryPolicy:
    """tenacity's retry predicate and wait for one call: Retry-After when the server sent one, else backoff."""

    def __init__(self, call: Call[Any], max_retry_after: float) -> None:
        self.call = call
        self.max_retry_after = max_retry_after
        self.backoff = wait_random_exponential(multiplier=0.5, max=8)

    def should_retry(self, exc: BaseException) -> bool:
        if isinstance(exc, _Retryable):
            after = retry_after_seconds(exc.response)
            return after is None or after <= self.max_retry_after
        return self.call.idempotent and isinstance(exc, httpx.TransportError)

    def wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, _Retryable) and (after := retry_after_seconds(exc.response)) is not None:
            return after
        return float(self.backoff(state))


def _settings(base_url: str | None, api_key: str | None) -> tuple[str, dict[str, str]]:
    url = base_url or os.environ.get("GRPO_API_URL", "http://127.0.0.1:8000")
    key = api_key or os.environ.get("GRPO_API_KEY")
    return url.rstrip("/"), ({"Authorization": f"Bearer {key}"} if key else {})


class _SSEParser:
    """Incremental Server-Sent Events parser: feed lines, get an event at each blank line. An `error` message
    (the server ends the stream with one when the API key is revoked or expires) raises APIError."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._type = ""

    def feed(self, line: str) -> EventOut | None:
        if line.startswith("data:"):
            self._data.append(line[5:].strip())
        elif line.startswith("event:"):
            self._type = line[6:].strip()
        elif line == "" and self._data:
            body, kind = json.loads("\n".join(self._data)), self._type
            self._data, self._type = [], ""
            if kind == "error":
                error = body["error"]
                raise APIError(401 if error["code"] == "unauthenticated" else 400, error["code"], error["message"],
                               error.get("details"))
            return EventOut.model_validate(body)
        return None


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
        url, headers = _settings(base_url, api_key)
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
        if _needs_retry(call, response):
            raise _Retryable(response)
        return response

    def _run(self, call: Call[T]) -> T:
        policy = _RetryPolicy(call, self._max_retry_after)
        retrying = Retrying(
            retry=retry_if_exception(policy.should_retry),
            wait=policy.wait,
            stop=stop_after_attempt(self._retries),
            reraise=True,
        )
        try:
            response = retrying(self._send, call)
        except _Retryable as exc:
            response = exc.response
        return _parse(call, response)

    # --- datasets
    def upload_dataset(self, path: str | Path, name: str | None = None) -> DatasetOut:
        path = Path(path)
        with path.open("rb") as handle:
            files = {"file": (path.name, handle, "application/x-ndjson")}
            response = self._http.post("/v1/datasets", files=files, data=_params(name=name))
        _raise_for_error(response)
        return DatasetOut.model_validate(response.json())

    def list_datasets(self, limit: int = 20, after: str | None = None) -> DatasetList:
        return self._run(_calls.list_datasets(limit, after))

    def get_dataset(self, dataset_id: str) -> DatasetOut:
        return self._run(_calls.get_dataset(dataset_id))

    def delete_dataset(self, dataset_id: str) -> None:
        self._run(_calls.delete_dataset(dataset_id))

    # --- reward functions
    def register_reward_function(self, name: str, url: str, **options: Any) -> RewardFunctionWithSecret:
        return self._run(_calls.register_reward_function(name, url, **options))

    def list_reward_functions(self, limit: int = 20, after: str | None = None) -> RewardFunctionList:
        return self._run(_calls.list_reward_functions(limit, after))

    def get_reward_function(self, reward_function_id: str) -> RewardFunctionOut:
        return self._run(_calls.get_reward_function(reward_function_id))

    def delete_reward_function(self, reward_function_id: str) -> None:
        self._run(_calls.delete_reward_function(reward_function_id))

    def rotate_reward_secret(self, reward_function_id: str) -> RewardFunctionWithSecret:
        return self._run(_calls.rotate_reward_secret(reward_function_id))

    def test_reward_function(self, reward_function_id: str, items: list[dict[str, Any]]) -> RewardTestResult:
        return self._run(_calls.test_reward_function(reward_function_id, items))

    # --- jobs
    def create_job(self, spec: JobSpec | dict[str, Any], idempotency_key: str | None = None) -> JobOut:
        return self._run(_calls.create_job(spec, idempotency_key))

    def list_jobs(self, status: str | None = None, limit: int = 20, after: str | None = None) -> JobList:
        return self._run(_calls.list_jobs(status, limit, after))

    def get_job(self, job_id: str) -> JobOut:
        return self._run(_calls.get_job(job_id))

    def cancel_job(self, job_id: str) -> JobOut:
        return self._run(_calls.job_action(job_id, "cancel"))

    def pause_job(self, job_id: str) -> JobOut:
        return self._run(_calls.job_action(job_id, "pause"))

    def resume_job(self, job_id: str) -> JobOut:
        return self._run(_calls.job_action(job_id, "resume"))

    def delete_job(self, job_id: str) -> None:
        """Delete a finished job and its checkpoints (files included)."""
        self._run(_calls.delete_job(job_id))

    # --- usage and budgets
    def estimate_job(self, spec: JobSpec | dict[str, Any]) -> Estimate:
        """Expected steps, tokens and device-seconds of a spec; nothing is created."""
        return self._run(_calls.estimate_job(spec))

    def set_job_budget(self, job_id: str, budget: JobBudget | dict[str, Any] | None) -> JobOut:
        """Replace a job's budget (None removes it); then `resume_job` a job paused with budget_exhausted."""
        return self._run(_calls.set_job_budget(job_id, budget))

    def get_job_usage(self, job_id: str) -> JobUsage:
        return self._run(_calls.get_job_usage(job_id))

    def get_usage(
        self, start: datetime | None = None, end: datetime | None = None, group_by: str = "day"
    ) -> UsageReport:
        """Your usage in [start, end) (default: this UTC month), by `day` or by `job`."""
        return self._run(_calls.get_usage(start, end, group_by))

    def list_job_events(
        self, job_id: str, after: int | None = None, limit: int = 100, include_superseded: bool = False
    ) -> EventList:
        return self._run(_calls.list_job_events(job_id, after, limit, include_superseded))

    def get_job_metrics(
        self, job_id: str, names: list[str] | None = None, since_step: int | None = None
    ) -> MetricsOut:
        return self._run(_calls.get_job_metrics(job_id, names, since_step))

    def list_job_samples(self, job_id: str, step: int | None = None, after: int | None = None) -> SampleList:
        return self._run(_calls.list_job_samples(job_id, step, after))

    def get_job_plot(self, job_id: str) -> bytes:
        """The training curves as PNG bytes (GET /v1/jobs/{id}/plot.png)."""
        response = self._http.get(f"/v1/jobs/{job_id}/plot.png")
        _raise_for_error(response)
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
                        _raise_for_error(r)
                    parser = _SSEParser()
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
        return self._run(_calls.list_checkpoints(job_id))

    def get_checkpoint(self, checkpoint_id: str) -> CheckpointOut:
        return self._run(_calls.get_checkpoint(checkpoint_id))

    def download_checkpoint_file(self, checkpoint_id: str, path: str, dest: str | Path) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with self._http.stream("GET", f"/v1/checkpoints/{checkpoint_id}/files/{path}", timeout=None) as r:
            if r.status_code >= 400:
                r.read()
                _raise_for_error(r)
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
                _raise_for_error(r)
            with dest.open("wb") as out:
                for chunk in r.iter_bytes(1 << 20):
                    out.write(chunk)
        return dest

    # --- webhooks
    def create_webhook(self, url: str, description: str | None = None) -> WebhookWithSecret:
        return self._run(_calls.create_webhook(url, description))

    def list_webhooks(self, limit: int = 20, after: str | None = None) -> WebhookList:
        return self._run(_calls.list_webhooks(limit, after))

    def get_webhook(self, webhook_id: str) -> WebhookOut:
        return self._run(_calls.get_webhook(webhook_id))

    def delete_webhook(self, webhook_id: str) -> None:
        self._run(_calls.delete_webhook(webhook_id))

    def rotate_webhook_secret(self, webhook_id: str) -> WebhookWithSecret:
        """A new signing secret (shown once); deliveries carry both signatures until `previous_secret_expires_at`."""
        return self._run(_calls.rotate_webhook_secret(webhook_id))

    def list_webhook_deliveries(self, webhook_id: str, limit: int = 20, after: int | None = None) -> DeliveryList:
        return self._run(_calls.list_webhook_deliveries(webhook_id, limit, after))

    # --- API keys (an `admin` key)
    def create_api_key(
        self, name: str, scopes: list[str] | None = None, expires_at: datetime | None = None
    ) -> ApiKeyWithSecret:
        """A new key of your tenant; `.key` is the only time it is shown."""
        return self._run(_calls.create_api_key(name, scopes, expires_at))

    def list_api_keys(self, limit: int = 20, after: str | None = None) -> ApiKeyList:
        return self._run(_calls.list_api_keys(limit, after))

    def revoke_api_key(self, api_key_id: str) -> None:
        self._run(_calls.revoke_api_key(api_key_id))

    # --- quotas (an `admin` key; another tenant's needs an operator tenant's key)
    def get_tenant_quotas(self, tenant_id: str) -> QuotasOut:
        return self._run(_calls.get_tenant_quotas(tenant_id))

    def set_tenant_quotas(self, tenant_id: str, limits: QuotaLimits | dict[str, Any]) -> QuotasOut:
        """Replace the tenant's overrides (None in a field: the service default)."""
        return self._run(_calls.set_tenant_quotas(tenant_id, limits))


class AsyncGRPOClient:
    """Asynchronous client with the same API calls as GRPOClient (upload, streaming and single-file download included)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 4,
        max_retry_after: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`transport` replaces httpx's network transport (e.g. httpx.ASGITransport(app) in tests)."""
        url, headers = _settings(base_url, api_key)
        self._http = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, transport=transport)
        self._retries = retries
        self._max_retry_after = max_retry_after

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncGRPOClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def _send(self, call: Call[T]) -> httpx.Response:
        response = await self._http.request(
            call.method, call.path, params=call.params, json=call.json, headers=call.headers
        )
        if _needs_retry(call, response):
            raise _Retryable(response)
        return response

    async def _run(self, call: Call[T]) -> T:
        policy = _RetryPolicy(call, self._max_retry_after)
        retrying = AsyncRetrying(
            retry=retry_if_exception(policy.should_retry),
            wait=policy.wait,
            stop=stop_after_attempt(self._retries),
            reraise=True,
        )
        response: httpx.Response
        try:
            response = await retrying(self._send, call)
        except _Retryable as exc:
            response = exc.response
        return _parse(call, response)

    async def upload_dataset(self, path: str | Path, name: str | None = None) -> DatasetOut:
        path = Path(path)
        with path.open("rb") as handle:
            files = {"file": (path.name, handle, "application/x-ndjson")}
            response = await self._http.post("/v1/datasets", files=files, data=_params(name=name))
        _raise_for_error(response)
        return DatasetOut.model_validate(response.json())

    async def list_datasets(self, limit: int = 20, after: str | None = None) -> DatasetList:
        return await self._run(_calls.list_datasets(limit, after))

    async def get_dataset(self, dataset_id: str) -> DatasetOut:
        return await self._run(_calls.get_dataset(dataset_id))

    async def delete_dataset(self, dataset_id: str) -> None:
        await self._run(_calls.delete_dataset(dataset_id))

    async def register_reward_function(self, name: str, url: str, **options: Any) -> RewardFunctionWithSecret:
        return await self._run(_calls.register_reward_function(name, url, **options))

    async def list_reward_functions(self, limit: int = 20, after: str | None = None) -> RewardFunctionList:
        return await self._run(_calls.list_reward_functions(limit, after))

    async def get_reward_function(self, reward_function_id: str) -> RewardFunctionOut:
        return await self._run(_calls.get_reward_function(reward_function_id))

    async def delete_reward_function(self, reward_function_id: str) -> None:
        await self._run(_calls.delete_reward_function(reward_function_id))

    async def rotate_reward_secret(self, reward_function_id: str) -> RewardFunctionWithSecret:
        return await self._run(_calls.rotate_reward_secret(reward_function_id))

    async def test_reward_function(
        self, reward_function_id: str, items: list[dict[str, Any]]
    ) -> RewardTestResult:
        return await self._run(_calls.test_reward_function(reward_function_id, items))

    async def create_job(self, spec: JobSpec | dict[str, Any], idempotency_key: str | None = None) -> JobOut:
        return await self._run(_calls.create_job(spec, idempotency_key))

    async def list_jobs(self, status: str | None = None, limit: int = 20, after: str | None = None) -> JobList:
        return await self._run(_calls.list_jobs(status, limit, after))

    async def get_job(self, job_id: str) -> JobOut:
        return await self._run(_calls.get_job(job_id))

    async def cancel_job(self, job_id: str) -> JobOut:
        return await self._run(_calls.job_action(job_id, "cancel"))

    async def pause_job(self, job_id: str) -> JobOut:
        return await self._run(_calls.job_action(job_id, "pause"))

    async def resume_job(self, job_id: str) -> JobOut:
        return await self._run(_calls.job_action(job_id, "resume"))

    async def delete_job(self, job_id: str) -> None:
        await self._run(_calls.delete_job(job_id))

    async def estimate_job(self, spec: JobSpec | dict[str, Any]) -> Estimate:
        return await self._run(_calls.estimate_job(spec))

    async def set_job_budget(self, job_id: str, budget: JobBudget | dict[str, Any] | None) -> JobOut:
        return await self._run(_calls.set_job_budget(job_id, budget))

    async def get_job_usage(self, job_id: str) -> JobUsage:
        return await self._run(_calls.get_job_usage(job_id))

    async def get_usage(
        self, start: datetime | None = None, end: datetime | None = None, group_by: str = "day"
    ) -> UsageReport:
        return await self._run(_calls.get_usage(start, end, group_by))

    async def list_job_events(
        self, job_id: str, after: int | None = None, limit: int = 100, include_superseded: bool = False
    ) -> EventList:
        return await self._run(_calls.list_job_events(job_id, after, limit, include_superseded))

    async def get_job_metrics(
        self, job_id: str, names: list[str] | None = None, since_step: int | None = None
    ) -> MetricsOut:
        return await self._run(_calls.get_job_metrics(job_id, names, since_step))

    async def list_job_samples(
        self, job_id: str, step: int | None = None, after: int | None = None
    ) -> SampleList:
        return await self._run(_calls.list_job_samples(job_id, step, after))

    async def get_job_plot(self, job_id: str) -> bytes:
        response = await self._http.get(f"/v1/jobs/{job_id}/plot.png")
        _raise_for_error(response)
        return response.content

    async def stream_job(self, job_id: str, last_event_id: int | None = None) -> AsyncIterator[EventOut]:
        last = last_event_id
        while True:
            headers = {"Last-Event-ID": str(last)} if last is not None else {}
            try:
                async with self._http.stream(
                    "GET", f"/v1/jobs/{job_id}/stream", headers=headers, timeout=None
                ) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        _raise_for_error(r)
                    parser = _SSEParser()
                    async for line in r.aiter_lines():
                        if (event := parser.feed(line)) is not None:
                            last = event.id
                            yield event
                return
            except httpx.TransportError:
                continue

    async def watch_job(self, job_id: str) -> AsyncIterator[tuple[EventOut, JobProgress]]:
        """`stream_job` with the job's progress so far after each event (see `JobProgress`: no step twice)."""
        progress = JobProgress()
        async for event in self.stream_job(job_id):
            progress.apply(event)
            yield event, progress

    async def list_checkpoints(self, job_id: str) -> CheckpointList:
        return await self._run(_calls.list_checkpoints(job_id))

    async def get_checkpoint(self, checkpoint_id: str) -> CheckpointOut:
        return await self._run(_calls.get_checkpoint(checkpoint_id))

    async def download_checkpoint_file(self, checkpoint_id: str, path: str, dest: str | Path) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        async with self._http.stream("GET", f"/v1/checkpoints/{checkpoint_id}/files/{path}", timeout=None) as r:
            if r.status_code >= 400:
                await r.aread()
                _raise_for_error(r)
            with dest.open("wb") as out:
                async for chunk in r.aiter_bytes(1 << 20):
                    out.write(chunk)
        return dest

    async def download_checkpoint(self, checkpoint_id: str, dest_dir: str | Path) -> Path:
        """As GRPOClient.download_checkpoint (UnsafeCheckpointPath before anything is written)."""
        dest_dir = Path(dest_dir)
        files = (await self.get_checkpoint(checkpoint_id)).files
        targets = checkpoint_file_targets(dest_dir, [item.path for item in files])
        for item, target in zip(files, targets, strict=True):
            await self.download_checkpoint_file(checkpoint_id, item.path, target)
        return dest_dir

    async def download_checkpoint_archive(self, checkpoint_id: str, dest: str | Path) -> Path:
        dest = Path(dest)
        async with self._http.stream("GET", f"/v1/checkpoints/{checkpoint_id}/archive", timeout=None) as r:
            if r.status_code >= 400:
                await r.aread()
                _raise_for_error(r)
            with dest.open("wb") as out:
                async for chunk in r.aiter_bytes(1 << 20):
                    out.write(chunk)
        return dest

    async def create_webhook(self, url: str, description: str | None = None) -> WebhookWithSecret:
        return await self._run(_calls.create_webhook(url, description))

    async def list_webhooks(self, limit: int = 20, after: str | None = None) -> WebhookList:
        return await self._run(_calls.list_webhooks(limit, after))

    async def get_webhook(self, webhook_id: str) -> WebhookOut:
        return await self._run(_calls.get_webhook(webhook_id))

    async def delete_webhook(self, webhook_id: str) -> None:
        await self._run(_calls.delete_webhook(webhook_id))

    async def rotate_webhook_secret(self, webhook_id: str) -> WebhookWithSecret:
        """A new signing secret (shown once); deliveries carry both signatures until `previous_secret_expires_at`."""
        return await self._run(_calls.rotate_webhook_secret(webhook_id))

    async def list_webhook_deliveries(
        self, webhook_id: str, limit: int = 20, after: int | None = None
    ) -> DeliveryList:
        return await self._run(_calls.list_webhook_deliveries(webhook_id, limit, after))

    # --- API keys (an `admin` key)
    async def create_api_key(
        self, name: str, scopes: list[str] | None = None, expires_at: datetime | None = None
    ) -> ApiKeyWithSecret:
        """A new key of your tenant; `.key` is the only time it is shown."""
        return await self._run(_calls.create_api_key(name, scopes, expires_at))

    async def list_api_keys(self, limit: int = 20, after: str | None = None) -> ApiKeyList:
        return await self._run(_calls.list_api_keys(limit, after))

    async def revoke_api_key(self, api_key_id: str) -> None:
        await self._run(_calls.revoke_api_key(api_key_id))

    # --- quotas (an `admin` key; another tenant's needs an operator tenant's key)
    async def get_tenant_quotas(self, tenant_id: str) -> QuotasOut:
        return await self._run(_calls.get_tenant_quotas(tenant_id))

    async def set_tenant_quotas(self, tenant_id: str, limits: QuotaLimits | dict[str, Any]) -> QuotasOut:
        """Replace the tenant's overrides (None in a field: the service default)."""
        return await self._run(_calls.set_tenant_quotas(tenant_id, limits))
