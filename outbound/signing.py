"""Standard Webhooks signing (https://www.standardwebhooks.com): the headers every request carries.

``webhook-id`` stays the same across retries of one request (so servers can deduplicate);
``webhook-timestamp`` and ``webhook-signature`` are recomputed per attempt so a long backoff never
pushes a retry outside the receiver's 5-minute tolerance.

gRPC endpoints get the same three values as call metadata; the signed content is the base64 of the
serialised ``ScoreRequest`` (the HMAC input must be text), see `grpc_signed_content` and reward.proto.

After a secret is rotated, requests are signed with the new and the previous secret until the overlap ends
(`SigningKeys`): ``webhook-signature: v1,<new> v1,<old>``, space-separated as Standard Webhooks allows, so a
receiver verifying with either secret accepts them and can switch at any time within the overlap.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from standardwebhooks import Webhook
from standardwebhooks.webhooks import EmptyWebhookSecretError

SECRET_PREFIX = "whsec_"
SIGNING_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")


def load_secret(secret: str) -> Webhook:
    """A signer for a ``whsec_<base64>`` secret; ValueError naming the problem otherwise."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"secret must start with {SECRET_PREFIX!r}")
    try:
        return Webhook(secret)
    except (EmptyWebhookSecretError, ValueError) as exc:  # binascii.Error is a ValueError
        raise ValueError(f"secret is not {SECRET_PREFIX}<base64>: {exc}") from exc


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class SigningKeys:
    """The secret requests are signed with, and the one a rotation replaced while its overlap lasts."""

    current: Webhook
    previous: Webhook | None = None
    previous_until: datetime | None = None

    @classmethod
    def load(
        cls, secret: str, previous: str | None = None, previous_until: datetime | None = None
    ) -> SigningKeys:
        """ValueError naming the problem for a malformed secret (see `load_secret`)."""
        if previous is None or previous_until is None:
            return cls(load_secret(secret))
        return cls(load_secret(secret), load_secret(previous), previous_until)

    def active(self, now: datetime) -> Sequence[Webhook]:
        """The signers of a request sent at `now`: the current secret first."""
        if self.previous is not None and self.previous_until is not None and now < self.previous_until:
            return (self.current, self.previous)
        return (self.current,)


def sign_headers(
    signer: Webhook | SigningKeys, msg_id: str, body: bytes, *, now: datetime | None = None
) -> dict[str, str]:
    """The three Standard Webhooks headers for `body` sent as message `msg_id` at `now` (one signature per
    active secret)."""
    timestamp = now or datetime.now(tz=UTC)
    signers = signer.active(timestamp) if isinstance(signer, SigningKeys) else (signer,)
    text = body.decode()
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(timestamp.timestamp())),
        "webhook-signature": " ".join(s.sign(msg_id, timestamp, text) for s in signers),
    }


def grpc_signed_content(serialized_request: bytes) -> bytes:
    """What is signed for a gRPC call: base64 of the exact serialised request bytes (reward.proto)."""
    return base64.b64encode(serialized_request)
