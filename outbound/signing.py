"""Standard Webhooks signing (https://www.standardwebhooks.com): the headers every request carries.

``webhook-id`` stays the same across retries of one request (so servers can deduplicate);
``webhook-timestamp`` and ``webhook-signature`` are recomputed per attempt so a long backoff never
pushes a retry outside the receiver's 5-minute tolerance.

gRPC endpoints get the same three values as call metadata; the signed content is the base64 of the
serialised ``ScoreRequest`` (the HMAC input must be text), see `grpc_signed_content` and reward.proto.
"""

from __future__ import annotations

import base64
import uuid
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


def sign_headers(signer: Webhook, msg_id: str, body: bytes, *, now: datetime | None = None) -> dict[str, str]:
    """The three Standard Webhooks headers for `body` sent as message `msg_id` at `now`."""
    timestamp = now or datetime.now(tz=UTC)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(timestamp.timestamp())),
        "webhook-signature": signer.sign(msg_id, timestamp, body.decode()),
    }


def grpc_signed_content(serialized_request: bytes) -> bytes:
    """What is signed for a gRPC call: base64 of the exact serialised request bytes (reward.proto)."""
    return base64.b64encode(serialized_request)
