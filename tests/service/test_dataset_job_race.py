"""A dataset DELETE racing a job creation that references it: exactly one of them wins.

On PostgreSQL the job row's foreign key to the dataset takes a KEY SHARE lock on the dataset row, which conflicts
with the FOR UPDATE that DELETE takes before checking for unfinished jobs: the delete waits for the job's commit,
then sees the job and refuses. (SQLite serialises writers, so the race cannot happen there.)"""

from __future__ import annotations

import threading
import time

import pytest

from contract.spec import JobSpec
from service.datasets import service as datasets
from service.datasets.errors import DatasetInUse
from service.jobs import service as jobs
from service.kit.db import session_factory
from service.kit.errors import ValidationFailed
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, job_spec, make_dataset


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_delete_waits_for_a_job_being_created_and_then_refuses(tenant_a: TenantHeaders) -> None:
    dataset_id = make_dataset(tenant_a.tenant_id)
    creating = session_factory()()
    jobs.create_job(creating, tenant_a.tenant_id, JobSpec.model_validate(job_spec(dataset_id)), RecordingQueue())

    outcome: list[BaseException | None] = []

    def delete() -> None:
        session = session_factory()()
        try:
            datasets.delete_dataset(session, tenant_a.tenant_id, dataset_id, in_use=jobs.dataset_in_use)
            session.commit()
            outcome.append(None)
        except BaseException as exc:  # recorded for the assertion below
            session.rollback()
            outcome.append(exc)
        finally:
            session.close()

    deleter = threading.Thread(target=delete)
    deleter.start()
    time.sleep(1.0)
    assert deleter.is_alive(), "the delete must wait for the job that references the dataset"
    creating.commit()
    creating.close()
    deleter.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], DatasetInUse)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_job_creation_after_a_committed_delete_names_the_field(tenant_a: TenantHeaders) -> None:
    dataset_id = make_dataset(tenant_a.tenant_id)
    with session_factory()() as session:
        datasets.delete_dataset(session, tenant_a.tenant_id, dataset_id, in_use=jobs.dataset_in_use)
        session.commit()
    with session_factory()() as session, pytest.raises(ValidationFailed) as raised:
        jobs.create_job(session, tenant_a.tenant_id, JobSpec.model_validate(job_spec(dataset_id)), RecordingQueue())
    assert "train_dataset" in str(raised.value.details)
