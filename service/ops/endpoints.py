"""Health routes (no authentication): /healthz (process alive), /readyz (database and broker reachable)."""

from __future__ import annotations

from functools import partial
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from service.kit.config import get_settings
from service.kit.db import get_engine
from service.kit.errors import ServiceUnavailable
from service.ops.service import check_broker, check_database, run_checks

router = APIRouter(tags=["ops"])


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ready"] = "ready"
    checks: dict[str, str]


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process is up (no dependencies checked)."""
    return Health()


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={
        503: {"description": "Database or broker unreachable (`service_unavailable`, details: checks)."}
    },
)
def readyz() -> Readiness:
    """Ready to serve: the database answers SELECT 1 and the broker accepts a connection."""
    results = run_checks(
        {
            "database": partial(check_database, get_engine()),
            "broker": partial(check_broker, get_settings().broker_url),
        }
    )
    failed = sorted(name for name, result in results.items() if result != "ok")
    if failed:
        raise ServiceUnavailable(f"not ready: {', '.join(failed)} unreachable", details={"checks": results})
    return Readiness(checks=results)
