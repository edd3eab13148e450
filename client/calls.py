"""Every REST endpoint described once, as a `Call` (method, path, query, body, the schema of the answer, and
whether a retry is safe) built by a function of `calls`; the clients (client.sdk, client.async_sdk) only differ in
how they send it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from contract.api.api_keys import ApiKeyList, ApiKeyWithSecret
from contract.api.checkpoints import CheckpointList, CheckpointOut
from contract.api.datasets import DatasetList, DatasetOut
from contract.api.environments import EnvironmentList, EnvironmentOut, EnvironmentWithSecret
from contract.api.evaluations import ComparisonOut, EvaluationItemList, EvaluationList, EvaluationOut
from contract.api.jobs import EventList, JobList, JobOut, MetricsOut, SampleList
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

T = TypeVar("T", bound=BaseModel)


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


def query_params(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


class calls:  # noqa: N801 - a namespace of request builders, one per endpoint
    @staticmethod
    def list_datasets(limit: int = 20, after: str | None = None) -> Call[DatasetList]:
        return Call("GET", "/v1/datasets", DatasetList, query_params(limit=limit, after=after), idempotent=True)

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
        body = query_params(
            name=name, url=url, timeout_s=timeout_s, max_batch_size=max_batch_size,
            max_concurrency=max_concurrency, headers=headers,
        )
        return Call("POST", "/v1/reward-functions", RewardFunctionWithSecret, json=body)

    @staticmethod
    def list_reward_functions(limit: int = 20, after: str | None = None) -> Call[RewardFunctionList]:
        return Call(
            "GET", "/v1/reward-functions", RewardFunctionList, query_params(limit=limit, after=after), idempotent=True
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
    def register_environment(name: str, url: str, **options: Any) -> Call[EnvironmentWithSecret]:
        """`options`: max_concurrency, step_timeout_s, episode_timeout_s, max_attempts, backoff_s,
        breaker_threshold, headers (POST /v1/environments); unset ones take the server's defaults."""
        body = query_params(name=name, url=url, **options)
        return Call("POST", "/v1/environments", EnvironmentWithSecret, json=body)

    @staticmethod
    def list_environments(limit: int = 20, after: str | None = None) -> Call[EnvironmentList]:
        return Call("GET", "/v1/environments", EnvironmentList, query_params(limit=limit, after=after), idempotent=True)

    @staticmethod
    def get_environment(environment_id: str) -> Call[EnvironmentOut]:
        return Call("GET", f"/v1/environments/{environment_id}", EnvironmentOut, idempotent=True)

    @staticmethod
    def check_environment(environment_id: str) -> Call[EnvironmentOut]:
        return Call("POST", f"/v1/environments/{environment_id}/check", EnvironmentOut, idempotent=True)

    @staticmethod
    def delete_environment(environment_id: str) -> Call[BaseModel]:
        return Call("DELETE", f"/v1/environments/{environment_id}", None)

    @staticmethod
    def rotate_environment_secret(environment_id: str) -> Call[EnvironmentWithSecret]:
        return Call("POST", f"/v1/environments/{environment_id}/rotate-secret", EnvironmentWithSecret)

    @staticmethod
    def create_job(spec: JobSpec | dict[str, Any], idempotency_key: str | None = None) -> Call[JobOut]:
        body = spec.model_dump(mode="json", exclude_none=True) if isinstance(spec, JobSpec) else spec
        # A key is always sent, so retrying a create after a lost answer can never create a second job.
        key = idempotency_key or f"client-{uuid.uuid4()}"
        return Call("POST", "/v1/jobs", JobOut, json=body, headers={"Idempotency-Key": key}, idempotent=True)

    @staticmethod
    def list_jobs(status: str | None = None, limit: int = 20, after: str | None = None) -> Call[JobList]:
        return Call("GET", "/v1/jobs", JobList, query_params(status=status, limit=limit, after=after), idempotent=True)

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
        params = query_params(start=start and start.isoformat(), end=end and end.isoformat(), group_by=group_by)
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
        params = query_params(after=after, limit=limit, include_superseded="true" if include_superseded else None)
        return Call(
            "GET", f"/v1/jobs/{job_id}/events", EventList, params, idempotent=True
        )

    @staticmethod
    def get_job_metrics(
        job_id: str, names: list[str] | None = None, since_step: int | None = None
    ) -> Call[MetricsOut]:
        params = query_params(names=",".join(names) if names else None, since_step=since_step)
        return Call("GET", f"/v1/jobs/{job_id}/metrics", MetricsOut, params, idempotent=True)

    @staticmethod
    def list_job_samples(job_id: str, step: int | None = None, after: int | None = None) -> Call[SampleList]:
        return Call(
            "GET", f"/v1/jobs/{job_id}/samples", SampleList, query_params(step=step, after=after), idempotent=True
        )

    @staticmethod
    def list_checkpoints(job_id: str) -> Call[CheckpointList]:
        return Call("GET", f"/v1/jobs/{job_id}/checkpoints", CheckpointList, idempotent=True)

    @staticmethod
    def tinker_checkpoints(tinker_path: str) -> Call[CheckpointList]:
        """The checkpoints of weights saved through the Tinker API as `tinker_path` (tinker://...), oldest first."""
        return Call("GET", "/v1/checkpoints", CheckpointList, query_params(tinker_path=tinker_path), idempotent=True)

    @staticmethod
    def get_checkpoint(checkpoint_id: str) -> Call[CheckpointOut]:
        return Call("GET", f"/v1/checkpoints/{checkpoint_id}", CheckpointOut, idempotent=True)

    @staticmethod
    def create_webhook(url: str, description: str | None = None) -> Call[WebhookWithSecret]:
        return Call("POST", "/v1/webhooks", WebhookWithSecret, json=query_params(url=url, description=description))

    @staticmethod
    def list_webhooks(limit: int = 20, after: str | None = None) -> Call[WebhookList]:
        return Call("GET", "/v1/webhooks", WebhookList, query_params(limit=limit, after=after), idempotent=True)

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
            "GET", f"/v1/webhooks/{webhook_id}/deliveries", DeliveryList, query_params(limit=limit, after=after),
            idempotent=True,
        )

    @staticmethod
    def create_api_key(
        name: str, scopes: list[str] | None = None, expires_at: datetime | None = None
    ) -> Call[ApiKeyWithSecret]:
        body = query_params(name=name, scopes=scopes, expires_at=expires_at.isoformat() if expires_at else None)
        return Call("POST", "/v1/api-keys", ApiKeyWithSecret, json=body)

    @staticmethod
    def list_api_keys(limit: int = 20, after: str | None = None) -> Call[ApiKeyList]:
        return Call("GET", "/v1/api-keys", ApiKeyList, query_params(limit=limit, after=after), idempotent=True)

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

    # --- evaluations ---------------------------------------------------------------------------------

    @staticmethod
    def create_evaluation(spec: EvaluationSpec | dict[str, Any]) -> Call[EvaluationOut]:
        body = spec.model_dump(mode="json", exclude_none=True) if isinstance(spec, EvaluationSpec) else spec
        return Call("POST", "/v1/evaluations", EvaluationOut, json=body)

    @staticmethod
    def list_evaluations(limit: int = 20, after: str | None = None) -> Call[EvaluationList]:
        return Call("GET", "/v1/evaluations", EvaluationList, query_params(limit=limit, after=after), idempotent=True)

    @staticmethod
    def get_evaluation(evaluation_id: str) -> Call[EvaluationOut]:
        return Call("GET", f"/v1/evaluations/{evaluation_id}", EvaluationOut, idempotent=True)

    @staticmethod
    def list_evaluation_items(
        evaluation_id: str, limit: int = 100, after: int | None = None
    ) -> Call[EvaluationItemList]:
        params = query_params(limit=limit, after=after)
        return Call("GET", f"/v1/evaluations/{evaluation_id}/items", EvaluationItemList, params, idempotent=True)

    @staticmethod
    def cancel_evaluation(evaluation_id: str) -> Call[EvaluationOut]:
        return Call("POST", f"/v1/evaluations/{evaluation_id}/cancel", EvaluationOut)

    @staticmethod
    def resume_evaluation(evaluation_id: str) -> Call[EvaluationOut]:
        return Call("POST", f"/v1/evaluations/{evaluation_id}/resume", EvaluationOut)

    @staticmethod
    def compare_evaluations(evaluation_a: str, evaluation_b: str, seed: int = 0) -> Call[ComparisonOut]:
        body = {"evaluation_a": evaluation_a, "evaluation_b": evaluation_b, "seed": seed}
        return Call("POST", "/v1/evaluations/compare", ComparisonOut, json=body, idempotent=True)
