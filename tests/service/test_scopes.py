"""Scopes on every REST route: enumerated from the app, so a route added without the right scope fails here.

The expected scope is derived independently of the code under test: `admin` for the key-management paths,
`read` for GET/HEAD, `write` for every other method. Each authenticated route is called with a key lacking that
scope (403 `insufficient_scope`) and with a key holding only that scope (anything but 403).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from alembic import command
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from starlette.routing import Route

from cli.migrate import alembic_config
from service.kit import db as kit_db
from service.tenants.scopes import ALL_SCOPES, parse_scopes
from tests.service.factories import TenantHeaders, auth_headers, create_key

# Paths whose every method needs `admin` (key management; quota overrides join them).
ADMIN_PATH_PREFIXES = ("/v1/api-keys", "/v1/admin/")
# Served without a key: probes, Prometheus, the API description.
PUBLIC_PATHS = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


# The Tinker door's POSTs that only read or keep a session alive (service/tinker/auth.py).
TINKER_READS = {f"/tinker/api/v1/{name}" for name in (
    "client/config", "session_heartbeat", "telemetry", "get_info", "retrieve_future")}


def expected_scope(method: str, path: str) -> str:
    if path.startswith(ADMIN_PATH_PREFIXES):
        return "admin"
    if path in TINKER_READS:
        return "read"
    return "read" if method in ("GET", "HEAD") else "write"


def as_sent(path: str, headers: dict[str, str]) -> dict[str, str]:
    """The Tinker SDK sends the key as X-API-Key with its tml- prefix; everything else as a bearer token."""
    if not path.startswith("/tinker/"):
        return headers
    return {"X-API-Key": "tml-" + headers["Authorization"].removeprefix("Bearer ")}


def every_route(app: FastAPI) -> Iterator[tuple[str, str]]:
    """(method, concrete path) of every route the app serves, path parameters filled with a dummy id."""
    for route in app.routes:
        assert isinstance(route, Route), route
        path = re.sub(r"\{[^}]+\}", "x_1", route.path)
        for method in sorted(route.methods or ()):
            if method != "HEAD":  # HEAD rides along with GET on Starlette routes
                yield method, path


@pytest.fixture
def keys(tenant_a: TenantHeaders) -> Callable[[set[str]], dict[str, str]]:
    def make(scopes: set[str]) -> dict[str, str]:
        with kit_db.session_scope() as session:
            return auth_headers(create_key(session, tenant_a.tenant_id, sorted(scopes)))

    return make


def test_every_route_requires_its_scope(
    app: FastAPI, client: TestClient, keys: Callable[[set[str]], dict[str, str]]
) -> None:
    all_but = {scope: keys(set(ALL_SCOPES) - {scope}) for scope in ALL_SCOPES}
    only = {scope: keys({scope}) for scope in ALL_SCOPES}
    checked = []
    for method, path in every_route(app):
        anonymous = client.request(method, path)
        if path in PUBLIC_PATHS:
            assert method == "GET" and anonymous.status_code != 401, (method, path)
            continue
        assert anonymous.status_code == 401, (method, path, anonymous.text)
        scope = expected_scope(method, path)
        refused = client.request(method, path, headers=as_sent(path, all_but[scope]))
        assert refused.status_code == 403, (method, path, refused.text)
        if path.startswith("/tinker/"):  # the Tinker SDK's error shape (docs/tinker.md)
            body = refused.json()
            assert body["code"] == "insufficient_scope" and body["details"]["required_scope"] == scope
            assert body["category"] == "user" and f"{scope!r} scope" in body["error"]
            allowed = client.request(method, path, headers=as_sent(path, only[scope]))
            assert allowed.status_code != 403, (method, path, allowed.text)
            checked.append((method, path))
            continue
        error = refused.json()["error"]
        assert error["code"] == "insufficient_scope"
        if path.startswith("/openai/"):  # OpenAI's error shape (docs/openai.md)
            assert error["type"] == "permission_error" and f"{scope!r} scope" in error["message"]
        else:
            assert error["details"]["required_scope"] == scope
        allowed = client.request(method, path, headers=only[scope])
        assert allowed.status_code != 403, (method, path, allowed.text)
        checked.append((method, path))
    # The enumeration itself found the routes (a refactor that hid them from app.routes would pass vacuously).
    assert ("POST", "/v1/jobs") in checked and ("DELETE", "/v1/datasets/x_1") in checked
    assert ("POST", "/tinker/api/v1/forward_backward") in checked
    assert len([c for c in checked if c[0] != "GET"]) >= 12


def test_keys_made_before_scopes_existed_keep_full_access(tmp_path: Path) -> None:
    """A key row written by the schema before scopes gets every scope from the migration."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    command.upgrade(alembic_config(url), "0004_robustness")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO tenants (id, name, created_at) VALUES ('ten_1', 'old', '2026-01-01')"))
            conn.execute(
                text(
                    "INSERT INTO api_keys (id, tenant_id, prefix, key_hash, created_at) "
                    "VALUES ('key_1', 'ten_1', 'abcdefabcdef', :hash, '2026-01-01')"
                ),
                {"hash": "0" * 64},
            )
        command.upgrade(alembic_config(url), "head")
        with engine.connect() as conn:
            stored = conn.execute(text("SELECT scopes, name, expires_at FROM api_keys")).one()
    finally:
        engine.dispose()
    assert parse_scopes(stored.scopes) == set(ALL_SCOPES)
    assert stored.name == "" and stored.expires_at is None
