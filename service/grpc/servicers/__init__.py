"""Servicers: thin adapters from RPCs to the domain services the REST routes call.

`register_all` adds every servicer to a server and returns the full service names it registered
(for health checking and reflection).
"""

from __future__ import annotations

import grpc

from contract.gen.grpo.v1 import (
    api_keys_pb2,
    api_keys_pb2_grpc,
    checkpoints_pb2,
    checkpoints_pb2_grpc,
    datasets_pb2,
    datasets_pb2_grpc,
    environments_pb2,
    environments_pb2_grpc,
    evaluations_pb2,
    evaluations_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
    quotas_pb2,
    quotas_pb2_grpc,
    reward_functions_pb2,
    reward_functions_pb2_grpc,
    usage_pb2,
    usage_pb2_grpc,
)
from service.grpc.servicers.api_keys import ApiKeyServicer
from service.grpc.servicers.checkpoints import CheckpointServicer
from service.grpc.servicers.datasets import DatasetServicer
from service.grpc.servicers.environments import EnvironmentServicer
from service.grpc.servicers.evaluations import EvaluationServicer
from service.grpc.servicers.jobs import JobServicer
from service.grpc.servicers.quotas import QuotaServicer
from service.grpc.servicers.rewards import RewardFunctionServicer
from service.grpc.servicers.usage import UsageServicer
from service.kit.reads import THREADED_READS, Reads


def register_all(server: grpc.aio.Server, reads: Reads = THREADED_READS) -> tuple[str, ...]:
    """Add every domain servicer to `server`; returns their full service names ("grpo.v1.JobService", ...).

    `reads` runs the polled job reads (kit.reads), as the REST app's lifespan does for its routes."""
    datasets_pb2_grpc.add_DatasetServiceServicer_to_server(DatasetServicer(), server)
    jobs_pb2_grpc.add_JobServiceServicer_to_server(JobServicer(reads), server)
    evaluations_pb2_grpc.add_EvaluationServiceServicer_to_server(EvaluationServicer(), server)
    checkpoints_pb2_grpc.add_CheckpointServiceServicer_to_server(CheckpointServicer(), server)
    reward_functions_pb2_grpc.add_RewardFunctionServiceServicer_to_server(RewardFunctionServicer(), server)
    environments_pb2_grpc.add_EnvironmentServiceServicer_to_server(EnvironmentServicer(), server)
    api_keys_pb2_grpc.add_ApiKeyServiceServicer_to_server(ApiKeyServicer(), server)
    quotas_pb2_grpc.add_QuotaServiceServicer_to_server(QuotaServicer(), server)
    usage_pb2_grpc.add_UsageServiceServicer_to_server(UsageServicer(), server)
    return (
        api_keys_pb2.DESCRIPTOR.services_by_name["ApiKeyService"].full_name,
        checkpoints_pb2.DESCRIPTOR.services_by_name["CheckpointService"].full_name,
        datasets_pb2.DESCRIPTOR.services_by_name["DatasetService"].full_name,
        jobs_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
        evaluations_pb2.DESCRIPTOR.services_by_name["EvaluationService"].full_name,
        reward_functions_pb2.DESCRIPTOR.services_by_name["RewardFunctionService"].full_name,
        environments_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name,
        quotas_pb2.DESCRIPTOR.services_by_name["QuotaService"].full_name,
        usage_pb2.DESCRIPTOR.services_by_name["UsageService"].full_name,
    )
