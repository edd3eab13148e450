"""Environment registry API against real servers on loopback: the example OpenEnv calculator (OpenEnv's own
`create_app`, its own process) is read at registration (`/health`, `/schema`, a session's state), every request a
check makes is signed, servers that are down or are not OpenEnv are refused with the field named and nothing
stored, secrets are shown once and rotate, and another tenant's environment is the same 404 as a random id."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from standardwebhooks import Webhook
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from outbound.openenv_session import EnvironmentConfig, open_episode
from service.environments.models import Environment
from service.kit.config import Settings
from service.kit.db import session_scope
from tests.service.factories import TenantHeaders
from tests.worker.procs import free_port
from tests.worker.reward_servers import serving

BASE = "/v1/environments"
CALCULATOR_SESSIONS = 8  # examples/environments/calculator.py's default capacity


class Recorder:
    """ASGI middleware keeping each request's path and headers, so signatures can be checked afterwards."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests: list[tuple[str, dict[str, str]]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            self.requests.append((scope["path"], headers))
        await self.app(scope, receive, send)


async def _state_only(websocket: WebSocket) -> None:
    """OpenEnv's WebSocket, as far as a check uses it: a session that answers `state`."""
    await websocket.accept()
    while (await websocket.receive_json()).get("type") != "close":
        await websocket.send_json({"type": "state", "data": {"episode_id": None, "step_count": 0}})


PROTOCOL = Starlette(routes=[
    Route("/health", lambda request: JSONResponse({"status": "healthy"})),
    Route("/schema", lambda request: JSONResponse({"action": {"type": "object"}, "observation": {"type": "object"},
                                                   "state": {"type": "object"}})),
    WebSocketRoute("/ws", _state_only),
])


@pytest.fixture(scope="module")
def recording() -> Iterator[tuple[str, Recorder]]:
    """The protocol's endpoints a check reads, in this process, keeping every request's headers (signatures).
    What OpenEnv itself serves is checked on the example calculator (`calculator_url`, its own process)."""
    recorder = Recorder(PROTOCOL)
    with serving(recorder) as url:
        yield url, recorder


async def _misbehaving(request: Request) -> Response:
    kind, page = request.path_params["kind"], request.path_params["page"]
    if kind == "down":
        return PlainTextResponse("busy", status_code=503)
    if kind == "redirect":
        return RedirectResponse("http://127.0.0.1:1/health", status_code=302)
    if kind == "html":
        return PlainTextResponse("<html>hello</html>", media_type="text/html")
    if kind == "unhealthy":
        return JSONResponse({"status": "unhealthy"})
    if page == "health":
        return JSONResponse({"status": "healthy"})
    if kind == "nows":  # the HTTP side of OpenEnv, no WebSocket
        return JSONResponse({"action": {"type": "object"}, "observation": {"type": "object"}, "state": {}})
    if kind == "big":
        return JSONResponse({"action": {"x": "y" * (2 << 20)}, "observation": {}})
    return JSONResponse({"action": {"type": "object"}})  # "noschema": no observation schema


@pytest.fixture(scope="module")
def impostor() -> Iterator[str]:
    with serving(Starlette(routes=[Route("/{kind}/{page}", _misbehaving)])) as url:
        yield url


def create(client: TestClient, auth: dict[str, str], url: str, **fields: Any) -> Any:
    body = {"name": "calculator", "url": url, "max_concurrency": 4, "headers": {"Authorization": "Bearer t"}}
    return client.post(BASE, headers=auth, json={**body, **fields})


def signed_by(secret: str, headers: dict[str, str]) -> bool:
    """Whether one of the request's webhook-signature values is `secret`'s over its id, timestamp and the empty
    body (`Webhook.verify` would also parse the body as JSON)."""
    moment = datetime.fromtimestamp(int(headers["webhook-timestamp"]), UTC)
    return Webhook(secret).sign(headers["webhook-id"], moment, "") in headers["webhook-signature"].split(" ")


def _rows() -> int:
    with session_scope() as session:
        return int(session.scalar(select(func.count()).select_from(Environment)) or 0)


class TestRegister:
    def test_reads_what_openenv_publishes_and_shows_the_secret_once(
        self, client: TestClient, tenant_a: TenantHeaders, calculator_url: str
    ) -> None:
        url = calculator_url
        response = create(client, tenant_a, url)
        assert response.status_code == 201, response.text
        body = response.json()
        assert body["id"].startswith("env_") and body["url"].rstrip("/") == url and body["max_concurrency"] == 4
        assert body["health"]["status"] == "healthy" and body["health"]["latency_ms"] > 0
        assert body["health"]["session_status"] == "ok"
        # The calculator's own action schema, as OpenEnv published it: MCP tool calls.
        assert body["schemas"]["action"]["properties"]["tool_name"]["type"] == "string"
        assert "observation" in body["schemas"] and body["headers"] == {"Authorization": "<redacted>"}
        assert body["signing_secret"].startswith("whsec_")
        read = client.get(f"{BASE}/{body['id']}", headers=tenant_a).json()
        assert "signing_secret" not in read and read["schemas"] == body["schemas"]
        listed = client.get(BASE, headers=tenant_a).json()
        assert [e["id"] for e in listed["data"]] == [body["id"]] and "signing_secret" not in listed["data"][0]

    def test_every_read_and_the_handshake_are_signed_with_the_users_headers(
        self, client: TestClient, tenant_a: TenantHeaders, recording: tuple[str, Recorder]
    ) -> None:
        url, recorder = recording
        recorder.requests.clear()
        body = create(client, tenant_a, url).json()
        assert [path for path, _ in recorder.requests] == ["/health", "/schema", "/ws"]
        for _, headers in recorder.requests:
            assert headers["authorization"] == "Bearer t"
            assert signed_by(body["signing_secret"], headers)

    @pytest.mark.parametrize(
        ("kind", "status", "code", "says"),
        [
            ("down", 424, "environment_unreachable", "HTTP 503"),
            ("unhealthy", 424, "environment_unreachable", "'unhealthy'"),
            ("redirect", 422, "environment_invalid_response", "HTTP 302"),
            ("html", 422, "environment_invalid_response", "not JSON"),
            ("noschema", 422, "environment_invalid_response", "observation"),
            ("big", 422, "environment_invalid_response", "larger than"),
            ("nows", 422, "environment_invalid_response", "handshake answered HTTP 403"),
        ],
    )
    def test_a_server_that_is_down_or_not_openenv_is_refused_naming_the_url(
        self, client: TestClient, tenant_a: TenantHeaders, impostor: str, kind: str, status: int, code: str,
        says: str,
    ) -> None:
        response = create(client, tenant_a, f"{impostor}/{kind}")
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == code and error["details"]["field"] == "url" and says in error["message"]
        assert error["message"].startswith("url: ")
        assert _rows() == 0

    def test_nothing_listening_is_unreachable(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = create(client, tenant_a, f"http://127.0.0.1:{free_port()}")
        assert response.status_code == 424, response.text
        assert response.json()["error"]["code"] == "environment_unreachable" and _rows() == 0

    @pytest.mark.parametrize(
        ("fields", "field"),
        [
            ({"max_concurrency": 0}, "max_concurrency"),
            ({"step_timeout_s": float("inf")}, "step_timeout_s"),
            ({"headers": {"Webhook-Id": "x"}}, "headers"),
            ({"url": "grpc://127.0.0.1:5000"}, "url"),
            ({"name": ""}, "name"),
            ({"surprise": 1}, "surprise"),
        ],
    )
    def test_bad_fields_are_422_naming_the_field(
        self, client: TestClient, tenant_a: TenantHeaders, fields: dict[str, Any], field: str
    ) -> None:
        response = client.post(BASE, headers={**tenant_a, "content-type": "application/json"}, content=json.dumps(
            {"name": "calculator", "url": "http://127.0.0.1:1", **fields}, allow_nan=True))
        assert response.status_code == 422, response.text
        assert response.json()["error"]["details"][0]["field"] == f"body.{field}"

    def test_production_refuses_loopback_before_connecting(
        self, client: TestClient, tenant_a: TenantHeaders, settings: Settings, monkeypatch: pytest.MonkeyPatch,
        recording: tuple[str, Recorder],
    ) -> None:
        url, recorder = recording
        recorder.requests.clear()
        monkeypatch.setattr(settings, "allow_private_reward_urls", False)
        for refused in (url, url.replace("http://", "https://")):
            response = create(client, tenant_a, refused)
            assert response.status_code == 422 and response.json()["error"]["code"] == "url_rejected"
        assert recorder.requests == [] and _rows() == 0


@contextmanager
def every_session_taken(url: str) -> Iterator[None]:
    """Hold as many episodes on the calculator as it allows (a thread with its own event loop)."""
    opened, release = threading.Event(), threading.Event()

    async def hold() -> None:
        config = EnvironmentConfig(environment_id="holder", url=url, secret="whsec_" + "A" * 32, allow_private=True)
        episodes = [(await open_episode(config, {"answer": "1"}))[0] for _ in range(CALCULATOR_SESSIONS)]
        opened.set()
        await asyncio.to_thread(release.wait)
        for episode in episodes:
            await episode.close()

    thread = threading.Thread(target=asyncio.run, args=(hold(),), daemon=True)
    thread.start()
    assert opened.wait(30)
    try:
        yield
    finally:
        release.set()
        thread.join(30)


class TestCheckRotateDelete:
    def test_a_server_at_capacity_registers_as_such(
        self, client: TestClient, tenant_a: TenantHeaders, calculator_url: str
    ) -> None:
        with every_session_taken(calculator_url):
            body = create(client, tenant_a, calculator_url).json()
        assert body["health"]["session_status"] == "at_capacity"
        checked = client.post(f"{BASE}/{body['id']}/check", headers=tenant_a).json()
        assert checked["health"]["session_status"] == "ok"

    def test_check_reads_again_and_a_failed_check_changes_nothing(
        self, client: TestClient, tenant_a: TenantHeaders, recording: tuple[str, Recorder]
    ) -> None:
        url, recorder = recording
        created = create(client, tenant_a, url).json()
        checked = client.post(f"{BASE}/{created['id']}/check", headers=tenant_a)
        assert checked.status_code == 200, checked.text
        assert checked.json()["health"]["checked_at"] >= created["health"]["checked_at"]
        assert signed_by(created["signing_secret"], recorder.requests[-1][1])
        with session_scope() as session:
            row = session.get(Environment, created["id"])
            assert row is not None
            row.url = f"http://127.0.0.1:{free_port()}"  # the server moved away
        failed = client.post(f"{BASE}/{created['id']}/check", headers=tenant_a)
        assert failed.status_code == 424 and failed.json()["error"]["code"] == "environment_unreachable"
        after = client.get(f"{BASE}/{created['id']}", headers=tenant_a).json()
        assert after["health"] == checked.json()["health"]

    def test_rotate_signs_with_both_secrets_during_the_overlap(
        self, client: TestClient, tenant_a: TenantHeaders, recording: tuple[str, Recorder]
    ) -> None:
        url, recorder = recording
        created = create(client, tenant_a, url).json()
        rotated = client.post(f"{BASE}/{created['id']}/rotate-secret", headers=tenant_a).json()
        assert rotated["signing_secret"] != created["signing_secret"]
        assert rotated["previous_secret_expires_at"] is not None
        assert client.post(f"{BASE}/{created['id']}/check", headers=tenant_a).status_code == 200
        headers = recorder.requests[-1][1]
        assert signed_by(rotated["signing_secret"], headers) and signed_by(created["signing_secret"], headers)
        assert not signed_by("whsec_" + "A" * 32, headers)  # and not by any secret

    def test_delete_hides_it_and_another_tenants_is_the_same_404_as_a_random_id(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, recording: tuple[str, Recorder]
    ) -> None:
        env_id = create(client, tenant_a, recording[0]).json()["id"]
        random_id = "env_01J00000000000000000000000"
        for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", "/rotate-secret"), ("POST", "/check")):
            theirs = client.request(method, f"{BASE}/{env_id}{suffix}", headers=tenant_b)
            missing = client.request(method, f"{BASE}/{random_id}{suffix}", headers=tenant_b)
            assert theirs.status_code == missing.status_code == 404
            assert theirs.text == missing.text.replace(random_id, env_id)
        assert client.get(BASE, headers=tenant_b).json()["data"] == []
        assert client.delete(f"{BASE}/{env_id}", headers=tenant_a).status_code == 204
        assert client.get(f"{BASE}/{env_id}", headers=tenant_a).status_code == 404
        assert client.get(BASE, headers=tenant_a).json()["data"] == []
        with session_scope() as session:
            assert session.get(Environment, env_id) is not None  # jobs that name it keep a row to connect to
