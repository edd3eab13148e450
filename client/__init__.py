"""The Python SDK for the REST API: `GRPOClient` (sync) and `AsyncGRPOClient` (async), see `client.sdk`."""

from client.sdk import APIError, AsyncGRPOClient, GRPOClient, JobProgress, UnsafeCheckpointPath

__all__ = ["APIError", "AsyncGRPOClient", "GRPOClient", "JobProgress", "UnsafeCheckpointPath"]
