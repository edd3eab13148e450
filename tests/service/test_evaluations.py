"""The evaluations API over SQLite and PostgreSQL: submission checks (the model, dataset and reward references of
a job, named by the evaluation's own fields), tenant isolation on every route, cancel and resume, and results
and comparisons of evaluations whose batches are reported through the worker's real fenced port
(service.execution: claim, record_evaluation_batch, finish_evaluation), without a model."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from contract.api.quotas import QuotaLimits
from service.evaluations.stats import pass_at_k
from service.execution import reporting
from service.execution.lease import Claim, ClaimLimits, claim_delivery
from service.execution.reporting import EvaluationItemIn, StepUsageIn
from service.kit.db import session_scope
from service.quotas import service as quotas
from service.storage import checkpoint_key, get_storage
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import (
    RecordingQueue,
    job_spec,
    make_dataset,
    put_checkpoint,
    recording_queue,
    start_job,
)
from tests.service.test_checkpoints import FILES

__all__ = ["recording_queue"]  # the fixture, re-exported for pytest


def eval_spec(dataset: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": "builtin:tiny-instruct",
        "dataset": dataset,
        "rewards": [{"type": "builtin", "name": "exact_match"}],
        "samples_per_item": 2,
        "seed": 7,
    }
    spec.update(overrides)
    return spec


def submit(client: TestClient, tenant: TenantHeaders, **overrides: Any) -> dict[str, Any]:
    response = client.post("/v1/evaluations", json=eval_spec(make_dataset(tenant.tenant_id), **overrides),
                           headers=tenant)
    assert response.status_code == 201, response.text
    return dict(response.json())


def run_as_worker(evaluation_id: str, rewards: Sequence[Sequence[float | None]], *, batch: int = 2) -> Claim:
    """Claim the evaluation's job and report `rewards` (one list per item) a batch at a time, then finish."""
    claim = claim_delivery(evaluation_id, "test-worker", 60, ClaimLimits())
    assert claim is not None and claim.job_id == evaluation_id  # the fair claim takes the tenant's oldest
    reporting.set_total_steps(claim, len(rewards))
    for first in range(0, len(rewards), batch):
        items = [
            EvaluationItemIn(index=i, prompt=f"q{i}", completions=[f"c{i}.{j}" for j in range(len(r))],
                             rewards=list(r), sources=[{"exact_match": v} for v in r])
            for i, r in enumerate(rewards[first : first + batch], start=first)
        ]
        usage = StepUsageIn(tokens_generated=3 * len(items), tokens_trained=0, reward_calls=len(items),
                            device_seconds=0.5, completions=0, completion_capacity=0, num_iterations=1, parameters=1)
        reporting.record_evaluation_batch(claim, first + len(items), items, {"eval/items": len(items)}, usage)
    reporting.finish_evaluation(claim, reason="evaluated")
    return claim


class TestSubmit:
    def test_queued_as_a_job_of_its_own_kind(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        body = submit(client, tenant_a, max_items=2)
        assert body["object"] == "evaluation" and body["status"] == "queued"
        assert body["progress"] == {"items_done": 0, "items_total": 2}  # min(max_items, the dataset's 3 rows)
        assert body["results"] is None and body["spec"]["samples_per_item"] == 2
        assert recording_queue.sent == [(body["id"], "cpu")]
        assert client.get(f"/v1/evaluations/{body['id']}", headers=tenant_a).json()["id"] == body["id"]
        # Listed as an evaluation, not as a training job.
        assert [e["id"] for e in client.get("/v1/evaluations", headers=tenant_a).json()["data"]] == [body["id"]]
        assert client.get("/v1/jobs", headers=tenant_a).json()["data"] == []

    @pytest.mark.parametrize(
        ("overrides", "field"),
        [
            ({"samples_per_item": 0}, "body.samples_per_item"),
            ({"samples_per_item": 65}, "body.samples_per_item"),
            ({"temperature": -1}, "body.temperature"),
            ({"max_tokens": 0}, "body.max_tokens"),
            ({"model": "builtin:nope"}, "body.model"),
            ({"rewards": []}, "body.rewards"),
            ({"unknown": 1}, "body.unknown"),
        ],
    )
    def test_bad_fields_are_422_naming_them(
        self, client: TestClient, tenant_a: TenantHeaders, overrides: dict[str, Any], field: str
    ) -> None:
        response = client.post("/v1/evaluations", json=eval_spec(make_dataset(tenant_a.tenant_id), **overrides),
                               headers=tenant_a)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["details"][0]["field"] == field

    def test_greedy_with_several_samples_is_422(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = client.post("/v1/evaluations", headers=tenant_a,
                               json=eval_spec(make_dataset(tenant_a.tenant_id), temperature=0, samples_per_item=4))
        assert response.status_code == 422
        assert "samples_per_item" in response.json()["error"]["message"]

    def test_unknown_dataset_and_reward_function_name_the_evaluation_fields(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        spec = eval_spec("ds_missing", rewards=[{"type": "remote", "reward_function_id": "rf_missing"}])
        response = client.post("/v1/evaluations", json=spec, headers=tenant_a)
        assert response.status_code == 422
        fields = [d["field"] for d in response.json()["error"]["details"]]
        assert fields == ["dataset", "rewards[0].reward_function_id"]

    def test_another_tenants_checkpoint_reads_as_an_unknown_one(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        job_id = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=tenant_a).json()["id"]
        checkpoint, _ = put_checkpoint(get_storage(), job_id, start_job(job_id), 1, FILES)
        dataset_b = make_dataset(tenant_b.tenant_id)
        foreign = client.post("/v1/evaluations", headers=tenant_b,
                              json=eval_spec(dataset_b, model=f"checkpoint:{checkpoint.id}"))
        unknown = client.post("/v1/evaluations", headers=tenant_b, json=eval_spec(dataset_b, model="checkpoint:ckpt_x"))
        assert foreign.status_code == unknown.status_code == 422
        assert [d["field"] for d in foreign.json()["error"]["details"]] == ["model"]
        assert foreign.json()["error"]["message"].replace(checkpoint.id, "ID") == \
            unknown.json()["error"]["message"].replace("ckpt_x", "ID")
        own = client.post("/v1/evaluations", headers=tenant_a,
                          json=eval_spec(make_dataset(tenant_a.tenant_id), model=f"checkpoint:{checkpoint.id}"))
        assert own.status_code == 201, own.text


class TestIsolation:
    def test_every_route_is_404_for_another_tenant(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        evaluation = submit(client, tenant_a)
        eid = evaluation["id"]
        for method, path in [("GET", f"/v1/evaluations/{eid}"), ("GET", f"/v1/evaluations/{eid}/items"),
                             ("POST", f"/v1/evaluations/{eid}/cancel"), ("POST", f"/v1/evaluations/{eid}/resume")]:
            theirs = client.request(method, path, headers=tenant_b)
            unknown = client.request(method, path.replace(eid, "eval_unknown"), headers=tenant_b)
            assert theirs.status_code == unknown.status_code == 404, (path, theirs.text)
            assert theirs.json()["error"]["message"].replace(eid, "ID") == \
                unknown.json()["error"]["message"].replace("eval_unknown", "ID")
        assert client.get("/v1/evaluations", headers=tenant_b).json()["data"] == []
        compared = client.post("/v1/evaluations/compare", headers=tenant_b,
                               json={"evaluation_a": eid, "evaluation_b": eid})
        assert compared.status_code == 404


class TestCancelAndResume:
    def test_cancel_a_queued_evaluation(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        eid = submit(client, tenant_a)["id"]
        response = client.post(f"/v1/evaluations/{eid}/cancel", headers=tenant_a)
        assert response.status_code == 200 and response.json()["status"] == "cancelled"
        again = client.post(f"/v1/evaluations/{eid}/cancel", headers=tenant_a)
        assert again.status_code == 409

    def test_resume_is_409_unless_paused(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        eid = submit(client, tenant_a)["id"]
        assert client.post(f"/v1/evaluations/{eid}/resume", headers=tenant_a).status_code == 409


class TestResults:
    def test_summary_matches_a_direct_computation(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        rewards = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
        eid = submit(client, tenant_a)["id"]
        run_as_worker(eid, rewards)
        body = client.get(f"/v1/evaluations/{eid}", headers=tenant_a).json()
        assert body["status"] == "succeeded" and body["progress"] == {"items_done": 5, "items_total": 5}
        results = body["results"]
        flat = [r for item in rewards for r in item]
        assert results["binary"] and results["items"] == 5 and results["samples"] == 10
        assert results["accuracy"] == pytest.approx(sum(flat) / len(flat))
        assert results["pass_at_k"] == pytest.approx(sum(pass_at_k(2, int(sum(r)), 2) for r in rewards) / 5)
        assert results["pass_at_k"] == pytest.approx(4 / 5)
        assert results["tokens_generated"] == 15 and results["device_seconds"] == pytest.approx(1.5)
        low, high = results["accuracy_interval"]["low"], results["accuracy_interval"]["high"]
        assert low <= results["accuracy"] <= high
        items = client.get(f"/v1/evaluations/{eid}/items", params={"limit": 2}, headers=tenant_a).json()
        assert [i["index"] for i in items["data"]] == [0, 1] and items["next_after"] == 1
        rest = client.get(f"/v1/evaluations/{eid}/items", params={"after": 1}, headers=tenant_a).json()
        assert [i["index"] for i in rest["data"]] == [2, 3, 4] and not rest["has_more"]
        assert rest["data"][1]["rewards"] == [0.0, 1.0] and rest["data"][1]["score"] == 0.5

    def test_a_retried_batch_does_not_duplicate_items(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        eid = submit(client, tenant_a, samples_per_item=1)["id"]
        claim = claim_delivery(eid, "test-worker", 60, ClaimLimits())
        assert claim is not None
        item = EvaluationItemIn(index=0, prompt="q", completions=["c"], rewards=[1.0], sources=[{"exact_match": 1.0}])
        usage = StepUsageIn(tokens_generated=1, tokens_trained=0, reward_calls=1, device_seconds=0.1, completions=0,
                            completion_capacity=0, num_iterations=1, parameters=1)
        for _ in range(2):  # the commit's reply lost: the worker writes the same batch again
            reporting.record_evaluation_batch(claim, 1, [item], {}, usage)
        items = client.get(f"/v1/evaluations/{eid}/items", headers=tenant_a).json()["data"]
        assert [i["index"] for i in items] == [0]


class TestCompare:
    def _two(self, client: TestClient, tenant: TenantHeaders, a: Sequence[Sequence[float]],
             b: Sequence[Sequence[float]]) -> tuple[str, str]:
        dataset = make_dataset(tenant.tenant_id)
        ids = []
        for rewards in (a, b):
            body = client.post("/v1/evaluations", json=eval_spec(dataset, samples_per_item=len(rewards[0])),
                               headers=tenant).json()
            run_as_worker(body["id"], rewards)
            ids.append(body["id"])
        return ids[0], ids[1]

    def test_a_clearly_better_evaluation_excludes_zero(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        a = [[0.0]] * 30
        b = [[1.0]] * 25 + [[0.0]] * 5
        ida, idb = self._two(client, tenant_a, a, b)
        body = client.post("/v1/evaluations/compare", headers=tenant_a,
                           json={"evaluation_a": ida, "evaluation_b": idb}).json()
        assert body["metric"] == "accuracy" and body["test"] == "mcnemar_exact" and body["items"] == 30
        assert body["difference"] == pytest.approx(25 / 30)
        assert body["interval"]["low"] > 0
        assert body["p_value"] == pytest.approx(2 * 0.5**25)
        assert body["b_better"] == 25 and body["a_better"] == 0
        assert sorted(f["index"] for f in body["flipped"]) == list(range(25))

    def test_the_same_results_include_zero(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        rewards = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]] * 5
        ida, idb = self._two(client, tenant_a, rewards, rewards)
        body = client.post("/v1/evaluations/compare", headers=tenant_a,
                           json={"evaluation_a": ida, "evaluation_b": idb}).json()
        assert body["difference"] == 0 and body["interval"]["low"] <= 0 <= body["interval"]["high"]
        assert body["test"] == "paired_permutation" and math.isclose(body["p_value"], 1.0)
        assert body["flipped"] == []

    def test_unfinished_or_other_dataset_is_refused(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        done = submit(client, tenant_a)["id"]
        run_as_worker(done, [[1.0, 0.0]] * 3)
        queued = submit(client, tenant_a)["id"]
        unfinished = client.post("/v1/evaluations/compare", headers=tenant_a,
                                 json={"evaluation_a": done, "evaluation_b": queued})
        assert unfinished.status_code == 409
        assert unfinished.json()["error"]["code"] == "evaluation_not_finished"
        client.post(f"/v1/evaluations/{queued}/cancel", headers=tenant_a)  # the claim takes the oldest queued
        other = submit(client, tenant_a)["id"]  # another dataset
        run_as_worker(other, [[1.0, 0.0]] * 3)
        different = client.post("/v1/evaluations/compare", headers=tenant_a,
                                json={"evaluation_a": done, "evaluation_b": other})
        assert different.status_code == 422, different.text
        assert different.json()["error"]["details"][0]["field"] == "evaluation_b"


class TestCheckpointEvaluations:
    """A job's `eval_checkpoints`: an evaluation of each checkpoint it records, scheduled in the checkpoint's
    fenced write, its results reported back to the job's events and plot."""

    def _job(self, client: TestClient, tenant: TenantHeaders, **plan: Any) -> str:
        held_out = make_dataset(tenant.tenant_id)
        spec = job_spec(make_dataset(tenant.tenant_id), eval_checkpoints={"dataset": held_out, **plan})
        response = client.post("/v1/jobs", json=spec, headers=tenant)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def _checkpoint(self, job_id: str, claim: Claim, step: int) -> str:
        checkpoint_id = reporting.new_checkpoint_id()
        manifest = {}
        for path, content in FILES.items():
            get_storage().put_stream(checkpoint_key(job_id, checkpoint_id, path), [content])
            manifest[path] = {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
        reporting.record_checkpoint(claim, checkpoint_id=checkpoint_id, step=step, files=manifest)
        return checkpoint_id

    def test_each_checkpoint_is_evaluated_and_reported_to_the_job(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        job_id = self._job(client, tenant_a, samples_per_item=2)
        claim = claim_delivery(job_id, "test-worker", 60, ClaimLimits())
        assert claim is not None and claim.job_id == job_id
        checkpoint_id = self._checkpoint(job_id, claim, 5)
        (scheduled,) = [e for e in client.get(f"/v1/jobs/{job_id}/events", headers=tenant_a).json()["data"]
                        if e["type"] == "checkpoint_evaluation_scheduled"]
        evaluation = client.get(f"/v1/evaluations/{scheduled['data']['evaluation_id']}", headers=tenant_a).json()
        assert evaluation["model"] == f"checkpoint:{checkpoint_id}" and evaluation["status"] == "queued"
        assert evaluation["spec"]["rewards"] == [{"type": "builtin", "name": "exact_match", "weight": 1.0,
                                                  "params": {"answer_column": "answer", "case_sensitive": True,
                                                             "strip": True}}]  # the job's own
        assert evaluation["spec"]["temperature"] == 1.0 and evaluation["spec"]["max_tokens"] == 256
        assert evaluation["spec"]["metadata"] == {"job_id": job_id, "step": "5"}
        reporting.finish(claim, reporting.JobStatus.succeeded, reason="trained")  # frees the claim for the next
        run_as_worker(evaluation["id"], [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
        (reported,) = [e for e in client.get(f"/v1/jobs/{job_id}/events", headers=tenant_a).json()["data"]
                       if e["type"] == "checkpoint_evaluated"]
        assert reported["step"] == 5 and reported["data"]["accuracy"] == pytest.approx(0.5)
        assert reported["data"]["evaluation_id"] == evaluation["id"]
        plot = client.get(f"/v1/jobs/{job_id}/plot.png", headers=tenant_a)
        assert plot.status_code == 200 and plot.content.startswith(b"\x89PNG")

    def test_a_refused_evaluation_keeps_the_checkpoint(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        job_id = self._job(client, tenant_a)
        claim = claim_delivery(job_id, "test-worker", 60, ClaimLimits())
        assert claim is not None
        with session_scope() as session:
            quotas.set_overrides(session, tenant_a.tenant_id, QuotaLimits(max_queued_jobs=0))
        checkpoint_id = self._checkpoint(job_id, claim, 2)
        assert [c["id"] for c in client.get(f"/v1/jobs/{job_id}/checkpoints", headers=tenant_a).json()["data"]] \
            == [checkpoint_id]
        (skipped,) = [e for e in client.get(f"/v1/jobs/{job_id}/events", headers=tenant_a).json()["data"]
                      if e["type"].startswith("checkpoint_evaluation")]
        assert skipped["type"] == "checkpoint_evaluation_skipped" and skipped["data"]["code"] == "quota_exceeded"
        assert client.get("/v1/evaluations", headers=tenant_a).json()["data"] == []

    def test_its_references_are_checked_at_submission(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        theirs = make_dataset(tenant_b.tenant_id)
        spec = job_spec(make_dataset(tenant_a.tenant_id), eval_checkpoints={
            "dataset": theirs, "rewards": [{"type": "remote", "reward_function_id": "rf_missing"}],
        })
        response = client.post("/v1/jobs", json=spec, headers=tenant_a)
        assert response.status_code == 422
        assert [d["field"] for d in response.json()["error"]["details"]] == [
            "eval_checkpoints.dataset", "eval_checkpoints.rewards[0].reward_function_id",
        ]
        greedy_k = job_spec(make_dataset(tenant_a.tenant_id),
                            eval_checkpoints={"dataset": theirs, "temperature": 0, "samples_per_item": 3})
        assert client.post("/v1/jobs", json=greedy_k, headers=tenant_a).status_code == 422
