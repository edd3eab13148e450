"""Signing-secret rotation with an overlap: webhooks and reward functions sign with the new and the replaced
secret until the overlap ends (`webhook-signature: v1,<new> v1,<old>`), then with the new one only.

Real receivers on loopback verify with the standardwebhooks package (webhooks) and the user helper
(reward servers)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from standardwebhooks import Webhook

from outbound.signing import SigningKeys, sign_headers
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope
from service.webhooks.delivery import start_dispatcher_thread
from service.webhooks.models import WebhookEndpoint
from tests.service.factories import TenantHeaders
from tests.service.test_reward_dry_run import ITEMS, dry_run
from tests.service.test_reward_dry_run import register as register_reward
from tests.service.test_webhooks import Receiver, create_job
from tests.service.test_webhooks import register as register_webhook
from tests.worker.reward_servers import RewardServer, new_secret, running


def _overlap(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    monkeypatch.setenv("GRPO_SECRET_ROTATION_OVERLAP_SECONDS", str(seconds))
    get_settings.cache_clear()


def _signatures(headers: dict[str, str]) -> list[str]:
    return headers["webhook-signature"].split(" ")


class TestSigningKeys:
    def test_both_signatures_during_the_overlap_then_only_the_new_one(self) -> None:
        old, new = new_secret(), new_secret()
        until = datetime(2030, 1, 1, tzinfo=UTC)
        keys = SigningKeys.load(new, old, until)
        during = sign_headers(keys, "msg_1", b'{"a":1}', now=until - timedelta(seconds=1))
        assert len(_signatures(during)) == 2 and all(s.startswith("v1,") for s in _signatures(during))
        for secret in (old, new):
            # Each receiver verifies with its own secret; the timestamp check is the receiver's clock's
            # business, so verify the signature part only.
            signer = Webhook(secret)
            expected = signer.sign("msg_1", until - timedelta(seconds=1), '{"a":1}')
            assert expected in _signatures(during)
        after = sign_headers(keys, "msg_1", b'{"a":1}', now=until)
        assert _signatures(after) == [Webhook(new).sign("msg_1", until, '{"a":1}')]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


class TestWebhookRotation:
    def test_deliveries_verify_with_either_secret_during_the_overlap(
        self, client: TestClient, tenant_a: TenantHeaders, receiver: Receiver, settings: Settings,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        _overlap(monkeypatch, 3600)
        created = register_webhook(client, tenant_a, receiver.url)
        rotated = client.post(f"/v1/webhooks/{created['id']}/rotate-secret", headers=tenant_a)
        assert rotated.status_code == 200, rotated.text
        new = rotated.json()["secret"]
        assert new != created["secret"] and new.startswith("whsec_")
        until = datetime.fromisoformat(rotated.json()["previous_secret_expires_at"])
        assert timedelta(minutes=59) < until - datetime.now(UTC) <= timedelta(hours=1)
        assert client.get(f"/v1/webhooks/{created['id']}", headers=tenant_a).json()["previous_secret_expires_at"]

        receiver.secret = created["secret"]  # a receiver that has not switched yet
        request = self._deliver(client, tenant_a, receiver, settings, 1)
        assert request["verified"] is not None and len(_signatures(request["headers"])) == 2
        Webhook(new).verify(request["body"], request["headers"])  # ...and one that has

    def test_after_the_overlap_only_the_new_secret_signs(
        self, client: TestClient, tenant_a: TenantHeaders, receiver: Receiver, settings: Settings,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        _overlap(monkeypatch, 3600)
        created = register_webhook(client, tenant_a, receiver.url)
        new = client.post(f"/v1/webhooks/{created['id']}/rotate-secret", headers=tenant_a).json()["secret"]
        with session_scope() as session:  # the overlap has run out
            session.execute(
                update(WebhookEndpoint)
                .where(WebhookEndpoint.id == created["id"])
                .values(previous_secret_expires_at=datetime.now(UTC) - timedelta(seconds=1))
            )
        assert client.get(f"/v1/webhooks/{created['id']}", headers=tenant_a).json()["previous_secret_expires_at"] is None
        receiver.secret = new
        request = self._deliver(client, tenant_a, receiver, settings, 1)
        assert len(_signatures(request["headers"])) == 1
        with pytest.raises(Exception, match="No matching signature"):
            Webhook(created["secret"]).verify(request["body"], request["headers"])

    def test_no_overlap_when_set_to_zero_and_unknown_webhooks_are_404(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, receiver: Receiver,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        _overlap(monkeypatch, 0)
        created = register_webhook(client, tenant_a, receiver.url)
        rotated = client.post(f"/v1/webhooks/{created['id']}/rotate-secret", headers=tenant_a)
        assert rotated.json()["previous_secret_expires_at"] is None
        assert client.post(f"/v1/webhooks/{created['id']}/rotate-secret", headers=tenant_b).status_code == 404
        assert client.post("/v1/webhooks/wh_nope/rotate-secret", headers=tenant_a).status_code == 404

    @staticmethod
    def _deliver(
        client: TestClient, tenant: TenantHeaders, receiver: Receiver, settings: Settings, count: int
    ) -> dict[str, object]:
        fast = get_settings().model_copy(update={"webhook_poll_interval_s": 0.05})
        thread, stop = start_dispatcher_thread(fast)
        try:
            create_job(client, tenant)
            return receiver.wait_for(count)[0]
        finally:
            stop.set()
            thread.join(timeout=10)


class TestRewardFunctionRotation:
    def test_an_endpoint_verifying_either_secret_accepts_during_the_overlap(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _overlap(monkeypatch, 3600)
        with running(RewardServer(new_secret())) as server:
            rf = register_reward(client, tenant_a, server.url)
            rotated = client.post(f"/v1/reward-functions/{rf['id']}/rotate-secret", headers=tenant_a).json()
            assert rotated["previous_secret_expires_at"] is not None
            for secret in (rf["signing_secret"], rotated["signing_secret"]):
                server.secret = secret
                response = dry_run(client, tenant_a, rf["id"], ITEMS)
                assert response.status_code == 200, response.text
            assert server.rejected == []
            assert len(server.seen[-1].headers["webhook-signature"].split(" ")) == 2

            # A second rotation within the overlap: the first secret is dropped, the middle one overlaps.
            again = client.post(f"/v1/reward-functions/{rf['id']}/rotate-secret", headers=tenant_a).json()
            server.secret = rf["signing_secret"]
            assert dry_run(client, tenant_a, rf["id"], ITEMS).status_code == 422
            for secret in (rotated["signing_secret"], again["signing_secret"]):
                server.secret = secret
                assert dry_run(client, tenant_a, rf["id"], ITEMS).status_code == 200

    def test_without_overlap_the_old_secret_stops_at_once(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _overlap(monkeypatch, 0)
        with running(RewardServer(new_secret())) as server:
            rf = register_reward(client, tenant_a, server.url)
            client.post(f"/v1/reward-functions/{rf['id']}/rotate-secret", headers=tenant_a)
            server.secret = rf["signing_secret"]
            response = dry_run(client, tenant_a, rf["id"], ITEMS)
        assert response.status_code == 422, response.text
