"""The asynchronous Python client for the REST API: `AsyncGRPOClient`, the same calls as client.sdk's
`GRPOClient` (see its docstring) sent with httpx's AsyncClient."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt

from client.calls import Call, T, calls, query_params
from client.http import (
    Retryable,
    RetryPolicy,
    SSEParser,
    connection_settings,
    needs_retry,
    parse_answer,
    raise_for_error,
)
from client.sdk import JobProgress, checkpoint_file_targets
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
        url, headers = connection_settings(base_url, api_key)
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
        if needs_retry(call, response):
            raise Retryable(response)
        return response

    async def _run(self, call: Call[T]) -> T:
        policy = RetryPolicy(call, self._max_retry_after)
        retrying = AsyncRetrying(
            retry=retry_if_exception(policy.should_retry),
            wait=policy.wait,
            stop=stop_after_attempt(self._retries),
            reraise=True,
        )
        response: httpx.Response
        try:
            response = await retrying(self._send, call)
        except Retryable as exc:
            response = exc.response
        return parse_answer(call, response)

    async def upload_dataset(self, path: str | Path, name: str | None = None) -> DatasetOut:
        path = Path(path)
        with path.open("rb") as handle:
            files = {"file": (path.name, handle, "application/x-ndjson")}
            response = await self._http.post("/v1/datasets", files=files, data=query_params(name=name))
        raise_for_error(response)
        return DatasetOut.model_validate(response.json())

    async def list_datasets(self, limit: int = 20, after: str | None = None) -> DatasetList:
        return await self._run(calls.list_datasets(limit, after))

    async def get_dataset(self, dataset_id: str) -> DatasetOut:
        return await self._run(calls.get_dataset(dataset_id))

    async def delete_dataset(self, dataset_id: str) -> None:
        await self._run(calls.delete_dataset(dataset_id))

    async def register_environment(self, name: str, url: str, **options: Any) -> EnvironmentWithSecret:
        return await self._run(calls.register_environment(name, url, **options))

    async def list_environments(self, limit: int = 20, after: str | None = None) -> EnvironmentList:
        return await self._run(calls.list_environments(limit, after))

    async def get_environment(self, environment_id: str) -> EnvironmentOut:
        return await self._run(calls.get_environment(environment_id))

    async def check_environment(self, environment_id: str) -> EnvironmentOut:
        return await self._run(calls.check_environment(environment_id))

    async def delete_environment(self, environment_id: str) -> None:
        await self._run(calls.delete_environment(environment_id))

    async def rotate_environment_secret(self, environment_id: str) -> EnvironmentWithSecret:
        return await self._run(calls.rotate_environment_secret(environment_id))

    async def register_reward_function(self, name: str, url: str, **options: Any) -> RewardFunctionWithSecret:
        return await self._run(calls.register_reward_function(name, url, **options))

    async def list_reward_functions(self, limit: int = 20, after: str | None = None) -> RewardFunctionList:
        return await self._run(calls.list_reward_functions(limit, after))

    async def get_reward_function(self, reward_function_id: str) -> RewardFunctionOut:
        return await self._run(calls.get_reward_function(reward_function_id))

    async def delete_reward_function(self, reward_function_id: str) -> None:
        await self._run(calls.delete_reward_function(reward_function_id))

    async def rotate_reward_secret(self, reward_function_id: str) -> RewardFunctionWithSecret:
        return await self._run(calls.rotate_reward_secret(reward_function_id))

    async def test_reward_function(
        self, reward_function_id: str, items: list[dict[str, Any]]
    ) -> RewardTestResult:
        return await self._run(calls.test_reward_function(reward_function_id, items))

    async def create_job(self, spec: JobSpec | dict[str, Any], idempotency_key: str | None = None) -> JobOut:
        return await self._run(calls.create_job(spec, idempotency_key))

    async def list_jobs(self, status: str | None = None, limit: int = 20, after: str | None = None) -> JobList:
        return await self._run(calls.list_jobs(status, limit, after))

    async def get_job(self, job_id: str) -> JobOut:
        return await self._run(calls.get_job(job_id))

    async def cancel_job(self, job_id: str) -> JobOut:
        return await self._run(calls.job_action(job_id, "cancel"))

    async def pause_job(self, job_id: str) -> JobOut:
        return await self._run(calls.job_action(job_id, "pause"))

    async def resume_job(self, job_id: str) -> JobOut:
        return await self._run(calls.job_action(job_id, "resume"))

    async def delete_job(self, job_id: str) -> None:
        await self._run(calls.delete_job(job_id))

    async def estimate_job(self, spec: JobSpec | dict[str, Any]) -> Estimate:
        return await self._run(calls.estimate_job(spec))

    async def set_job_budget(self, job_id: str, budget: JobBudget | dict[str, Any] | None) -> JobOut:
        return await self._run(calls.set_job_budget(job_id, budget))

    async def get_job_usage(self, job_id: str) -> JobUsage:
        return await self._run(calls.get_job_usage(job_id))

    async def get_usage(
        self, start: datetime | None = None, end: datetime | None = None, group_by: str = "day"
    ) -> UsageReport:
        return await self._run(calls.get_usage(start, end, group_by))

    async def list_job_events(
        self, job_id: str, after: int | None = None, limit: int = 100, include_superseded: bool = False
    ) -> EventList:
        return await self._run(calls.list_job_events(job_id, after, limit, include_superseded))

    async def get_job_metrics(
        self, job_id: str, names: list[str] | None = None, since_step: int | None = None
    ) -> MetricsOut:
        return await self._run(calls.get_job_metrics(job_id, names, since_step))

    async def list_job_samples(
        self, job_id: str, step: int | None = None, after: int | None = None
    ) -> SampleList:
        return await self._run(calls.list_job_samples(job_id, step, after))

    async def get_job_plot(self, job_id: str) -> bytes:
        response = await self._http.get(f"/v1/jobs/{job_id}/plot.png")
        raise_for_error(response)
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
                        raise_for_error(r)
                    parser = SSEParser()
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
        return await self._run(calls.list_checkpoints(job_id))

    async def tinker_checkpoints(self, tinker_path: str) -> CheckpointList:
        return await self._run(calls.tinker_checkpoints(tinker_path))

    async def get_checkpoint(self, checkpoint_id: str) -> CheckpointOut:
        return await self._run(calls.get_checkpoint(checkpoint_id))

    async def download_checkpoint_file(self, checkpoint_id: str, path: str, dest: str | Path) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        async with self._http.stream("GET", f"/v1/checkpoints/{checkpoint_id}/files/{path}", timeout=None) as r:
            if r.status_code >= 400:
                await r.aread()
                raise_for_error(r)
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
                raise_for_error(r)
            with dest.open("wb") as out:
                async for chunk in r.aiter_bytes(1 << 20):
                    out.write(chunk)
        return dest

    async def create_webhook(self, url: str, description: str | None = None) -> WebhookWithSecret:
        return await self._run(calls.create_webhook(url, description))

    async def list_webhooks(self, limit: int = 20, after: str | None = None) -> WebhookList:
        return await self._run(calls.list_webhooks(limit, after))

    async def get_webhook(self, webhook_id: str) -> WebhookOut:
        return await self._run(calls.get_webhook(webhook_id))

    async def delete_webhook(self, webhook_id: str) -> None:
        await self._run(calls.delete_webhook(webhook_id))

    async def rotate_webhook_secret(self, webhook_id: str) -> WebhookWithSecret:
        """A new signing secret (shown once); deliveries carry both signatures until `previous_secret_expires_at`."""
        return await self._run(calls.rotate_webhook_secret(webhook_id))

    async def list_webhook_deliveries(
        self, webhook_id: str, limit: int = 20, after: int | None = None
    ) -> DeliveryList:
        return await self._run(calls.list_webhook_deliveries(webhook_id, limit, after))

    # --- evaluations
    async def create_evaluation(self, spec: EvaluationSpec | dict[str, Any]) -> EvaluationOut:
        """Evaluate a model on a dataset (docs/evaluations.md); runs on the workers like a job."""
        return await self._run(calls.create_evaluation(spec))

    async def list_evaluations(self, limit: int = 20, after: str | None = None) -> EvaluationList:
        return await self._run(calls.list_evaluations(limit, after))

    async def get_evaluation(self, evaluation_id: str) -> EvaluationOut:
        return await self._run(calls.get_evaluation(evaluation_id))

    async def list_evaluation_items(self, evaluation_id: str, limit: int = 100, after: int | None = None) -> EvaluationItemList:
        return await self._run(calls.list_evaluation_items(evaluation_id, limit, after))

    async def cancel_evaluation(self, evaluation_id: str) -> EvaluationOut:
        return await self._run(calls.cancel_evaluation(evaluation_id))

    async def resume_evaluation(self, evaluation_id: str) -> EvaluationOut:
        return await self._run(calls.resume_evaluation(evaluation_id))

    async def wait_evaluation(self, evaluation_id: str) -> EvaluationOut:
        """Block until the evaluation succeeds, fails or is cancelled (its job's event stream then closes)."""
        async for _event in self.stream_job(evaluation_id):
            pass
        return await self.get_evaluation(evaluation_id)

    async def compare_evaluations(self, evaluation_a: str, evaluation_b: str, seed: int = 0) -> ComparisonOut:
        """b against a, paired over the items both scored: the difference, its interval, a paired test."""
        return await self._run(calls.compare_evaluations(evaluation_a, evaluation_b, seed))

    # --- API keys (an `admin` key)
    async def create_api_key(
        self, name: str, scopes: list[str] | None = None, expires_at: datetime | None = None
    ) -> ApiKeyWithSecret:
        """A new key of your tenant; `.key` is the only time it is shown."""
        return await self._run(calls.create_api_key(name, scopes, expires_at))

    async def list_api_keys(self, limit: int = 20, after: str | None = None) -> ApiKeyList:
        return await self._run(calls.list_api_keys(limit, after))

    async def revoke_api_key(self, api_key_id: str) -> None:
        await self._run(calls.revoke_api_key(api_key_id))

    # --- quotas (an `admin` key; another tenant's needs an operator tenant's key)
    async def get_tenant_quotas(self, tenant_id: str) -> QuotasOut:
        return await self._run(calls.get_tenant_quotas(tenant_id))

    async def set_tenant_quotas(self, tenant_id: str, limits: QuotaLimits | dict[str, Any]) -> QuotasOut:
        """Replace the tenant's overrides (None in a field: the service default)."""
        return await self._run(calls.set_tenant_quotas(tenant_id, limits))
