"""Servicers: thin adapters from RPCs to the domain services the REST routes call.

`register_all` adds every servicer to a server and returns the full service names it registered
(for health checking and reflection).
"""

from __future__ import annotations

import grpc


def register_all(server: grpc.aio.Server) -> tuple[str, ...]:
    """Add every domain servicer to `server`; returns their full service names ("grpo.v1.JobService", ...)."""
    names: list[str] = []
    return tuple(names)
