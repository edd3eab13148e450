"""The scope each RPC needs (service.tenants.scopes): the gRPC twin of the REST rule "GET reads, other methods
write, key management is admin".

One table rather than a check inside each servicer method, so the auth interceptor can refuse a call before it
runs and `check_scopes_declared` can refuse to start a server with an RPC nobody classified: a new RPC
without an entry here fails every gRPC test instead of being callable with any key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from google.protobuf.descriptor import ServiceDescriptor

from service.tenants.scopes import Scope

_SERVICES: dict[str, dict[str, Scope]] = {
    "grpo.v1.JobService": {
        "CreateJob": "write",
        "GetJob": "read",
        "ListJobs": "read",
        "CancelJob": "write",
        "PauseJob": "write",
        "ResumeJob": "write",
        "DeleteJob": "write",
        "ListJobEvents": "read",
        "GetJobMetrics": "read",
        "ListJobSamples": "read",
        "WatchJob": "read",
    },
    "grpo.v1.EvaluationService": {
        "CreateEvaluation": "write",
        "GetEvaluation": "read",
        "ListEvaluations": "read",
        "ListEvaluationItems": "read",
        "CancelEvaluation": "write",
        "ResumeEvaluation": "write",
        "CompareEvaluations": "write",  # POST /v1/evaluations/compare: only GET reads, as in REST
    },
    "grpo.v1.DatasetService": {
        "UploadDataset": "write",
        "GetDataset": "read",
        "ListDatasets": "read",
        "DeleteDataset": "write",
    },
    "grpo.v1.CheckpointService": {
        "ListCheckpoints": "read",
        "GetCheckpoint": "read",
        "DownloadCheckpoint": "read",
    },
    "grpo.v1.RewardFunctionService": {
        "RegisterRewardFunction": "write",
        "GetRewardFunction": "read",
        "ListRewardFunctions": "read",
        "DeleteRewardFunction": "write",
        "RotateRewardFunctionSecret": "write",
        "TestRewardFunction": "write",  # calls the user's endpoint
    },
    "grpo.v1.EnvironmentService": {
        "RegisterEnvironment": "write",
        "GetEnvironment": "read",
        "ListEnvironments": "read",
        "CheckEnvironment": "write",  # POST /v1/environments/{id}/check: calls the user's server
        "DeleteEnvironment": "write",
        "RotateEnvironmentSecret": "write",
    },
    "grpo.v1.QuotaService": {
        "GetTenantQuotas": "admin",
        "SetTenantQuotas": "admin",
    },
    "grpo.v1.UsageService": {
        "GetUsage": "read",
        "GetJobUsage": "read",
        "EstimateJob": "write",  # POST /v1/jobs/estimate: REST's rule (only GET reads) holds for its twin
        "UpdateJobBudget": "write",
    },
    "grpo.v1.ApiKeyService": {
        "CreateApiKey": "admin",
        "ListApiKeys": "admin",
        "RevokeApiKey": "admin",
    },
}

METHOD_SCOPES: Mapping[str, Scope] = {
    f"/{service}/{method}": scope for service, methods in _SERVICES.items() for method, scope in methods.items()
}
"""Full method name ("/grpo.v1.JobService/CreateJob") -> the scope a key needs to call it."""


def check_scopes_declared(services: Iterable[ServiceDescriptor], scopes: Mapping[str, Scope] = METHOD_SCOPES) -> None:
    """RuntimeError naming every method of `services` that has no scope (called when a server is built)."""
    missing = [
        f"/{service.full_name}/{method.name}"
        for service in services
        for method in service.methods
        if f"/{service.full_name}/{method.name}" not in scopes
    ]
    if missing:
        raise RuntimeError(f"RPCs without a declared scope (add them to service.grpc.scopes): {', '.join(missing)}")
