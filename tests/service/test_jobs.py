"""Jobs API through the real ASGI app, on SQLite and PostgreSQL: create, list, get, control, isolation."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.jobs.repository import get_job_any_tenant
from service.jobs.schemas import job_out
from service.kit.db import session_scope
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import (
    RecordingQueue,
    create_dataset,
    create_reward_function,
    job_spec,
    load_job,
    make_dataset,
    recording_queue,
    start_job,
)

__all__ = ["recording_queue"]  # the fixture, re-exported for pytest


def create(client: TestClient, headers: TenantHeaders, **overrides: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/jobs", json=job_spec(make_dataset(headers.tenant_id), **overrides), headers=headers
    )
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def error_fields(response: Any) -> list[str]:
    details = response.json()["error"]["details"]
    return [d["field"] for d in details]


class TestCreateJob:
    def test_created_queued_and_enqueued(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        body = create(client, tenant_a, metadata={"team": "nlp"})
        assert body["id"].startswith("job_")
        assert body["status"] == "queued"
        assert body["progress"] == {"step": 0, "total_steps": 10}
        assert body["queue"] == "cpu"
        assert body["attempt"] == 0 and body["error"] is None
        assert body["metadata"] == {"team": "nlp"}
        assert body["spec"]["hyperparameters"]["num_generations"] == 4
        assert recording_queue.sent == [(body["id"], "cpu")]

    def test_loss_options_are_accepted_and_echoed(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        options = {
            "loss_type": "grpo",
            "importance_sampling_level": "sequence",
            "delta": 2.0,
            "entropy_coef": 0.01,
            "use_adaptive_entropy": True,
            "multi_objective_aggregation": "normalize_then_sum",
        }
        body = create(client, tenant_a, hyperparameters={"max_steps": 10, **options})
        assert {k: body["spec"]["hyperparameters"][k] for k in options} == options

    def test_vllm_options_are_accepted_and_echoed(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        options = {
            "use_vllm": True,
            "vllm_gpu_memory_utilization": 0.5,
            "vllm_enable_sleep_mode": True,
            "vllm_max_model_length": 1024,
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_min": 0.5,
            "vllm_importance_sampling_clip_max": None,
        }
        body = create(client, tenant_a, hyperparameters={"max_steps": 10, **options})
        assert {k: body["spec"]["hyperparameters"][k] for k in options} == options

    def test_hub_model_goes_to_the_gpu_queue(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        body = create(client, tenant_a, base_model="Qwen/Qwen2.5-0.5B-Instruct")
        assert recording_queue.sent == [(body["id"], "gpu")]

    def test_references_must_exist_and_be_the_tenants(
        self,
        client: TestClient,
        tenant_a: TenantHeaders,
        tenant_b: TenantHeaders,
        recording_queue: RecordingQueue,
    ) -> None:
        with session_scope() as session:
            own_ds = create_dataset(session, tenant_a.tenant_id).id
            deleted_ds = create_dataset(session, tenant_a.tenant_id, deleted=True).id
            own_rf = create_reward_function(session, tenant_a.tenant_id).id
            other_rf = create_reward_function(session, tenant_b.tenant_id).id
        spec = job_spec(
            deleted_ds,
            eval_dataset="ds_missing",
            base_model="checkpoint:ckpt_nope",
            rewards=[
                {"type": "remote", "reward_function_id": own_rf},
                {"type": "remote", "reward_function_id": other_rf},
            ],
        )
        response = client.post("/v1/jobs", json=spec, headers=tenant_a)
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "validation_error"
        assert error_fields(response) == [
            "train_dataset",
            "eval_dataset",
            "rewards[1].reward_function_id",
            "base_model",
        ]
        assert recording_queue.sent == []
        # Fixed references pass.
        spec.update(
            train_dataset=own_ds, eval_dataset=own_ds, base_model="builtin:tiny", rewards=spec["rewards"][:1]
        )
        assert client.post("/v1/jobs", json=spec, headers=tenant_a).status_code == 201

    @pytest.mark.parametrize(
        ("change", "field"),
        [
            (
                {"hyperparameters": {"max_steps": 5, "num_generations": 1}},
                "body.hyperparameters.num_generations",
            ),
            ({"rewards": []}, "body.rewards"),
            ({"hyperparameters": {"max_steps": 5, "loss_type": "luspo"}}, "body.hyperparameters"),
            ({"hyperparameters": {"max_steps": 5, "top_entropy_quantile": 1.5}}, "body.hyperparameters.top_entropy_quantile"),
            ({"hyperparameters": {"max_steps": 5, "vllm_importance_sampling_mode": "token"}},
             "body.hyperparameters.vllm_importance_sampling_mode"),
            ({"hyperparameters": {"max_steps": 5, "vllm_gpu_memory_utilization": 1.5}},
             "body.hyperparameters.vllm_gpu_memory_utilization"),
            ({"hyperparameters": {"max_steps": 5, "use_vllm": True, "generation": "beam"}}, "body.hyperparameters"),
            (
                {"hyperparameters": {"max_steps": 5, "use_bias_correction_kl": "sometimes"}},
                "body.hyperparameters.use_bias_correction_kl",
            ),
            ({"base_model": "builtin:huge"}, "body.base_model"),
            ({"unknown": 1}, "body.unknown"),
        ],
    )
    def test_invalid_spec_is_422_naming_the_field(
        self, client: TestClient, tenant_a: TenantHeaders, change: dict[str, Any], field: str
    ) -> None:
        response = client.post("/v1/jobs", json=job_spec("ds_x", **change), headers=tenant_a)
        assert response.status_code == 422
        assert field in error_fields(response)

    @pytest.mark.parametrize("epochs", [1.5e9, 1e300])
    def test_epochs_past_the_step_counter_are_422_naming_num_epochs(
        self, client: TestClient, tenant_a: TenantHeaders, epochs: float
    ) -> None:
        """3 prompts, 2 per step: 1.5e9 epochs are 2.25e9 steps, past the INTEGER steps column."""
        hyper = {"num_epochs": epochs, "num_generations": 4, "prompts_per_step": 2}
        response = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id), hyperparameters=hyper),
                               headers=tenant_a)
        assert response.status_code == 422, response.text
        assert error_fields(response) == ["hyperparameters.num_epochs"]
        hyper["num_epochs"] = 1e9  # 1.5e9 steps fit
        response = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id), hyperparameters=hyper),
                               headers=tenant_a)
        assert response.status_code == 201, response.text

    def test_requires_an_api_key(self, client: TestClient) -> None:
        response = client.post("/v1/jobs", json=job_spec("ds_x"))
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "unauthenticated"


class TestListJobs:
    def test_newest_first_with_cursor_and_status_filter(
        self,
        client: TestClient,
        tenant_a: TenantHeaders,
        tenant_b: TenantHeaders,
        recording_queue: RecordingQueue,
    ) -> None:
        ids = [create(client, tenant_a)["id"] for _ in range(3)]
        client.post(f"/v1/jobs/{ids[0]}/cancel", headers=tenant_a)

        page = client.get("/v1/jobs", params={"limit": 2}, headers=tenant_a).json()
        assert [j["id"] for j in page["data"]] == [ids[2], ids[1]]
        assert page["has_more"] is True and page["next_after"] == ids[1]
        page2 = client.get(
            "/v1/jobs", params={"limit": 2, "after": page["next_after"]}, headers=tenant_a
        ).json()
        assert [j["id"] for j in page2["data"]] == [ids[0]]
        assert page2["has_more"] is False and page2["next_after"] is None

        cancelled = client.get("/v1/jobs", params={"status": "cancelled"}, headers=tenant_a).json()
        assert [j["id"] for j in cancelled["data"]] == [ids[0]]
        assert client.get("/v1/jobs", headers=tenant_b).json()["data"] == []

    @pytest.mark.parametrize("params", [{"status": "nope"}, {"limit": 0}, {"limit": 101}])
    def test_bad_query_is_422(
        self, client: TestClient, tenant_a: TenantHeaders, params: dict[str, Any]
    ) -> None:
        response = client.get("/v1/jobs", params=params, headers=tenant_a)
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "validation_error"


class TestGetJob:
    def test_get_returns_the_job(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        created = create(client, tenant_a)
        got = client.get(f"/v1/jobs/{created['id']}", headers=tenant_a)
        assert got.status_code == 200
        assert got.json() == created

    def test_get_after_changes_returns_the_new_state(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        # The read path renders a plain row (no ORM entity, nothing cached): every poll sees the latest
        # commit, whether the API or the worker made it.
        job_id = create(client, tenant_a)["id"]
        assert client.get(f"/v1/jobs/{job_id}", headers=tenant_a).json()["status"] == "queued"
        assert client.post(f"/v1/jobs/{job_id}/pause", headers=tenant_a).status_code == 200
        assert client.get(f"/v1/jobs/{job_id}", headers=tenant_a).json()["status"] == "paused"
        client.post(f"/v1/jobs/{job_id}/resume", headers=tenant_a)
        start_job(job_id)
        with session_scope() as session:  # what the worker writes while training, then on failure
            job = get_job_any_tenant(session, job_id)
            assert job is not None
            job.current_step, job.latest_metrics = 7, {"reward/mean": 0.5, "kl": None}
            job.error_code, job.error_message = "reward_endpoint_unavailable", "down"
            job.metadata_ = {"team": "a"}
        got = client.get(f"/v1/jobs/{job_id}", headers=tenant_a).json()
        assert got["status"] == "running" and got["attempt"] == 1 and got["started_at"] is not None
        assert got["progress"] == {"step": 7, "total_steps": got["progress"]["total_steps"]}
        assert got["metrics"] == {"reward/mean": 0.5, "kl": None}
        assert got["error"] == {"code": "reward_endpoint_unavailable", "message": "down"}
        assert got["metadata"] == {"team": "a"}
        # The same rendering as from the ORM entity the write paths return.
        assert got == job_out(load_job(job_id)).model_dump(mode="json")


class TestControl:
    def test_cancel_queued_job_and_cancel_again_is_409(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        job_id = create(client, tenant_a)["id"]
        response = client.post(f"/v1/jobs/{job_id}/cancel", headers=tenant_a)
        assert response.status_code == 200
        assert response.json()["status"] == "cancelled"
        assert response.json()["finished_at"] is not None
        again = client.post(f"/v1/jobs/{job_id}/cancel", headers=tenant_a)
        assert again.status_code == 409
        error = again.json()["error"]
        assert error["code"] == "illegal_transition"
        assert "cancelled" in error["message"] and error["details"]["current_status"] == "cancelled"

    def test_cancel_running_job_goes_through_cancelling(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        job_id = create(client, tenant_a)["id"]
        start_job(job_id)
        response = client.post(f"/v1/jobs/{job_id}/cancel", headers=tenant_a)
        assert response.json()["status"] == "cancelling"
        assert client.post(f"/v1/jobs/{job_id}/pause", headers=tenant_a).status_code == 409

    def test_pause_and_resume_a_queued_job_re_enqueues_it(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        job_id = create(client, tenant_a)["id"]
        assert client.post(f"/v1/jobs/{job_id}/pause", headers=tenant_a).json()["status"] == "paused"
        assert client.post(f"/v1/jobs/{job_id}/pause", headers=tenant_a).status_code == 409
        resumed = client.post(f"/v1/jobs/{job_id}/resume", headers=tenant_a)
        assert resumed.status_code == 200 and resumed.json()["status"] == "queued"
        assert recording_queue.sent == [(job_id, "cpu"), (job_id, "cpu")]

    def test_pause_of_running_job_is_a_request_that_resume_withdraws(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        job_id = create(client, tenant_a)["id"]
        start_job(job_id)
        paused = client.post(f"/v1/jobs/{job_id}/pause", headers=tenant_a).json()
        assert paused["status"] == "running" and paused["pause_requested"] is True
        withdrawn = client.post(f"/v1/jobs/{job_id}/resume", headers=tenant_a).json()
        assert withdrawn["status"] == "running" and withdrawn["pause_requested"] is False
        assert len(recording_queue.sent) == 1  # nothing re-sent: the job never stopped

    def test_resume_of_a_queued_job_is_409(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        job_id = create(client, tenant_a)["id"]
        response = client.post(f"/v1/jobs/{job_id}/resume", headers=tenant_a)
        assert response.status_code == 409
        assert response.json()["error"]["details"]["current_status"] == "queued"


JOB_ROUTES = [
    ("GET", "/v1/jobs/{id}"),
    ("POST", "/v1/jobs/{id}/cancel"),
    ("POST", "/v1/jobs/{id}/pause"),
    ("POST", "/v1/jobs/{id}/resume"),
    ("GET", "/v1/jobs/{id}/events"),
    ("GET", "/v1/jobs/{id}/metrics"),
    ("GET", "/v1/jobs/{id}/samples"),
    ("GET", "/v1/jobs/{id}/stream"),
    ("GET", "/v1/jobs/{id}/checkpoints"),
]


class TestTenantIsolation:
    @pytest.mark.parametrize(("method", "route"), JOB_ROUTES)
    def test_other_tenants_job_is_the_same_404_as_a_random_id(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, method: str, route: str
    ) -> None:
        job_id = create(client, tenant_a)["id"]
        missing_id = "job_01JAAAAAAAAAAAAAAAAAAAAAAA"
        # Same length id, so even the message length gives nothing away.
        other = client.request(method, route.format(id=job_id), headers=tenant_b)
        random = client.request(method, route.format(id=missing_id), headers=tenant_b)
        assert other.status_code == random.status_code == 404
        assert other.json() == {
            "error": {"code": "not_found", "message": f"job {job_id!r} not found", "details": None}
        }
        assert random.json()["error"]["message"] == f"job {missing_id!r} not found"
        assert client.get(f"/v1/jobs/{job_id}", headers=tenant_a).json()["status"] == "queued"
