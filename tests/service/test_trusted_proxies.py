"""Against a live `grpo serve`: X-Forwarded-For is believed only from GRPO_TRUSTED_PROXIES (none by default).

uvicorn on its own trusts the header from 127.0.0.1, so a local client could choose the address that the
failed-login throttle (GRPO_AUTH_LOOKUPS_PER_MINUTE) counts against and never be throttled. The throttle is
what these tests observe: it is keyed by the address the server believes."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from service.kit.config import Settings
from service.tenants.service import KEY_PREFIX
from tests.worker.procs import free_port, wait_for

GRPO = [sys.executable, "-c", "from cli import main; main()"]
FAILURES_PER_MINUTE = 3


@contextmanager
def live_server(tmp_path: Path, **settings: str) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    """`grpo serve --no-worker` on SQLite in tmp_path; yields a client and a valid key's headers (a key the
    server has not seen yet)."""
    port = free_port()
    env = dict(os.environ)
    for name in ("GRPO_DATABASE_URL", "GRPO_STORAGE_URL", "GRPO_TRUSTED_PROXIES", "FORWARDED_ALLOW_IPS"):
        env.pop(name, None)
    env.update({
        "GRPO_ENV": "development",
        "GRPO_DATA_DIR": str(tmp_path / "data"),
        "GRPO_BROKER_URL": "memory://",
        "GRPO_AUTH_LOOKUPS_PER_MINUTE": str(FAILURES_PER_MINUTE),
        **{f"GRPO_{name.upper()}": value for name, value in settings.items()},
    })
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [*GRPO, "serve", "--no-worker", "--no-reaper", "--grpc-port", "0", "--port", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            wait_for(lambda: _up(client), timeout=60, what="grpo serve to answer /healthz")
            created = subprocess.run([*GRPO, "admin", "create-tenant", "acme"], env=env, capture_output=True,
                                     text=True, timeout=60, check=True)
            yield client, {"Authorization": f"Bearer {created.stdout.strip()}"}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _up(client: httpx.Client) -> bool:
    try:
        return client.get("/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _garbage(client: httpx.Client, forwarded_for: str) -> int:
    """A key shaped like ours that matches none, sent claiming to come from `forwarded_for`."""
    headers = {"Authorization": f"Bearer {KEY_PREFIX}{secrets.token_urlsafe(32)}", "X-Forwarded-For": forwarded_for}
    return client.get("/v1/jobs", headers=headers).status_code


def test_by_default_a_spoofed_forwarded_for_does_not_escape_the_throttle(tmp_path: Path) -> None:
    with live_server(tmp_path) as (client, valid):
        # Each request claims another address; the server counts them all against 127.0.0.1.
        statuses = [_garbage(client, f"10.9.0.{n}") for n in range(FAILURES_PER_MINUTE + 3)]
        assert statuses == [401] * FAILURES_PER_MINUTE + [429] * 3
        # The throttled address's valid key, which the server has not seen yet, still works.
        assert client.get("/v1/jobs", headers={**valid, "X-Forwarded-For": "10.9.0.1"}).status_code == 200


def test_a_trusted_proxy_forwards_the_clients_address(tmp_path: Path) -> None:
    with live_server(tmp_path, trusted_proxies='["127.0.0.0/8"]') as (client, _valid):
        # Behind a trusted proxy every client has its own budget...
        assert [_garbage(client, f"10.9.0.{n}") for n in range(FAILURES_PER_MINUTE + 3)] == [401] * 6
        # ...and the forwarded address is the one throttled.
        statuses = [_garbage(client, "10.9.0.0") for _ in range(FAILURES_PER_MINUTE)]
        assert statuses == [401] * (FAILURES_PER_MINUTE - 1) + [429]


@pytest.mark.parametrize("entry", ["*", "proxy.internal", "10.0.0.0/33"])
def test_trusted_proxies_are_addresses_or_networks(entry: str) -> None:
    with pytest.raises(ValidationError, match="trusted_proxies"):
        Settings(trusted_proxies=[entry])
