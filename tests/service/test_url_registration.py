"""Registration of webhook and reward-function URLs in production mode: one policy, one error code.

The host is checked in the form a resolver receives (IDNA/NFKC-normalised), and names are resolved and
every address checked, for webhooks exactly as for reward functions. Names resolve through a scripted
resolver that answers from a table and refuses anything else: nothing is looked up off this machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from fastapi.testclient import TestClient

from outbound import urlpolicy
from service.kit.config import get_settings
from tests.service.factories import TenantHeaders

PUBLIC_V4 = "93.184.215.14"
# The names the scripted resolver knows, and what they resolve to.
ZONE = {
    "hooks.public.test": [PUBLIC_V4],
    "hooks.loopback.test": ["127.0.0.1"],
    "hooks.mixed.test": [PUBLIC_V4, "::1"],
    "hooks.private.test": ["10.20.30.40"],
    "hooks.mapped.test": ["::ffff:127.0.0.1"],
}

UNICODE_LOOPBACK = [
    "https://\u2460\u2461\u2466.0.0.1/hook",  # circled digits: 127.0.0.1
    "https://\uff11\uff12\uff17\u3002\uff10\u3002\uff10\u3002\uff11/hook",  # fullwidth digits, ideographic dots
    "https://\u2460\u2461\u2466.1/hook",  # 127.1
    "https://\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54/hook",  # fullwidth "localhost"
    "https://LocalHost./hook",
]
RESOLVING_TO_REFUSED = [
    "https://hooks.loopback.test/hook",
    "https://hooks.mixed.test/hook",
    "https://hooks.private.test/hook",
    "https://hooks.mapped.test/hook",
    "https://HOOKS.LOOPBACK.TEST./hook",
]


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Production mode, and the system resolver replaced by the table above; returns the names looked up."""
    asked: list[str] = []

    async def resolve(host: str, port: int) -> Sequence[str]:
        asked.append(host)
        if host not in ZONE:
            raise OSError(f"{host}: not in the test zone")
        return ZONE[host]

    monkeypatch.setattr(urlpolicy, "system_resolver", resolve)
    monkeypatch.setenv("GRPO_ENV", "production")
    get_settings.cache_clear()
    return asked


def register(client: TestClient, tenant: TenantHeaders, kind: str, url: str) -> tuple[int, dict[str, object]]:
    body = {"url": url} if kind == "webhooks" else {"name": "judge", "url": url}
    response = client.post(f"/v1/{kind}", json=body, headers=tenant)
    return response.status_code, response.json()


@pytest.mark.parametrize("kind", ["webhooks", "reward-functions"])
class TestProductionRegistration:
    @pytest.mark.parametrize("url", UNICODE_LOOPBACK)
    def test_unicode_form_of_loopback_is_refused(
        self, client: TestClient, tenant_a: TenantHeaders, lookups: list[str], kind: str, url: str
    ) -> None:
        status, body = register(client, tenant_a, kind, url)
        assert status == 422, body
        assert body["error"]["code"] == "url_rejected"  # type: ignore[index]
        assert "loopback" in body["error"]["message"]  # type: ignore[index]
        assert lookups == []  # refused on the text, before any lookup
        assert client.get(f"/v1/{kind}", headers=tenant_a).json()["data"] == []

    @pytest.mark.parametrize("url", RESOLVING_TO_REFUSED)
    def test_name_resolving_to_a_refused_address_is_refused(
        self, client: TestClient, tenant_a: TenantHeaders, lookups: list[str], kind: str, url: str
    ) -> None:
        status, body = register(client, tenant_a, kind, url)
        assert status == 422, body
        assert body["error"]["code"] == "url_rejected"  # type: ignore[index]
        assert body["error"]["details"]["host"] == url.split("/")[2].lower().rstrip(".")  # type: ignore[index]
        assert lookups == [url.split("/")[2].lower().rstrip(".")]
        assert client.get(f"/v1/{kind}", headers=tenant_a).json()["data"] == []

    def test_unresolvable_name_is_refused(
        self, client: TestClient, tenant_a: TenantHeaders, lookups: list[str], kind: str
    ) -> None:
        status, body = register(client, tenant_a, kind, "https://hooks.nowhere.test/hook")
        assert status == 422 and body["error"]["code"] == "url_rejected"  # type: ignore[index]
        assert "does not resolve" in body["error"]["message"]  # type: ignore[index]

    def test_name_resolving_to_public_addresses_is_registered(
        self, client: TestClient, tenant_a: TenantHeaders, lookups: list[str], kind: str
    ) -> None:
        status, body = register(client, tenant_a, kind, "https://Hooks.Public.Test/hook")
        assert status == 201, body
        assert body["url"] == "https://hooks.public.test/hook"
        assert lookups == ["hooks.public.test"]


@pytest.mark.parametrize("kind", ["webhooks", "reward-functions"])
def test_development_stores_the_address_a_unicode_form_means(
    client: TestClient, tenant_a: TenantHeaders, kind: str
) -> None:
    status, body = register(client, tenant_a, kind, "http://\u2460\u2461\u2466.0.0.1:9/hook")
    assert status == 201, body
    assert body["url"] == "http://127.0.0.1:9/hook"
