"""Every domain operation is reachable over REST and over gRPC, and both call the same domain function.

The table is the contract: a new REST route or RPC fails this test until it is paired here (or listed as
transport-specific with the reason).
"""

from __future__ import annotations

import inspect
import re
from types import ModuleType

import pytest
from fastapi import FastAPI

from contract.gen.grpo.v1 import (
    api_keys_pb2,
    checkpoints_pb2,
    datasets_pb2,
    environments_pb2,
    evaluations_pb2,
    jobs_pb2,
    quotas_pb2,
    reward_functions_pb2,
    usage_pb2,
)
from service.admin import endpoints as quotas_rest
from service.checkpoints import endpoints as checkpoints_rest
from service.datasets import endpoints as datasets_rest
from service.environments import endpoints as environments_rest
from service.evaluations import endpoints as evaluations_rest
from service.grpc import watch
from service.grpc.servicers import api_keys as api_keys_grpc
from service.grpc.servicers import checkpoints as checkpoints_grpc
from service.grpc.servicers import datasets as datasets_grpc
from service.grpc.servicers import environments as environments_grpc
from service.grpc.servicers import evaluations as evaluations_grpc
from service.grpc.servicers import jobs as jobs_grpc
from service.grpc.servicers import quotas as quotas_grpc
from service.grpc.servicers import rewards as rewards_grpc
from service.grpc.servicers import usage as usage_grpc
from service.jobs import endpoints as jobs_rest
from service.rewards import endpoints as rewards_rest
from service.tenants import endpoints as api_keys_rest
from service.usage import endpoints as usage_rest

# (REST route, REST module, RPC, gRPC modules, domain function both must call)
OPERATIONS: list[tuple[str, ModuleType, str, tuple[ModuleType, ...], str]] = [
    ("POST /v1/datasets", datasets_rest, "DatasetService.UploadDataset", (datasets_grpc,), "service.create_dataset"),
    ("GET /v1/datasets", datasets_rest, "DatasetService.ListDatasets", (datasets_grpc,), "service.list_datasets"),
    ("GET /v1/datasets/{dataset_id}", datasets_rest, "DatasetService.GetDataset", (datasets_grpc,), "service.get_dataset"),
    ("DELETE /v1/datasets/{dataset_id}", datasets_rest, "DatasetService.DeleteDataset", (datasets_grpc,), "service.delete_dataset"),
    ("POST /v1/reward-functions", rewards_rest, "RewardFunctionService.RegisterRewardFunction", (rewards_grpc,), "service.create_reward_function"),
    ("GET /v1/reward-functions", rewards_rest, "RewardFunctionService.ListRewardFunctions", (rewards_grpc,), "service.list_reward_functions"),
    ("GET /v1/reward-functions/{reward_function_id}", rewards_rest, "RewardFunctionService.GetRewardFunction", (rewards_grpc,), "service.get_reward_function"),
    ("DELETE /v1/reward-functions/{reward_function_id}", rewards_rest, "RewardFunctionService.DeleteRewardFunction", (rewards_grpc,), "service.delete_reward_function"),
    ("POST /v1/reward-functions/{reward_function_id}/rotate-secret", rewards_rest, "RewardFunctionService.RotateRewardFunctionSecret", (rewards_grpc,), "service.rotate_secret"),
    ("POST /v1/reward-functions/{reward_function_id}/test", rewards_rest, "RewardFunctionService.TestRewardFunction", (rewards_grpc,), "dry_run.test_reward_function"),
    ("POST /v1/jobs", jobs_rest, "JobService.CreateJob", (jobs_grpc,), "service.create_job"),
    ("GET /v1/jobs", jobs_rest, "JobService.ListJobs", (jobs_grpc,), "service.list_jobs"),
    ("GET /v1/jobs/{job_id}", jobs_rest, "JobService.GetJob", (jobs_grpc,), "service.read_job"),
    ("DELETE /v1/jobs/{job_id}", jobs_rest, "JobService.DeleteJob", (jobs_grpc,), "service.delete_job"),
    ("POST /v1/jobs/{job_id}/cancel", jobs_rest, "JobService.CancelJob", (jobs_grpc,), "service.cancel_job"),
    ("POST /v1/jobs/{job_id}/pause", jobs_rest, "JobService.PauseJob", (jobs_grpc,), "service.pause_job"),
    ("POST /v1/jobs/{job_id}/resume", jobs_rest, "JobService.ResumeJob", (jobs_grpc,), "service.resume_job"),
    ("GET /v1/jobs/{job_id}/events", jobs_rest, "JobService.ListJobEvents", (jobs_grpc,), "service.list_events"),
    ("GET /v1/jobs/{job_id}/metrics", jobs_rest, "JobService.GetJobMetrics", (jobs_grpc,), "service.get_metrics"),
    ("GET /v1/jobs/{job_id}/samples", jobs_rest, "JobService.ListJobSamples", (jobs_grpc,), "service.list_samples"),
    # Following a job: SSE of event rows over REST, typed WatchJob over gRPC; both check ownership first.
    ("GET /v1/jobs/{job_id}/stream", jobs_rest, "JobService.WatchJob", (jobs_grpc, watch), "service.read_job"),
    # The jobs domain's: `service.` over REST (jobs/endpoints), `jobs.` over gRPC.
    ("GET /v1/jobs/{job_id}/checkpoints", jobs_rest, "CheckpointService.ListCheckpoints", (checkpoints_grpc,), "list_job_checkpoints"),
    ("GET /v1/checkpoints/{checkpoint_id}", checkpoints_rest, "CheckpointService.GetCheckpoint", (checkpoints_grpc,), "service.get_checkpoint"),
    # Weights saved through the Tinker API, by their tinker:// path: ListCheckpoints with `tinker_path`.
    ("GET /v1/checkpoints", checkpoints_rest, "CheckpointService.ListCheckpoints", (checkpoints_grpc,), "service.tinker_checkpoints"),
    # Per-file Range download over REST; DownloadCheckpoint streams every (or the chosen) files with offsets.
    ("GET /v1/checkpoints/{checkpoint_id}/files/{path}", checkpoints_rest, "CheckpointService.DownloadCheckpoint", (checkpoints_grpc,), "service.manifest_entry"),
    ("POST /v1/environments", environments_rest, "EnvironmentService.RegisterEnvironment", (environments_grpc,), "service.create_environment"),
    ("GET /v1/environments", environments_rest, "EnvironmentService.ListEnvironments", (environments_grpc,), "service.list_environments"),
    ("GET /v1/environments/{environment_id}", environments_rest, "EnvironmentService.GetEnvironment", (environments_grpc,), "service.get_environment"),
    ("POST /v1/environments/{environment_id}/check", environments_rest, "EnvironmentService.CheckEnvironment", (environments_grpc,), "service.check_environment"),
    ("DELETE /v1/environments/{environment_id}", environments_rest, "EnvironmentService.DeleteEnvironment", (environments_grpc,), "service.delete_environment"),
    ("POST /v1/environments/{environment_id}/rotate-secret", environments_rest, "EnvironmentService.RotateEnvironmentSecret", (environments_grpc,), "service.rotate_secret"),
    ("POST /v1/evaluations", evaluations_rest, "EvaluationService.CreateEvaluation", (evaluations_grpc,), "service.create_evaluation"),
    ("GET /v1/evaluations", evaluations_rest, "EvaluationService.ListEvaluations", (evaluations_grpc,), "service.list_evaluations"),
    ("GET /v1/evaluations/{evaluation_id}", evaluations_rest, "EvaluationService.GetEvaluation", (evaluations_grpc,), "service.get_evaluation"),
    ("GET /v1/evaluations/{evaluation_id}/items", evaluations_rest, "EvaluationService.ListEvaluationItems", (evaluations_grpc,), "service.list_items"),
    ("POST /v1/evaluations/{evaluation_id}/cancel", evaluations_rest, "EvaluationService.CancelEvaluation", (evaluations_grpc,), "service.cancel_evaluation"),
    ("POST /v1/evaluations/{evaluation_id}/resume", evaluations_rest, "EvaluationService.ResumeEvaluation", (evaluations_grpc,), "service.resume_evaluation"),
    ("POST /v1/evaluations/compare", evaluations_rest, "EvaluationService.CompareEvaluations", (evaluations_grpc,), "service.compare"),
    ("POST /v1/api-keys", api_keys_rest, "ApiKeyService.CreateApiKey", (api_keys_grpc,), "service.create_api_key_for"),
    ("GET /v1/api-keys", api_keys_rest, "ApiKeyService.ListApiKeys", (api_keys_grpc,), "service.list_api_keys"),
    ("DELETE /v1/api-keys/{api_key_id}", api_keys_rest, "ApiKeyService.RevokeApiKey", (api_keys_grpc,), "service.revoke_api_key"),
    ("GET /v1/admin/tenants/{tenant_id}/quotas", quotas_rest, "QuotaService.GetTenantQuotas", (quotas_grpc,), "admin.read_quotas"),
    ("PUT /v1/admin/tenants/{tenant_id}/quotas", quotas_rest, "QuotaService.SetTenantQuotas", (quotas_grpc,), "admin.write_quotas"),
    ("GET /v1/usage", usage_rest, "UsageService.GetUsage", (usage_grpc,), "service.report"),
    # The jobs domain's, like ListCheckpoints.
    ("GET /v1/jobs/{job_id}/usage", jobs_rest, "UsageService.GetJobUsage", (usage_grpc,), "job_usage"),
    ("POST /v1/jobs/estimate", jobs_rest, "UsageService.EstimateJob", (usage_grpc,), "estimate"),
    ("PATCH /v1/jobs/{job_id}", jobs_rest, "UsageService.UpdateJobBudget", (usage_grpc,), "set_job_budget"),
]
# The tar archive is a REST convenience for browsers and curl; gRPC clients use DownloadCheckpoint.
# The plot is a PNG for browsers (gRPC clients plot GetJobMetrics). Webhook registration is REST-only:
# it configures HTTP callbacks, which gRPC clients can register over REST too.
REST_ONLY = {
    "GET /v1/checkpoints/{checkpoint_id}/archive",
    "GET /v1/jobs/{job_id}/plot.png",
    "POST /v1/webhooks",
    "GET /v1/webhooks",
    "GET /v1/webhooks/{webhook_id}",
    "DELETE /v1/webhooks/{webhook_id}",
    "GET /v1/webhooks/{webhook_id}/deliveries",
    "POST /v1/webhooks/{webhook_id}/rotate-secret",
}
# Declared in the API, waiting for its domain operation: UNIMPLEMENTED until then (none at the moment).
GRPC_PENDING: set[str] = set()

SERVICES = [
    d.services_by_name[name]
    for d, name in (
        (datasets_pb2.DESCRIPTOR, "DatasetService"),
        (jobs_pb2.DESCRIPTOR, "JobService"),
        (evaluations_pb2.DESCRIPTOR, "EvaluationService"),
        (checkpoints_pb2.DESCRIPTOR, "CheckpointService"),
        (reward_functions_pb2.DESCRIPTOR, "RewardFunctionService"),
        (environments_pb2.DESCRIPTOR, "EnvironmentService"),
        (api_keys_pb2.DESCRIPTOR, "ApiKeyService"),
        (quotas_pb2.DESCRIPTOR, "QuotaService"),
        (usage_pb2.DESCRIPTOR, "UsageService"),
    )
]


def test_every_rest_route_is_paired(app: FastAPI) -> None:
    routes = {
        f"{method.upper()} {path}"
        for path, operations in app.openapi()["paths"].items()
        if path.startswith("/v1/")
        for method in operations
    }
    paired = {op[0] for op in OPERATIONS}
    assert routes - paired - REST_ONLY == set(), "REST routes without a gRPC twin"
    assert paired - routes == set(), "table names REST routes that do not exist"


def test_every_rpc_is_paired() -> None:
    rpcs = {f"{service.name}.{method.name}" for service in SERVICES for method in service.methods}
    paired = {op[2] for op in OPERATIONS}
    assert rpcs - paired - GRPC_PENDING == set(), "RPCs without a REST twin"
    assert paired - rpcs == set()


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op[2])
def test_both_transports_call_the_domain_function(
    operation: tuple[str, ModuleType, str, tuple[ModuleType, ...], str],
) -> None:
    _route, rest_module, _rpc, grpc_modules, function = operation
    # Called, or handed to a thread pool (run_in_threadpool(service.create_dataset, ...)).
    used = re.compile(rf"\b{re.escape(function)}\s*[(,]")
    assert used.search(inspect.getsource(rest_module)), f"REST does not call {function}"
    assert any(used.search(inspect.getsource(m)) for m in grpc_modules), f"gRPC does not call {function}"
