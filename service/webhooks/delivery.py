"""The webhook dispatcher: sends due outbox rows, signed, through the SSRF-pinned transport, with backoff.

Runs as a thread with its own event loop in the API process (`grpo serve`, next to the reaper). One pass
(`Dispatcher.deliver_due`):

1. claim: in one short transaction, select due `pending` rows (SKIP LOCKED on PostgreSQL, so several API
   processes share the outbox) and push their `next_attempt_at` past the send (a lease: if this process
   dies mid-send, they become due again and are re-sent; delivery is at least once, and `webhook-id`
   stays the same so receivers can deduplicate);
2. send them concurrently: JSON body, Standard Webhooks headers from outbound.signing
   (timestamp and signature fresh per attempt), through outbound.transport's
   `PinnedResolutionTransport` (every DNS answer checked by outbound.urlpolicy, the socket opened to
   the validated address), no redirects, no proxies;
3. record outcomes in a second transaction: 2xx -> `delivered`; a URL the policy refuses -> `failed`
   at once (retrying cannot help); anything else -> `pending` again after an exponential backoff with
   jitter (tenacity's `wait_exponential_jitter`), `failed` after `webhook_max_attempts`.

Nothing here runs inside a job's transaction, so a slow or broken receiver never delays or fails a job.
Order is not guaranteed across retries: payloads carry `event_id` (monotonic per job) and `timestamp`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import httpx
from prometheus_client import Counter
from tenacity import RetryCallState, Retrying, wait_exponential_jitter

from outbound.signing import SigningKeys, sign_headers
from outbound.transport import PinnedResolutionTransport
from outbound.urlpolicy import Resolver, UrlRejected
from service.kit.config import Settings
from service.kit.db import session_scope, utcnow
from service.webhooks import repository
from service.webhooks.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint

log = logging.getLogger(__name__)

USER_AGENT = "grpo-webhooks/1"
_EXCERPT = 200  # bytes of an error response body kept in last_error

# Created outside any registry: service.observability.metrics registers it with the API's (GET /metrics), so
# webhooks import nothing of observability.
WEBHOOK_DELIVERIES = Counter(
    "grpo_webhook_deliveries",
    "Webhook delivery attempts by outcome (delivered, retry, failed).",
    ["outcome"],
    registry=None,
)


@dataclass(frozen=True)
class DeliveryConfig:
    max_attempts: int = 10
    timeout_s: float = 10.0
    backoff_s: float = 5.0
    backoff_max_s: float = 3600.0
    poll_interval_s: float = 1.0
    allow_private: bool = False
    batch_size: int = 50
    concurrency: int = 16

    @classmethod
    def from_settings(cls, settings: Settings) -> DeliveryConfig:
        return cls(
            max_attempts=settings.webhook_max_attempts,
            timeout_s=settings.webhook_timeout_s,
            backoff_s=settings.webhook_backoff_s,
            backoff_max_s=settings.webhook_backoff_max_s,
            poll_interval_s=settings.webhook_poll_interval_s,
            allow_private=bool(settings.allow_private_reward_urls),
        )


@dataclass(frozen=True)
class Outcome:
    delivered: bool
    permanent: bool = False  # no point retrying (URL refused by the policy)
    status_code: int | None = None
    error: str | None = None


@dataclass
class PassReport:
    delivered: list[int] = field(default_factory=list)
    retrying: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.delivered) + len(self.retrying) + len(self.failed)


@dataclass(frozen=True)
class _Claimed:
    id: int
    message_id: str
    payload: bytes
    url: str
    signing: SigningKeys
    attempts: int


class Dispatcher:
    """Delivers due webhook rows. Use within one event loop; `aclose()` when done."""

    def __init__(self, config: DeliveryConfig, *, resolver: Resolver | None = None) -> None:
        self.config = config
        self._client = httpx.AsyncClient(
            transport=PinnedResolutionTransport(allow_private=config.allow_private, resolver=resolver),
            timeout=httpx.Timeout(config.timeout_s),
            follow_redirects=False,
            trust_env=False,
        )
        self._wait = wait_exponential_jitter(
            initial=config.backoff_s, max=config.backoff_max_s, jitter=config.backoff_s
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def deliver_due(self, *, now: datetime | None = None) -> PassReport:
        """One pass: claim due rows, send them, record what happened."""
        claimed = self._claim(now or utcnow())
        report = PassReport()
        if not claimed:
            return report
        semaphore = asyncio.Semaphore(self.config.concurrency)

        async def send(item: _Claimed) -> Outcome:
            async with semaphore:
                return await self.send_one(item)

        outcomes = await asyncio.gather(*(send(item) for item in claimed))
        self._record(list(zip(claimed, outcomes, strict=True)), report)
        return report

    async def run(self, stop: threading.Event) -> None:
        """Pass after pass until `stop` is set; a failing pass is logged and retried next interval."""
        while not stop.is_set():
            try:
                report = await self.deliver_due()
            except Exception:
                log.exception("webhooks: delivery pass failed")
                report = PassReport()
            if len(report) < self.config.batch_size:  # a full batch: more may be due, go on at once
                await asyncio.sleep(self.config.poll_interval_s)

    # --- steps ---------------------------------------------------------------------------------

    def _claim(self, now: datetime) -> list[_Claimed]:
        lease = now + timedelta(seconds=2 * self.config.timeout_s + 30)
        with session_scope() as session:
            ids = repository.due_delivery_ids(session, now, self.config.batch_size)
            if not ids:
                return []
            repository.lease_deliveries(session, ids, lease)
            rows = repository.deliveries_with_endpoints(session, ids)
            return [_claimed(delivery, endpoint) for delivery, endpoint in rows]

    async def send_one(self, item: _Claimed) -> Outcome:
        try:
            headers = {
                "content-type": "application/json",
                "user-agent": USER_AGENT,
                **sign_headers(item.signing, item.message_id, item.payload),
            }
            response = await self._client.post(item.url, content=item.payload, headers=headers)
        except UrlRejected as exc:
            return Outcome(delivered=False, permanent=True, error=f"url_rejected: {exc.message}")
        except httpx.HTTPError as exc:
            return Outcome(delivered=False, error=f"{type(exc).__name__}: {exc}"[:_EXCERPT])
        if 200 <= response.status_code < 300:
            return Outcome(delivered=True, status_code=response.status_code)
        excerpt = response.text[:_EXCERPT]
        return Outcome(delivered=False, status_code=response.status_code,
                       error=f"HTTP {response.status_code}: {excerpt}")

    def _record(self, results: Sequence[tuple[_Claimed, Outcome]], report: PassReport) -> None:
        now = utcnow()
        with session_scope() as session:
            for item, outcome in results:
                row = repository.get_delivery(session, item.id)
                if row is None:  # the endpoint was deleted meanwhile
                    continue
                self._apply(row, outcome, now)
                bucket = {DeliveryStatus.delivered: report.delivered, DeliveryStatus.failed: report.failed}
                bucket.get(row.status, report.retrying).append(row.id)
        for item, outcome in results:
            if not outcome.delivered:
                log.warning("webhooks: delivery %d (%s) to %s failed: %s", item.id, item.message_id,
                            _safe_url(item.url), outcome.error)
        WEBHOOK_DELIVERIES.labels("delivered").inc(len(report.delivered))
        WEBHOOK_DELIVERIES.labels("retry").inc(len(report.retrying))
        WEBHOOK_DELIVERIES.labels("failed").inc(len(report.failed))

    def _apply(self, row: WebhookDelivery, outcome: Outcome, now: datetime) -> None:
        row.attempts += 1
        row.last_status_code = outcome.status_code
        row.last_error = outcome.error
        if outcome.delivered:
            row.status = DeliveryStatus.delivered
            row.delivered_at = now
        elif outcome.permanent or row.attempts >= self.config.max_attempts:
            row.status = DeliveryStatus.failed
        else:
            row.status = DeliveryStatus.pending
            row.next_attempt_at = now + timedelta(seconds=self.backoff(row.attempts))

    def backoff(self, attempts: int) -> float:
        """Seconds before the next try after `attempts` failed ones: backoff_s * 2^(attempts-1) + jitter."""
        state = RetryCallState(Retrying(), None, (), {})
        state.attempt_number = attempts
        return float(self._wait(state))


def _claimed(delivery: WebhookDelivery, endpoint: WebhookEndpoint) -> _Claimed:
    body = json.dumps(delivery.payload, separators=(",", ":"), sort_keys=True).encode()
    signing = SigningKeys.load(endpoint.secret, endpoint.previous_secret, endpoint.previous_secret_expires_at)
    return _Claimed(delivery.id, delivery.message_id, body, endpoint.url, signing, delivery.attempts)


def _safe_url(url: str) -> str:
    """The URL without its query (it may carry a token) for logs."""
    return str(httpx.URL(url).copy_with(query=None, fragment=None))


def start_dispatcher_thread(
    settings: Settings, *, resolver: Resolver | None = None
) -> tuple[threading.Thread, threading.Event]:
    """Run the dispatcher in a daemon thread with its own event loop; set the event to stop it."""
    stop = threading.Event()
    config = DeliveryConfig.from_settings(settings)

    async def main() -> None:
        dispatcher = Dispatcher(config, resolver=resolver)
        try:
            await dispatcher.run(stop)
        finally:
            await dispatcher.aclose()

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="webhooks", daemon=True)
    thread.start()
    return thread, stop
