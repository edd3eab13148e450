"""A reward URL registered under a looser policy than the worker's fails the job with a stable code.

E.g. a loopback endpoint registered in development, run by a worker in production mode: the job fails
as `reward_endpoint_url_rejected` naming the reason, not as `training_error` with a validation dump, and
nothing is sent to the endpoint.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

from contract.spec import JobSpec
from service.environments.schemas import EnvironmentCreate
from service.environments.service import create_environment
from service.jobs import service as jobs_service
from service.jobs.models import Job
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope
from service.rewards.schemas import RewardFunctionCreate
from service.rewards.service import create_reward_function
from tests.service.factories import TenantHeaders
from tests.worker.conftest import RecordingQueue, insert_dataset, tiny_spec
from worker.runner import JobRunner


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A loopback port that records whether anything connected to it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    sock.setblocking(False)
    yield sock
    sock.close()


@pytest.mark.parametrize(("scheme", "reason"), [("https", "loopback"), ("http", "scheme 'http'")])
def test_stored_loopback_url_fails_the_job_as_url_rejected(
    scheme: str,
    reason: str,
    settings: Settings,
    make_tenant: Callable[[str], TenantHeaders],
    monkeypatch: pytest.MonkeyPatch,
    listener: socket.socket,
) -> None:
    tenant = make_tenant("acme")
    url = f"{scheme}://127.0.0.1:{listener.getsockname()[1]}/score"
    with session_scope() as session:  # development: loopback endpoints may be registered
        rf = create_reward_function(session, tenant.tenant_id, RewardFunctionCreate(name="judge", url=url))
        spec = tiny_spec(insert_dataset(session, tenant.tenant_id))
        spec["rewards"] = [{"type": "remote", "reward_function_id": rf.id}]
        job_id = jobs_service.create_job(session, tenant.tenant_id, JobSpec.model_validate(spec), RecordingQueue()).id

    monkeypatch.setenv("GRPO_ALLOW_PRIVATE_REWARD_URLS", "false")  # the worker's policy: production's
    get_settings.cache_clear()
    assert JobRunner(job_id, worker_id="w1").run() == "failed"

    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        assert job.error_code == "reward_endpoint_url_rejected"
        assert job.error_message is not None and reason in job.error_message
        assert f"remote:{rf.id}" in job.error_message
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing connected


def test_stored_loopback_environment_fails_the_job_as_environment_url_rejected(
    settings: Settings,
    make_tenant: Callable[[str], TenantHeaders],
    monkeypatch: pytest.MonkeyPatch,
    calculator_url: str,
) -> None:
    tenant = make_tenant("acme")
    with session_scope() as session:  # development: a loopback environment may be registered
        environment = create_environment(session, tenant.tenant_id, EnvironmentCreate(name="calc", url=calculator_url))
        spec = tiny_spec(insert_dataset(session, tenant.tenant_id))
        spec["rewards"] = [{"type": "environment"}]
        spec["environment"] = {"environment_id": environment.id}
        job_id = jobs_service.create_job(session, tenant.tenant_id, JobSpec.model_validate(spec), RecordingQueue()).id

    monkeypatch.setenv("GRPO_ALLOW_PRIVATE_REWARD_URLS", "false")  # the worker's policy: production's
    get_settings.cache_clear()
    assert JobRunner(job_id, worker_id="w1").run() == "failed"
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.error_code == "environment_url_rejected"
        assert job.error_message is not None and environment.id in job.error_message
