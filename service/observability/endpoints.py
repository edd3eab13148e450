"""`GET /metrics`: the Prometheus text exposition. Not behind auth (scrapers do not carry API keys);
it shows counts and latencies only, never tenant data. Restrict it at the network level if needed."""

from __future__ import annotations

from fastapi import APIRouter, Response

from service.observability.metrics import CONTENT_TYPE, exposition

router = APIRouter(tags=["ops"])


@router.get("/metrics", include_in_schema=False)
def metrics() -> Response:
    # A sync route: the jobs collector queries the database, so it runs in the threadpool.
    return Response(content=exposition(), media_type=CONTENT_TYPE)
