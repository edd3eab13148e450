"""The Python SDK for the REST API: `GRPOClient` (sync) and `AsyncGRPOClient` (async), see `client.sdk` and `client.async_sdk`."""

from client.async_sdk import AsyncGRPOClient
from client.sdk import APIError, GRPOClient, JobProgress, UnsafeCheckpointPath

__all__ = ["APIError", "AsyncGRPOClient", "GRPOClient", "JobProgress", "UnsafeCheckpointPath"]
