"""/healthz and /readyz against real databases and a real Redis; unreachable ones give 503."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.kit import db as kit_db
from service.kit.config import Settings, get_settings


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    # Tests here build apps from their own env; drop the cached settings/engines they leave behind.
    yield
    get_settings.cache_clear()
    kit_db._engine_for.cache_clear()
    kit_db._factory_for.cache_clear()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _client_with(monkeypatch: pytest.MonkeyPatch, **env: str) -> TestClient:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    kit_db._engine_for.cache_clear()
    kit_db._factory_for.cache_clear()
    return TestClient(create_app())


def test_healthz_needs_no_auth_and_no_database(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client_with(
        monkeypatch, GRPO_DATABASE_URL=f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/x"
    )
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_readyz_ok_with_memory_broker(client: TestClient, settings: Settings) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ready", "checks": {"database": "ok", "broker": "ok"}}


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_readyz_ok_with_redis_broker(
    settings: Settings, redis_base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _client_with(monkeypatch, GRPO_BROKER_URL=f"{redis_base_url}/0")
    response = client.get("/readyz")
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_readyz_503_when_broker_unreachable(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client_with(monkeypatch, GRPO_BROKER_URL=f"redis://127.0.0.1:{_closed_port()}/0")
    started = time.monotonic()
    response = client.get("/readyz")
    assert time.monotonic() - started < 10
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "service_unavailable" and "broker" in error["message"]
    assert error["details"]["checks"]["database"] == "ok"
    assert error["details"]["checks"]["broker"].startswith("unavailable")


def test_readyz_503_when_database_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client_with(
        monkeypatch,
        GRPO_DATABASE_URL=f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/x?connect_timeout=2",
        GRPO_BROKER_URL="memory://",
    )
    response = client.get("/readyz")
    assert response.status_code == 503, response.text
    checks = response.json()["error"]["details"]["checks"]
    assert checks["database"].startswith("unavailable") and checks["broker"] == "ok"
