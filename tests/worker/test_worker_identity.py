"""Job events name the worker by an opaque id, never its host name or PID (issue 30): the real worker
(JobRunner in-process, with the id it picks itself) trains `builtin:tiny`, and every event the tenant reads is
checked; the operator maps the id to a machine through the worker's log line."""

from __future__ import annotations

import json
import logging
import os
import re
import socket

import pytest
from fastapi.testclient import TestClient

from service.execution import lease
from service.kit.config import Settings
from service.kit.db import session_scope
from tests.service.factories import TenantHeaders
from tests.worker.conftest import insert_dataset, tiny_spec
from worker.runner import JobRunner

OPAQUE = re.compile(r"^wrk_[0-9a-f]{12}$")


def test_events_name_the_worker_by_an_opaque_id(
    settings: Settings, tenant_a: TenantHeaders, client: TestClient, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(lease, "_process_id", None)  # this process draws its id afresh (and logs it)
    with session_scope() as session:
        spec = tiny_spec(insert_dataset(session, tenant_a.tenant_id), max_steps=1, checkpoint_every=1)
    response = client.post("/v1/jobs", json=spec, headers=tenant_a)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    with caplog.at_level(logging.INFO, logger="service.execution.lease"):
        assert JobRunner(job_id).run() == "succeeded"

    events = client.get(f"/v1/jobs/{job_id}/events", headers=tenant_a, params={"limit": 200}).json()["data"]
    claimed = [e for e in events if e["type"] == "status" and e["data"].get("to") == "running"]
    assert len(claimed) == 1
    worker_id = claimed[0]["data"]["worker_id"]
    assert OPAQUE.match(worker_id), worker_id
    assert claimed[0]["message"].endswith(f"claimed by {worker_id}")

    host, pid = socket.gethostname(), str(os.getpid())
    for event in events:
        text = json.dumps(event)
        assert len(host) < 4 or host not in text, event  # (a 1-3 letter host name could occur by chance)
        assert not re.search(rf"(?<![0-9.]){pid}(?![0-9.])", event["message"] + json.dumps(event["data"])), event
    # The operator's side: the worker's log maps the id to its host and PID.
    assert f"worker id {worker_id} is host {host}, pid {pid}" in caplog.text


def test_a_forked_process_draws_its_own_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease, "_process_id", None)
    first = lease.process_worker_id()
    assert lease.process_worker_id() == first and OPAQUE.match(first)
    monkeypatch.setattr(os, "getpid", lambda: -1)  # what a forked child sees: another PID
    assert lease.process_worker_id() != first
