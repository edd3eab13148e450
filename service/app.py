"""FastAPI application factory: routers, error rendering, OpenAPI."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPMethod
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from service.admin.endpoints import router as admin_router
from service.checkpoints.endpoints import router as checkpoints_router
from service.datasets.endpoints import router as datasets_router
from service.environments.endpoints import router as environments_router
from service.evaluations.endpoints import router as evaluations_router
from service.jobs.endpoints import router as jobs_router
from service.jobs.service import dataset_in_use
from service.kit.bodylimit import BodyLimitMiddleware, BodyTooLarge, payload_too_large
from service.kit.config import get_settings
from service.kit.errors import DomainError
from service.kit.heap import startup_objects_frozen
from service.kit.reads import open_reads
from service.kit.unhandled import UnhandledErrors
from service.observability.endpoints import router as metrics_router
from service.observability.middleware import PrometheusMiddleware
from service.openai import errors as openai_errors
from service.openai.endpoints import router as openai_router
from service.openai.grading import open_grading_pool
from service.ops.endpoints import router as ops_router
from service.rewards.endpoints import router as rewards_router
from service.tenants.endpoints import router as api_keys_router
from service.tenants.ratelimit import RateLimitHeaders, close_buckets
from service.tinker import errors as tinker_errors
from service.tinker.endpoints import router as tinker_router
from service.usage.endpoints import router as usage_router
from service.webhooks import outbox
from service.webhooks.endpoints import router as webhooks_router

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "example": "not_found"},
                "message": {"type": "string", "example": "job 'job_01J...' not found"},
                "details": {},
            },
            "required": ["code", "message"],
        }
    },
}


def _error(status: int, code: str, message: str, details: Any = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"code": code, "message": message, "details": details}})


async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DomainError)
    if openai_errors.in_scope(request):
        return openai_errors.render_domain(exc)
    if tinker_errors.in_scope(request):
        return tinker_errors.render_domain(exc)
    return JSONResponse(status_code=exc.http_status, content=exc.to_body(), headers=exc.http_headers() or None)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    if openai_errors.in_scope(request):
        return openai_errors.render_validation(exc.errors())
    if tinker_errors.in_scope(request):
        return tinker_errors.render_validation(list(exc.errors()))
    errors = [
        {"field": ".".join(str(p) for p in e.get("loc", ())), "message": e.get("msg", ""), "type": e.get("type")}
        for e in exc.errors()
    ]
    first = errors[0] if errors else {"field": "", "message": "invalid request"}
    return _error(422, "validation_error", f"{first['field']}: {first['message']}", errors)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc, BodyTooLarge):
        return await _domain_error(request, payload_too_large(exc.limit))
    code = {401: "unauthenticated", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(allowed_methods(request))
    if openai_errors.in_scope(request):
        code = "invalid_api_key" if exc.status_code == 401 else code
        return openai_errors.error_response(exc.status_code, str(exc.detail), param=None, code=code, headers=headers)
    if tinker_errors.in_scope(request):
        return tinker_errors.error_response(exc.status_code, str(exc.detail), code=code, headers=headers)
    response = _error(exc.status_code, code, str(exc.detail), None)
    response.headers.update(headers)
    return response


def allowed_methods(request: Request) -> list[str]:
    """The methods some route serves at this path, found by matching the path once per method. Starlette's
    own `Allow` names only the methods of the first route whose path matched, while e.g. GET and POST
    /v1/jobs are two routes. A path that a route names literally (POST /v1/jobs/estimate) is that route's
    resource, not an id of a templated one (/v1/jobs/{job_id}): only literal routes count for it."""
    matching = {
        method: [r for r in request.app.router.routes if r.matches({**request.scope, "method": method.value})[0]
                 is Match.FULL]
        for method in HTTPMethod
    }
    literal = any(not getattr(r, "param_convertors", None) for routes in matching.values() for r in routes)
    return [
        method for method, routes in matching.items()
        if any(not literal or not getattr(r, "param_convertors", None) for r in routes)
    ]


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings = get_settings()
    # Opened on the serving event loop, which the asyncio database pool of the hot reads is bound to.
    app.state.reads = await open_reads(settings)
    await asyncio.to_thread(open_grading_pool(app, settings).warm)  # the fork server imports the metric libraries
    try:
        with startup_objects_frozen(settings.gc_freeze):
            yield
    finally:
        await app.state.reads.close()
        del app.state.reads
        await close_buckets()


def create_app() -> FastAPI:
    app = FastAPI(
        lifespan=_lifespan,
        title="GRPO training service",
        version="0.1.0",
        description="Submit GRPO fine-tuning jobs, register remote reward endpoints, follow progress, "
        "download checkpoints. Every error has the shape `{\"error\": {\"code\", \"message\", \"details\"}}`.",
        responses={"default": {"description": "Error", "content": {"application/json": {"schema": ERROR_SCHEMA}}}},
    )
    # Rules one domain enforces with another's data, wired here so neither imports the other (see
    # service.datasets.endpoints.dataset_in_use).
    app.state.dataset_in_use = dataset_in_use
    outbox.register()  # job events written by this process are announced (service.webhooks.outbox)
    app.add_exception_handler(DomainError, _domain_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # Routes are matched in order, one by one: the jobs routes, which clients poll, go first (no two
    # routers' paths overlap, so the order changes nothing else).
    app.include_router(jobs_router, prefix="/v1")
    app.include_router(ops_router)
    app.include_router(datasets_router, prefix="/v1")
    app.include_router(rewards_router, prefix="/v1")
    app.include_router(environments_router, prefix="/v1")
    app.include_router(checkpoints_router, prefix="/v1")
    app.include_router(evaluations_router, prefix="/v1")
    app.include_router(webhooks_router, prefix="/v1")
    app.include_router(api_keys_router, prefix="/v1")
    app.include_router(admin_router, prefix="/v1")
    app.include_router(usage_router, prefix="/v1")
    app.include_router(metrics_router)
    # The OpenAI-compatible door (docs/openai.md): OpenAI's shapes over the same domain services.
    app.include_router(openai_router, prefix=openai_errors.PREFIX)
    # The Tinker-compatible door (docs/tinker.md): the tinker SDK's routes over the primitive training API. Not in
    # our OpenAPI description: their contract is the SDK's (X-API-Key, protobuf bodies, its error shape), and
    # tests/ship/test_tinker_client.py holds them to it.
    app.include_router(tinker_router, prefix=tinker_errors.PREFIX, include_in_schema=False)
    # Dataset uploads stream under their own limit (GRPO_MAX_DATASET_BYTES, service.datasets.multipart).
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=lambda: get_settings().max_request_body_bytes,
        exempt={("POST", "/v1/datasets"), ("POST", f"{openai_errors.PREFIX}/files")},
    )
    app.add_middleware(RateLimitHeaders)
    app.add_middleware(UnhandledErrors)  # added before the metrics middleware: inside it, so 500s are counted
    app.add_middleware(PrometheusMiddleware)
    return app
