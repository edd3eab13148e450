"""The primitive training API's rules on a real database (SQLite and PostgreSQL): a training client's calls run in
seq_id order (refused calls pass their turn, a missing one stalls a client only briefly, a late one is refused),
resent calls are the same request, a silent worker's calls fail as retryable and its clients move, silent
sessions close."""

from __future__ import annotations

from datetime import timedelta

import pytest

from service.execution import primitives as port
from service.kit.config import Settings
from service.kit.db import session_scope, utcnow
from service.kit.errors import NotFound
from service.primitives import service as primitives
from service.primitives.models import PrimitiveRequest, PrimitiveSession, PrimitiveWorker, TrainingClient
from service.usage import service as usage_service
from service.usage.budget import BudgetExhausted
from service.usage.repository import set_tenant_budget
from tests.service.factories import create_tenant

MODEL = "builtin:tiny-instruct"


@pytest.fixture
def client(settings: Settings) -> tuple[str, str]:
    """A tenant's training client, adopted by worker w1, its creation (seq 0) run."""
    with session_scope() as session:
        tenant, _ = create_tenant(session, "prim")
        session_id = primitives.start_session(session, tenant.id, "test", [], {})
        client_id, _ = primitives.create_training_client(session, tenant.id, session_id, 0, MODEL, {"rank": 4})
    port.heartbeat("w1", {MODEL: {}})
    assert [t.id for t in port.adopt("w1", [MODEL])] == [client_id]
    (creation,) = port.next_requests("w1", [client_id])
    port.finish("w1", creation.id, b"{}", "json")
    return tenant.id, client_id


def _submit(tenant_id: str, client_id: str, seq_id: int) -> str:
    with session_scope() as session:
        return primitives.submit(session, tenant_id, client_id, "optim_step", seq_id, b"{}")


def test_calls_run_in_seq_id_order_whatever_order_they_came_in(client: tuple[str, str]) -> None:
    tenant_id, client_id = client
    third, second = _submit(tenant_id, client_id, 2), _submit(tenant_id, client_id, 1)
    assert _submit(tenant_id, client_id, 2) == third  # a resent call is the same request
    ran = []
    for _ in range(2):
        (call,) = port.next_requests("w1", [client_id])
        ran.append(call.id)
        assert port.next_requests("w1", [client_id]) == []  # one at a time per client
        port.finish("w1", call.id, b"{}", "json")
    assert ran == [second, third]
    assert _submit(tenant_id, client_id, 1) == second  # resent after it ran: still the same request


def test_a_refused_call_passes_its_turn_and_a_lost_one_stalls_briefly(client: tuple[str, str]) -> None:
    tenant_id, client_id = client
    with session_scope() as session:
        primitives.refuse(session, tenant_id, client_id, "forward_backward", 1, "data[0]: bad")
    after_refused = _submit(tenant_id, client_id, 2)
    (call,) = port.next_requests("w1", [client_id])
    assert call.id == after_refused
    port.finish("w1", call.id, b"{}", "json")

    after_lost = _submit(tenant_id, client_id, 4)  # 3 never arrives
    assert port.next_requests("w1", [client_id]) == []
    later = utcnow() + port.SEQ_GAP_WAIT + timedelta(seconds=1)
    (call,) = port.next_requests("w1", [client_id], now=later)
    assert call.id == after_lost
    port.finish("w1", call.id, b"{}", "json")
    with session_scope() as session, pytest.raises(primitives.SequenceConflict):
        primitives.submit(session, tenant_id, client_id, "optim_step", 3, b"{}")  # its successors ran


def test_a_silent_workers_calls_fail_as_retryable_and_its_clients_move(client: tuple[str, str]) -> None:
    tenant_id, client_id = client
    running, waiting = _submit(tenant_id, client_id, 1), _submit(tenant_id, client_id, 2)
    port.next_requests("w1", [client_id])
    with session_scope() as session:
        session.get(PrimitiveWorker, "w1").heartbeat_at = utcnow() - timedelta(minutes=5)  # type: ignore[union-attr]
    assert port.release_lapsed_workers(timedelta(seconds=60)) == 2
    with session_scope() as session:
        for request_id in (running, waiting):
            row = session.get(PrimitiveRequest, request_id)
            assert row is not None and row.status == "failed" and row.error is not None
            assert row.error["category"] == "server" and "load_weights" in row.error["error"]
        assert session.get(TrainingClient, client_id).worker is None  # type: ignore[union-attr]
    port.heartbeat("w2", {MODEL: {}})
    assert [t.id for t in port.adopt("w2", [MODEL])] == [client_id]  # taken over, fresh
    resumed = _submit(tenant_id, client_id, 3)  # the client goes on with its next seq_id
    (call,) = port.next_requests("w2", [client_id])
    assert call.id == resumed


def test_a_session_whose_heartbeats_stop_is_closed_and_its_clients_freed(client: tuple[str, str]) -> None:
    tenant_id, client_id = client
    assert port.close_silent_sessions(timedelta(seconds=120)) == 0
    with session_scope() as session:
        row = session.get(TrainingClient, client_id)
        assert row is not None
        session.get(PrimitiveSession, row.session_id).heartbeat_at = utcnow() - timedelta(minutes=3)  # type: ignore[union-attr]
    assert port.close_silent_sessions(timedelta(seconds=120)) == 1
    assert port.closed_targets("w1", [client_id]) == [client_id]
    with session_scope() as session, pytest.raises(primitives.SessionGone):
        primitives.submit(session, tenant_id, client_id, "optim_step", 1, b"{}")


def test_another_tenant_sees_nothing(client: tuple[str, str]) -> None:
    tenant_id, client_id = client
    with session_scope() as session:
        other, _ = create_tenant(session, "other")
        for call in (
            lambda: primitives.training_client(session, other.id, client_id),
            lambda: primitives.submit(session, other.id, client_id, "optim_step", 1, b"{}"),
            lambda: primitives.heartbeat(session, other.id, client_id.split(":")[0]),
        ):
            with pytest.raises(NotFound):
                call()


def test_calls_count_once_in_usage_and_the_monthly_cap_stops_new_ones(client: tuple[str, str]) -> None:
    tenant_id, client_id = client
    request_id = _submit(tenant_id, client_id, 1)
    (call,) = port.next_requests("w1", [client_id])
    usage = port.CallUsage(tokens_generated=0, tokens_trained=120, device_seconds=0.5)
    port.finish("w1", call.id, b"{}", "json", usage)
    port.finish("w1", call.id, b"{}", "json", usage)  # settled already: not counted again
    with session_scope() as session:
        report = usage_service.report(session, tenant_id, start=None, end=None, group_by="job")
        assert report.totals.tokens_trained == 120 and report.totals.device_seconds == pytest.approx(0.5)
        assert [group.key for group in report.data] == [client_id]
        assert request_id == call.id
        set_tenant_budget(session, tenant_id, monthly_max_device_seconds=None, monthly_max_tokens=100)
    with session_scope() as session, pytest.raises(BudgetExhausted) as refused:
        primitives.submit(session, tenant_id, client_id, "optim_step", 2, b"{}")
    assert "monthly_max_tokens 100 reached (used 120)" in refused.value.message
