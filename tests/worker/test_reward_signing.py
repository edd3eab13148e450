"""Standard Webhooks signing between the client and the user helper."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from outbound.rewards import RemoteRewardConfig, RemoteRewardSource, RewardEndpointHTTPError
from outbound.rewards.protocol import RewardItem, RewardRequest, encode_request
from outbound.signing import load_secret, new_message_id, sign_headers
from worker.reward_server import RewardRequestRejected, make_reward_app, verify_and_parse

from .reward_servers import new_secret, serving
from .test_reward_client import expected, make_config, make_items


def body_and_headers(secret: str, *, now: datetime | None = None) -> tuple[bytes, dict[str, str]]:
    request = RewardRequest(job_id="j", step=1, items=[RewardItem(id="0", prompt="p", completion="c")])
    body = encode_request(request)
    return body, sign_headers(load_secret(secret), new_message_id(), body, now=now)


class TestSignatureFormat:
    def test_signature_is_hmac_sha256_of_id_timestamp_body(self) -> None:
        # Computed here from the spec, independently of the standardwebhooks package.
        secret = new_secret()
        body, headers = body_and_headers(secret)
        key = base64.b64decode(secret.removeprefix("whsec_"))
        signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
        digest = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
        assert headers["webhook-signature"] == f"v1,{digest}"
        assert headers["webhook-id"].startswith("msg_")
        assert abs(int(headers["webhook-timestamp"]) - datetime.now(tz=UTC).timestamp()) < 5


class TestVerifyAndParse:
    def test_valid_request_is_parsed(self) -> None:
        secret = new_secret()
        body, headers = body_and_headers(secret)
        request = verify_and_parse(
            secret, {k.title(): v for k, v in headers.items()}, body
        )  # any header case
        assert request.job_id == "j" and request.items[0].completion == "c"

    def test_tampered_body_is_rejected(self) -> None:
        secret = new_secret()
        body, headers = body_and_headers(secret)
        tampered = body.replace(b'"completion":"c"', b'"completion":"C"')
        assert tampered != body
        with pytest.raises(RewardRequestRejected, match="No matching signature") as info:
            verify_and_parse(secret, headers, tampered)
        assert info.value.status == 401

    def test_timestamp_older_than_five_minutes_is_rejected(self) -> None:
        secret = new_secret()
        body, headers = body_and_headers(secret, now=datetime.now(tz=UTC) - timedelta(minutes=5, seconds=10))
        with pytest.raises(RewardRequestRejected, match="too old"):
            verify_and_parse(secret, headers, body)

    def test_timestamp_within_tolerance_is_accepted(self) -> None:
        secret = new_secret()
        body, headers = body_and_headers(secret, now=datetime.now(tz=UTC) - timedelta(minutes=4))
        assert verify_and_parse(secret, headers, body).step == 1

    def test_timestamp_in_the_future_is_rejected(self) -> None:
        secret = new_secret()
        body, headers = body_and_headers(secret, now=datetime.now(tz=UTC) + timedelta(minutes=6))
        with pytest.raises(RewardRequestRejected, match="too new"):
            verify_and_parse(secret, headers, body)

    def test_retimestamped_replay_is_rejected(self) -> None:
        # Moving the timestamp forward without the secret breaks the signature.
        secret = new_secret()
        body, headers = body_and_headers(secret, now=datetime.now(tz=UTC) - timedelta(minutes=10))
        headers["webhook-timestamp"] = str(int(datetime.now(tz=UTC).timestamp()))
        with pytest.raises(RewardRequestRejected, match="No matching signature"):
            verify_and_parse(secret, headers, body)

    def test_wrong_secret_is_rejected(self) -> None:
        body, headers = body_and_headers(new_secret())
        with pytest.raises(RewardRequestRejected, match="No matching signature"):
            verify_and_parse(new_secret(), headers, body)

    @pytest.mark.parametrize(
        ("header", "value"),
        [
            ("webhook-signature", None),
            ("webhook-id", None),
            ("webhook-signature", "garbage"),
            ("webhook-timestamp", "x"),
        ],
    )
    def test_missing_or_malformed_headers_are_rejected(self, header: str, value: str | None) -> None:
        secret = new_secret()
        body, headers = body_and_headers(secret)
        if value is None:
            del headers[header]
        else:
            headers[header] = value
        with pytest.raises(RewardRequestRejected, match="signature verification failed") as info:
            verify_and_parse(secret, headers, body)
        assert info.value.status == 401

    def test_authentic_but_invalid_request_names_the_field(self) -> None:
        secret = new_secret()
        body = json.dumps({"job_id": "j", "step": -1, "items": [{"id": "0", "prompt": "p"}]}).encode()
        headers = sign_headers(load_secret(secret), new_message_id(), body)
        with pytest.raises(RewardRequestRejected, match="invalid reward request: step") as info:
            verify_and_parse(secret, headers, body)
        assert info.value.status == 422


class TestRewardApp:
    @pytest.mark.parametrize("use_async", [False, True])
    async def test_client_and_app_round_trip(self, use_async: bool) -> None:
        secret = new_secret()

        def score(request: RewardRequest) -> list[float | None]:
            return [float(len(item.completion)) for item in request.items]

        async def ascore(request: RewardRequest) -> list[float | None]:
            return score(request)

        with serving(make_reward_app(secret, ascore if use_async else score)) as base:
            source = RemoteRewardSource(make_config(f"{base}/reward", secret))
            items = make_items(3, 4)
            assert await source(items, step=2) == expected(items)
            await source.aclose()

            body, headers = body_and_headers(secret)
            async with httpx.AsyncClient() as client:
                ok = await client.post(f"{base}/anything", content=body, headers=headers)
                bad = await client.post(f"{base}/anything", content=body + b" ", headers=headers)
            assert ok.status_code == 200 and ok.json() == {"rewards": [1.0]}
            assert bad.status_code == 401 and "signature verification failed" in bad.json()["error"]

    async def test_client_with_wrong_secret_is_refused_by_app(self) -> None:
        with serving(make_reward_app(new_secret(), lambda r: [0.0] * len(r.items))) as base:
            config: RemoteRewardConfig = make_config(f"{base}/", new_secret())
            source = RemoteRewardSource(config)
            with pytest.raises(RewardEndpointHTTPError, match="HTTP 401"):
                await source(make_items(1, 2), step=0)
            await source.aclose()
