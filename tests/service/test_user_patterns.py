"""User regular expressions (regex_match) are validated as RE2 at submission: a pattern RE2 cannot run, or one
over the length cap, is a 422 naming the field; the catastrophic `(.|.)*ZQ` is a valid RE2 pattern and is
accepted (it runs in linear time: tests/engine/test_rewards.py, tests/worker/test_user_inputs.py)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from contract.spec import MAX_PATTERN_LENGTH
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, job_spec, make_dataset, recording_queue

__all__ = ["recording_queue"]
FIELD = "body.rewards.0.builtin.pattern"


def submit(client: TestClient, tenant: TenantHeaders, pattern: str) -> Any:
    rewards = [{"type": "builtin", "name": "regex_match", "params": {"pattern": pattern}}]
    return client.post(
        "/v1/jobs", json=job_spec(make_dataset(tenant.tenant_id), rewards=rewards), headers=tenant
    )


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"(a+)\1", "invalid escape sequence"),
        (r"(?<=x)y", "invalid perl operator"),
        (r"\pL{1000}", "pattern too large"),
        ("a" * (MAX_PATTERN_LENGTH + 1), "at most 1000 characters"),
    ],
)
def test_patterns_re2_refuses_are_422_naming_the_field(
    client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue, pattern: str, reason: str
) -> None:
    response = submit(client, tenant_a, pattern)
    assert response.status_code == 422, response.text
    details = response.json()["error"]["details"]
    assert [d["field"] for d in details] == [FIELD]
    assert reason in details[0]["message"]
    assert recording_queue.sent == []


def test_the_catastrophic_backtracking_pattern_is_accepted(
    client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
) -> None:
    assert submit(client, tenant_a, "(.|.)*ZQ").status_code == 201
