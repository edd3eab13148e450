"""The Python client covers every REST endpoint, and works against the real app.

- Coverage is checked by introspection: every /v1 route of `create_app()` (method + path template) must be
  reached by a `calls` builder that the client class actually uses, or by a client method that talks to
  `self._http` directly (upload, SSE stream, file/archive downloads, the plot PNG), found in its source.
- The integration tests run `GRPOClient` against a real uvicorn server on a free port (SQLite migrated with
  Alembic, in-memory broker) and `AsyncGRPOClient` over httpx's ASGI transport.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.routing import APIRoute

from cli.migrate import upgrade_head
from client.async_sdk import AsyncGRPOClient
from client.calls import Call, calls
from client.http import SSEParser
from client.sdk import APIError, GRPOClient
from service.app import create_app
from service.jobs.stream import format_error
from service.kit import db as kit_db
from service.kit.config import get_settings
from service.kit.errors import Unauthenticated
from tests.service.factories import create_tenant
from tests.ship.conftest import free_port

PLACEHOLDER = re.compile(r"\{[^}]*\}")
JOB_ACTIONS = ("cancel", "pause", "resume")


# --- route coverage ---------------------------------------------------------------------------------


def _walk(routes: Iterable[Any], prefix: str) -> Iterator[tuple[str, str]]:
    """(method, full path template) of every API route, through included routers.

    FastAPI >= 0.16x keeps included routers as one route each (`original_router` + `include_context.prefix`)
    instead of copying their routes into the app, so walk both shapes.
    """
    for route in routes:
        if isinstance(route, APIRoute):
            for method in sorted((route.methods or set()) - {"HEAD"}):
                yield method, prefix + route.path
        elif (router := getattr(route, "original_router", None)) is not None:
            yield from _walk(router.routes, prefix + route.include_context.prefix)


def _template(path: str) -> str:
    """`/v1/jobs/{job_id}` and `/v1/jobs/{id}` compare equal; `{path:path}` converters too."""
    return PLACEHOLDER.sub("{}", path)


def v1_routes(app: FastAPI) -> set[tuple[str, str]]:
    return {(m, _template(p)) for m, p in _walk(app.routes, "") if p.startswith("/v1/")}


def _builder_calls(name: str) -> list[Call[Any]]:
    """Build the Call(s) of one `calls` builder with `{param}` placeholders for its arguments."""
    builder = getattr(calls, name)
    if name == "job_action":
        return [builder("{job_id}", action) for action in JOB_ACTIONS]
    params = inspect.signature(builder).parameters.values()
    args = [
        f"{{{p.name}}}"
        for p in params
        if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    return [builder(*args)]


BUILDERS = sorted(n for n, v in vars(calls).items() if isinstance(v, staticmethod))
DIRECT_HTTP = re.compile(r"self\._http\.(get|post|put|patch|delete)\(\s*f?\"([^\"]+)\"")
DIRECT_HTTP_METHOD = re.compile(r"self\._http\.(?:stream|request)\(\s*\"(\w+)\",\s*f?\"([^\"]+)\"")


def covered_by(client_class: type) -> set[tuple[str, str]]:
    """Routes a client class reaches: builders its methods call, plus its direct `self._http` requests."""
    source = inspect.getsource(client_class)
    used_builders = set(re.findall(r"\bcalls\.(\w+)\(", source))
    assert used_builders <= set(BUILDERS), used_builders - set(BUILDERS)
    routes = {(c.method, _template(c.path)) for name in used_builders for c in _builder_calls(name)}
    routes |= {(verb.upper(), _template(path)) for verb, path in DIRECT_HTTP.findall(source)}
    routes |= {(verb.upper(), _template(path)) for verb, path in DIRECT_HTTP_METHOD.findall(source)}
    return routes


class TestRouteCoverage:
    def test_walker_sees_every_documented_route(self) -> None:
        app = create_app()
        documented = {
            (method.upper(), _template(path))
            for path, ops in app.openapi()["paths"].items()
            if path.startswith("/v1/")
            for method in ops
        }
        assert documented and documented <= v1_routes(app)

    def test_every_builder_targets_a_real_route(self) -> None:
        routes = v1_routes(create_app())
        for name in BUILDERS:
            for call in _builder_calls(name):
                assert (call.method, _template(call.path)) in routes, (
                    f"calls.{name}: {call.method} {call.path}"
                )

    @pytest.mark.parametrize("client_class", [GRPOClient, AsyncGRPOClient])
    def test_client_covers_every_v1_route(self, client_class: type) -> None:
        missing = v1_routes(create_app()) - covered_by(client_class)
        assert not missing, f"{client_class.__name__} has no method for: {sorted(missing)}"

    def test_gets_and_job_creation_are_retry_safe(self) -> None:
        for name in BUILDERS:
            for call in _builder_calls(name):
                if call.method == "GET":
                    assert call.idempotent, f"calls.{name} is a GET but not retried"
        create = calls.create_job({"base_model": "builtin:tiny"})
        assert create.idempotent and create.headers["Idempotency-Key"]
        assert calls.create_job({}).headers["Idempotency-Key"] != create.headers["Idempotency-Key"]


# --- integration --------------------------------------------------------------------------------------

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]


@dataclass
class LiveAPI:
    url: str
    api_key: str


def _clear_caches() -> None:
    get_settings.cache_clear()
    kit_db._engine_for.cache_clear()
    kit_db._factory_for.cache_clear()


@pytest.fixture
def configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Settings for a migrated SQLite database under tmp_path (in-memory broker); yields a tenant's API key."""
    database_url = f"sqlite:///{tmp_path / 'grpo.db'}"
    upgrade_head(database_url)
    monkeypatch.setenv("GRPO_ENV", "development")
    monkeypatch.setenv("GRPO_DATABASE_URL", database_url)
    monkeypatch.setenv("GRPO_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("GRPO_STORAGE_URL", str(tmp_path / "storage"))
    monkeypatch.setenv("GRPO_BROKER_URL", "memory://")
    _clear_caches()
    with kit_db.session_scope() as session:
        _tenant, api_key = create_tenant(session, "client-it")
    try:
        yield api_key
    finally:
        kit_db.get_engine().dispose()
        _clear_caches()


@pytest.fixture
def live_api(configured: str) -> Iterator[LiveAPI]:
    """The real app under uvicorn on a free loopback port, in a thread of this process."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield LiveAPI(f"http://127.0.0.1:{port}", configured)
    finally:
        server.should_exit = True
        thread.join(timeout=15)


class LoseFirstAnswer(httpx.BaseTransport):
    """Delivers the first `POST /v1/jobs` to the server, then drops its answer (a connection lost on the way
    back), so the client must retry without creating a second job. Records the Idempotency-Key of each try."""

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()
        self.create_keys: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        if request.method == "POST" and request.url.path == "/v1/jobs":
            self.create_keys.append(request.headers["Idempotency-Key"])
            if len(self.create_keys) == 1:
                response.read()
                response.close()
                raise httpx.ReadError("answer lost on the way back", request=request)
        return response

    def close(self) -> None:
        self._inner.close()


def job_spec(dataset_id: str) -> dict[str, Any]:
    return {
        "name": "client-it",
        "base_model": "builtin:tiny",
        "train_dataset": dataset_id,
        "rewards": [{"type": "builtin", "name": "exact_match", "weight": 1.0}],
        "hyperparameters": {"max_steps": 2, "num_generations": 2, "prompts_per_step": 2},
    }


def write_rows(path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


@pytest.mark.timeout(120)
def test_sync_client_against_live_server(live_api: LiveAPI, tmp_path: Path, calculator_url: str) -> None:
    transport = LoseFirstAnswer()
    with GRPOClient(live_api.url, live_api.api_key, transport=transport) as client:
        # datasets: upload, get, list
        dataset = client.upload_dataset(write_rows(tmp_path / "sums.jsonl"), name="sums")
        assert (dataset.name, dataset.num_rows) == ("sums", len(ROWS))
        assert client.get_dataset(dataset.id).sha256 == dataset.sha256
        assert [d.id for d in client.list_datasets().data] == [dataset.id]

        # reward functions: register (secret shown once), get (never the secret), rotate (a new secret)
        reward = client.register_reward_function("scorer", "http://127.0.0.1:9/score", max_batch_size=8)
        assert reward.signing_secret.startswith("whsec_")
        fetched = client.get_reward_function(reward.id)
        assert fetched.max_batch_size == 8 and "signing_secret" not in fetched.model_dump()
        rotated = client.rotate_reward_secret(reward.id)
        assert rotated.id == reward.id and rotated.signing_secret != reward.signing_secret

        # environments: register an OpenEnv server (read now), check it again, rotate, delete
        env = client.register_environment("calculator", calculator_url, max_concurrency=2)
        assert env.signing_secret.startswith("whsec_") and env.health.status == "healthy"
        assert "tool_name" in env.schemas.action["properties"] and env.max_concurrency == 2
        assert client.check_environment(env.id).health.checked_at >= env.health.checked_at
        assert [e.id for e in client.list_environments().data] == [env.id]
        assert client.rotate_environment_secret(env.id).signing_secret != env.signing_secret
        client.delete_environment(env.id)
        with pytest.raises(APIError) as missing:
            client.get_environment(env.id)
        assert missing.value.status == 404

        # jobs: the first create's answer is lost; the retry carries the same auto key and gets the same job
        job = client.create_job(job_spec(dataset.id))
        assert len(transport.create_keys) == 2 and transport.create_keys[0] == transport.create_keys[1]
        assert [j.id for j in client.list_jobs().data] == [job.id]
        again = client.create_job(job_spec(dataset.id), idempotency_key=transport.create_keys[0])
        assert again.id == job.id
        other = client.create_job(job_spec(dataset.id))  # a new call: a new auto key, a new job
        assert other.id != job.id and {j.id for j in client.list_jobs().data} == {job.id, other.id}

        # cancel, then events (listed and streamed: the stream ends at the terminal state)
        cancelled = client.cancel_job(job.id)
        assert cancelled.status == "cancelled"
        events = client.list_job_events(job.id).data
        assert events and events[-1].data.get("to") == "cancelled", events
        assert [e.id for e in client.stream_job(job.id)] == [e.id for e in events]

        # evaluations: create, get, list, items (none yet), a comparison of unfinished ones is refused, cancel
        spec = {"model": "builtin:tiny", "dataset": dataset.id, "samples_per_item": 2,
                "rewards": [{"type": "builtin", "name": "exact_match"}]}
        evaluation = client.create_evaluation(spec)
        assert evaluation.progress.items_total == len(ROWS) and evaluation.status == "queued"
        assert client.get_evaluation(evaluation.id).spec.samples_per_item == 2
        assert [e.id for e in client.list_evaluations().data] == [evaluation.id]
        assert client.list_evaluation_items(evaluation.id).data == []
        with pytest.raises(APIError) as unfinished:
            client.compare_evaluations(evaluation.id, evaluation.id)
        assert (unfinished.value.status, unfinished.value.code) == (409, "evaluation_not_finished")
        assert client.cancel_evaluation(evaluation.id).status == "cancelled"
        with pytest.raises(APIError) as not_paused:
            client.resume_evaluation(evaluation.id)
        assert not_paused.value.status == 409

        # errors carry the API's stable code
        with pytest.raises(APIError) as missing:
            client.get_job("job_does_not_exist")
        assert (missing.value.status, missing.value.code) == (404, "not_found")


@pytest.mark.timeout(120)
async def test_async_client_over_asgi(configured: str, tmp_path: Path) -> None:
    transport = httpx.ASGITransport(app=create_app())
    async with AsyncGRPOClient("http://api.test", configured, transport=transport) as client:
        webhook = await client.create_webhook("http://127.0.0.1:9/hook", description="ci")
        assert webhook.secret.startswith("whsec_")
        assert [w.id for w in (await client.list_webhooks()).data] == [webhook.id]
        assert (await client.get_webhook(webhook.id)).description == "ci"

        dataset = await client.upload_dataset(write_rows(tmp_path / "sums.jsonl"))
        assert (await client.get_dataset(dataset.id)).num_rows == len(ROWS)
        job = await client.create_job(job_spec(dataset.id))
        assert (await client.get_job(job.id)).status == "queued"
        assert (await client.get_job_plot(job.id)).startswith(b"\x89PNG")
        evaluation = await client.create_evaluation({"model": "builtin:tiny", "dataset": dataset.id,
                                                     "rewards": [{"type": "builtin", "name": "exact_match"}]})
        assert (await client.get_evaluation(evaluation.id)).status == "queued"
        assert [e.id for e in (await client.list_evaluations()).data] == [evaluation.id]
        assert (await client.list_evaluation_items(evaluation.id)).data == []
        assert (await client.cancel_evaluation(evaluation.id)).status == "cancelled"
        with pytest.raises(APIError):
            await client.resume_evaluation(evaluation.id)
        with pytest.raises(APIError):
            await client.compare_evaluations(evaluation.id, evaluation.id)
        # the job's `queued` event went to the webhook's outbox
        assert (await client.list_webhook_deliveries(webhook.id)).data

        await client.delete_webhook(webhook.id)
        with pytest.raises(APIError) as gone:
            await client.get_webhook(webhook.id)
        assert (gone.value.status, gone.value.code) == (404, "not_found")


def test_the_stream_error_message_raises_api_error() -> None:
    """The message the server ends a job stream with when its key is revoked (service.jobs.stream) becomes the
    APIError a refused request would raise, not a parse failure."""
    parser = SSEParser()
    with pytest.raises(APIError) as err:
        for line in format_error(Unauthenticated("invalid API key")).decode().split("\n"):
            parser.feed(line)
    assert (err.value.status, err.value.code, err.value.message) == (401, "unauthenticated", "invalid API key")
