"""EvaluationService over a real channel: every RPC, results and comparisons of evaluations reported through the
worker's real fenced port (tests/service/test_evaluations.py's run_as_worker), the same answers as REST, bad input
naming the field, and tenant isolation on every RPC."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from contract.api.evaluations import (
    ComparisonOut,
    EvaluationItemOut,
    EvaluationOut,
    EvaluationProgress,
    EvaluationResults,
    FlippedItem,
    Interval,
)
from contract.evaluation import EvaluationSpec
from contract.gen.grpo.v1 import evaluations_pb2, evaluations_pb2_grpc, job_spec_pb2, jobs_pb2
from service.grpc.convert import evaluation_spec_from_proto, evaluation_spec_to_proto
from service.jobs.progress import worker_transition
from service.jobs.states import JobStatus
from service.kit.db import session_scope
from service.kit.queue import set_job_queue
from tests.grpc.helpers import bearer, error_code, error_field
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, make_dataset, start_job
from tests.service.test_evaluations import run_as_worker

if TYPE_CHECKING:
    Stub = evaluations_pb2_grpc.EvaluationServiceAsyncStub


@pytest.fixture
def queue(settings: object) -> Iterator[RecordingQueue]:
    recording = RecordingQueue()
    set_job_queue(recording)
    yield recording
    set_job_queue(None)


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> Stub:
    return evaluations_pb2_grpc.EvaluationServiceStub(channel)


def spec_message(dataset_id: str, **fields: Any) -> evaluations_pb2.EvaluationSpec:
    """tests/service/test_evaluations.py's eval_spec as a message."""
    values: dict[str, Any] = {
        "model": "builtin:tiny-instruct",
        "dataset": dataset_id,
        "rewards": [job_spec_pb2.RewardSpec(exact_match=job_spec_pb2.ExactMatchReward())],
        "samples_per_item": 2,
        "seed": 7,
        **fields,
    }
    return evaluations_pb2.EvaluationSpec(**values)


async def _create(stub: Stub, tenant: TenantHeaders, dataset_id: str | None = None, **fields: Any) -> str:
    spec = spec_message(dataset_id or make_dataset(tenant.tenant_id), **fields)
    reply = await stub.CreateEvaluation(evaluations_pb2.CreateEvaluationRequest(spec=spec),
                                        metadata=bearer(tenant.api_key))
    return reply.evaluation.id


async def _fails(call: object, request: object, metadata: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(request, metadata=metadata)  # type: ignore[operator]
    return err.value


async def _get(stub: Stub, tenant: TenantHeaders, evaluation_id: str) -> evaluations_pb2.Evaluation:
    request = evaluations_pb2.GetEvaluationRequest(evaluation_id=evaluation_id)
    return (await stub.GetEvaluation(request, metadata=bearer(tenant.api_key))).evaluation


def _interval(message: evaluations_pb2.ConfidenceInterval) -> dict[str, float]:
    return {"low": message.low, "high": message.high}


# The REST shapes and their messages: every field of one is a field of the other (REST's `object` tag aside; a
# job's `status` is `state` and its `error` is error_code + error_message, as in jobs.proto).
SHAPES: list[tuple[type[BaseModel], Any, set[str]]] = [
    (EvaluationSpec, evaluations_pb2.EvaluationSpec, set()),
    (EvaluationOut, evaluations_pb2.Evaluation, {"object", "status", "error"}),
    (EvaluationProgress, evaluations_pb2.EvaluationProgress, set()),
    (EvaluationResults, evaluations_pb2.EvaluationResults, set()),
    (Interval, evaluations_pb2.ConfidenceInterval, set()),
    (EvaluationItemOut, evaluations_pb2.EvaluationItem, set()),
    (ComparisonOut, evaluations_pb2.EvaluationComparison, {"object"}),
    (FlippedItem, evaluations_pb2.FlippedItem, set()),
]


@pytest.mark.parametrize(("model", "message", "renamed"), SHAPES, ids=lambda p: getattr(p, "__name__", ""))
def test_every_rest_field_has_a_proto_field(model: type[BaseModel], message: Any, renamed: set[str]) -> None:
    missing = set(model.model_fields) - set(message.DESCRIPTOR.fields_by_name) - renamed
    assert not missing, f"{message.__name__} lacks {sorted(missing)}: update proto/grpo/v1/evaluations.proto"


def test_the_spec_roundtrips() -> None:
    spec = EvaluationSpec.model_validate({
        "name": "greedy", "model": "checkpoint:ckpt_1", "dataset": "ds_1", "samples_per_item": 1, "temperature": 0,
        "top_p": 0.9, "max_tokens": 17, "max_items": 5, "seed": -3, "metadata": {"k": "v"},
        "rewards": [{"type": "builtin", "name": "regex_match", "params": {"pattern": "4"}, "weight": 2.0},
                    {"type": "remote", "reward_function_id": "rf_1"}],
    })
    assert evaluation_spec_from_proto(evaluation_spec_to_proto(spec)) == spec


class TestCreateAndRead:
    async def test_create_get_list(
        self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue, client: TestClient
    ) -> None:
        auth = bearer(tenant_a.api_key)
        spec = spec_message(make_dataset(tenant_a.tenant_id), name="held-out", max_items=2, metadata={"run": "7"})
        evaluation = (await stub.CreateEvaluation(evaluations_pb2.CreateEvaluationRequest(spec=spec),
                                                  metadata=auth)).evaluation
        assert evaluation.id.startswith("eval_") and evaluation.state == jobs_pb2.JOB_STATE_QUEUED
        assert (evaluation.name, evaluation.model, evaluation.samples_per_item) == ("held-out", "builtin:tiny-instruct", 2)
        assert evaluation.progress.items_done == 0 and evaluation.progress.items_total == 2  # min(2, 3 rows)
        assert not evaluation.HasField("results") and evaluation.error_code == ""
        assert dict(evaluation.metadata) == {"run": "7"}
        # Server defaults filled in, the rewards as sent.
        assert evaluation.spec.temperature == 1.0 and evaluation.spec.top_p == 1.0 and evaluation.spec.max_tokens == 256
        assert evaluation.spec.seed == 7 and evaluation.spec.max_items == 2
        assert evaluation.spec.rewards[0].WhichOneof("source") == "exact_match"
        assert queue.sent == [(evaluation.id, "cpu")]  # enqueued after commit
        assert await _get(stub, tenant_a, evaluation.id) == evaluation

        # The same row through REST.
        rest = client.get(f"/v1/evaluations/{evaluation.id}", headers=tenant_a).json()
        assert rest["status"] == "queued" and rest["spec"]["max_items"] == 2 and rest["name"] == "held-out"
        assert client.get("/v1/jobs", headers=tenant_a).json()["data"] == []  # not a training job

        second = await _create(stub, tenant_a)
        listed = await stub.ListEvaluations(evaluations_pb2.ListEvaluationsRequest(page_size=1), metadata=auth)
        assert [e.id for e in listed.evaluations] == [second] and listed.next_page_token == second
        rest_of = await stub.ListEvaluations(
            evaluations_pb2.ListEvaluationsRequest(page_token=listed.next_page_token), metadata=auth
        )
        assert [e.id for e in rest_of.evaluations] == [evaluation.id] and rest_of.next_page_token == ""

    async def test_a_spec_created_over_grpc_reads_the_same_over_rest(
        self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue, client: TestClient
    ) -> None:
        dataset = make_dataset(tenant_a.tenant_id)
        eid = await _create(stub, tenant_a, dataset, temperature=0.0, samples_per_item=1, top_p=0.5, max_tokens=32)
        got = await _get(stub, tenant_a, eid)
        assert got.spec.HasField("temperature") and got.spec.temperature == 0.0  # greedy, not "unset"
        rest = client.get(f"/v1/evaluations/{eid}", headers=tenant_a).json()["spec"]
        assert rest == {
            "name": None, "model": "builtin:tiny-instruct", "dataset": dataset,
            "rewards": rest["rewards"], "samples_per_item": 1, "temperature": 0.0, "top_p": 0.5, "max_tokens": 32,
            "max_items": None, "seed": 7, "metadata": {},
        }
        assert [r["name"] for r in rest["rewards"]] == ["exact_match"]


class TestBadInput:
    @pytest.mark.parametrize(
        ("fields", "field"),
        [
            ({"samples_per_item": 0}, "spec.samples_per_item"),
            ({"samples_per_item": 65}, "spec.samples_per_item"),
            ({"max_tokens": 0}, "spec.max_tokens"),
            ({"model": "builtin:nope"}, "spec.model"),
            ({"rewards": []}, "spec.rewards"),
        ],
    )
    async def test_bad_fields_name_them(
        self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue, fields: dict[str, Any], field: str
    ) -> None:
        request = evaluations_pb2.CreateEvaluationRequest(spec=spec_message(make_dataset(tenant_a.tenant_id), **fields))
        err = await _fails(stub.CreateEvaluation, request, bearer(tenant_a.api_key))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert error_field(err) == field, err.details()
        assert (err.details() or "").startswith(f"{field}:")
        assert queue.sent == []

    async def test_unknown_and_foreign_datasets_name_the_field_alike(
        self, stub: Stub, tenant_a: TenantHeaders, tenant_b: TenantHeaders, queue: RecordingQueue
    ) -> None:
        auth = bearer(tenant_a.api_key)
        theirs = make_dataset(tenant_b.tenant_id)
        foreign = await _fails(
            stub.CreateEvaluation, evaluations_pb2.CreateEvaluationRequest(spec=spec_message(theirs)), auth
        )
        unknown = await _fails(
            stub.CreateEvaluation, evaluations_pb2.CreateEvaluationRequest(spec=spec_message("ds_missing")), auth
        )
        for err in (foreign, unknown):
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(err) == "spec.dataset"
        assert (foreign.details() or "").replace(theirs, "ID") == (unknown.details() or "").replace("ds_missing", "ID")
        assert queue.sent == []

    async def test_paging_and_compare_fields(self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue) -> None:
        auth = bearer(tenant_a.api_key)
        eid = await _create(stub, tenant_a)
        cases: list[tuple[Any, Any, str]] = [
            (stub.ListEvaluationItems, evaluations_pb2.ListEvaluationItemsRequest(evaluation_id=eid, after_index=-1),
             "after_index"),
            (stub.ListEvaluationItems, evaluations_pb2.ListEvaluationItemsRequest(evaluation_id=eid, page_size=501),
             "page_size"),
            (stub.ListEvaluations, evaluations_pb2.ListEvaluationsRequest(page_size=101), "page_size"),
            (stub.CompareEvaluations, evaluations_pb2.CompareEvaluationsRequest(evaluation_b=eid), "evaluation_a"),
        ]
        for call, request, field in cases:
            err = await _fails(call, request, auth)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(err) == field, (field, err.details())


class TestCancelAndResume:
    async def test_cancel_then_cancel_again(self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue) -> None:
        auth = bearer(tenant_a.api_key)
        eid = await _create(stub, tenant_a)
        request = evaluations_pb2.CancelEvaluationRequest(evaluation_id=eid)
        cancelled = (await stub.CancelEvaluation(request, metadata=auth)).evaluation
        assert cancelled.id == eid and cancelled.state == jobs_pb2.JOB_STATE_CANCELLED
        assert cancelled.HasField("finished_at")
        err = await _fails(stub.CancelEvaluation, request, auth)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION

    async def test_resume_a_paused_evaluation_only(
        self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        auth = bearer(tenant_a.api_key)
        eid = await _create(stub, tenant_a)
        request = evaluations_pb2.ResumeEvaluationRequest(evaluation_id=eid)
        err = await _fails(stub.ResumeEvaluation, request, auth)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # queued, not paused
        attempt = start_job(eid)
        with session_scope() as session:
            worker_transition(session, eid, attempt, JobStatus.paused, reason="reward endpoint unavailable")
        assert (await _get(stub, tenant_a, eid)).state == jobs_pb2.JOB_STATE_PAUSED
        resumed = (await stub.ResumeEvaluation(request, metadata=auth)).evaluation
        assert resumed.state == jobs_pb2.JOB_STATE_QUEUED
        assert queue.sent == [(eid, "cpu"), (eid, "cpu")]


class TestResults:
    async def test_a_succeeded_evaluation_reads_as_over_rest(
        self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue, client: TestClient
    ) -> None:
        rewards = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
        eid = await _create(stub, tenant_a)
        run_as_worker(eid, rewards)
        got = await _get(stub, tenant_a, eid)
        assert got.state == jobs_pb2.JOB_STATE_SUCCEEDED and got.HasField("finished_at")
        assert (got.progress.items_done, got.progress.items_total) == (5, 5)
        results = got.results
        assert (results.items, results.samples, results.abstained, results.k) == (5, 10, 0, 2)
        assert results.binary and results.accuracy == pytest.approx(6 / 10)
        assert results.pass_at_k == pytest.approx(4 / 5)
        assert (results.tokens_generated, results.device_seconds) == (15, pytest.approx(1.5))
        assert results.accuracy_interval.low <= results.accuracy <= results.accuracy_interval.high
        rest = client.get(f"/v1/evaluations/{eid}", headers=tenant_a).json()["results"]
        for name in ("mean_reward", "accuracy", "pass_at_k"):
            assert getattr(results, name) == rest[name], name
            assert _interval(getattr(results, f"{name}_interval")) == rest[f"{name}_interval"], name

    async def test_items_pages_and_abstentions(
        self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue, client: TestClient
    ) -> None:
        rewards: list[list[float | None]] = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [1.0, None]]
        eid = await _create(stub, tenant_a)
        run_as_worker(eid, rewards)
        results = (await _get(stub, tenant_a, eid)).results
        assert results.abstained == 1 and not results.binary and results.mean_reward == pytest.approx(0.6)
        # Undefined for non-binary rewards: unset, as REST's null.
        assert not any(results.HasField(name) for name in ("accuracy", "accuracy_interval", "pass_at_k"))
        rest = client.get(f"/v1/evaluations/{eid}", headers=tenant_a).json()["results"]
        assert rest["accuracy"] is None and rest["mean_reward"] == results.mean_reward

        auth = bearer(tenant_a.api_key)
        first = await stub.ListEvaluationItems(
            evaluations_pb2.ListEvaluationItemsRequest(evaluation_id=eid, page_size=2), metadata=auth
        )
        assert [i.index for i in first.items] == [0, 1] and first.next_after_index == 1
        after = await stub.ListEvaluationItems(
            evaluations_pb2.ListEvaluationItemsRequest(evaluation_id=eid, after_index=first.next_after_index),
            metadata=auth,
        )
        assert [i.index for i in after.items] == [2, 3, 4] and not after.HasField("next_after_index")
        item = after.items[1]
        assert (item.prompt, list(item.completions)) == ("q3", ["c3.0", "c3.1"])
        assert [r.value for r in item.rewards] == [0.0, 1.0] and item.score == 0.5
        assert [dict(s.values) for s in item.sources] == [{"exact_match": 0.0}, {"exact_match": 1.0}]
        abstained = after.items[2]  # every source abstained on its second completion
        assert [r.HasField("value") for r in abstained.rewards] == [True, False]
        assert [dict(s.values) for s in abstained.sources] == [{"exact_match": 1.0}, {}]
        rest_items = client.get(f"/v1/evaluations/{eid}/items", params={"after": 1}, headers=tenant_a).json()["data"]
        assert [(i["index"], i["score"]) for i in rest_items] == [(i.index, i.score) for i in after.items]
        assert rest_items[2]["rewards"] == [1.0, None]


class TestCompare:
    async def _two(
        self, stub: Stub, tenant: TenantHeaders, a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]
    ) -> tuple[str, str]:
        dataset = make_dataset(tenant.tenant_id)
        ids = []
        for rewards in (a, b):
            eid = await _create(stub, tenant, dataset, samples_per_item=len(rewards[0]))
            run_as_worker(eid, rewards)
            ids.append(eid)
        return ids[0], ids[1]

    async def test_a_clearly_better_evaluation(
        self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue, client: TestClient
    ) -> None:
        ida, idb = await self._two(stub, tenant_a, [[0.0]] * 30, [[1.0]] * 25 + [[0.0]] * 5)
        request = evaluations_pb2.CompareEvaluationsRequest(evaluation_a=ida, evaluation_b=idb, seed=3)
        comparison = (await stub.CompareEvaluations(request, metadata=bearer(tenant_a.api_key))).comparison
        assert (comparison.evaluation_a, comparison.evaluation_b) == (ida, idb)
        assert comparison.metric == evaluations_pb2.COMPARISON_METRIC_ACCURACY
        assert comparison.test == evaluations_pb2.COMPARISON_TEST_MCNEMAR_EXACT
        assert comparison.items == 30 and comparison.difference == pytest.approx(25 / 30)
        assert (comparison.mean_a, comparison.mean_b) == (0.0, pytest.approx(25 / 30))
        assert comparison.interval.low > 0
        assert comparison.p_value == pytest.approx(2 * 0.5**25)
        assert (comparison.b_better, comparison.a_better) == (25, 0)
        assert sorted(f.index for f in comparison.flipped) == list(range(25))
        assert {(f.score_a, f.score_b) for f in comparison.flipped} == {(0.0, 1.0)}
        # The same numbers as REST's, for the same seed.
        rest = client.post("/v1/evaluations/compare", headers=tenant_a,
                           json={"evaluation_a": ida, "evaluation_b": idb, "seed": 3}).json()
        assert _interval(comparison.interval) == rest["interval"] and comparison.p_value == rest["p_value"]
        assert (rest["metric"], rest["test"]) == ("accuracy", "mcnemar_exact")

    async def test_mean_reward_and_permutation(
        self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        rewards = [[0.5, 0.25], [0.0, 1.0], [0.75, 0.75]] * 4
        ida, idb = await self._two(stub, tenant_a, rewards, rewards)
        request = evaluations_pb2.CompareEvaluationsRequest(evaluation_a=ida, evaluation_b=idb)
        comparison = (await stub.CompareEvaluations(request, metadata=bearer(tenant_a.api_key))).comparison
        assert comparison.metric == evaluations_pb2.COMPARISON_METRIC_MEAN_REWARD
        assert comparison.test == evaluations_pb2.COMPARISON_TEST_PAIRED_PERMUTATION
        assert comparison.difference == 0 and comparison.interval.low <= 0 <= comparison.interval.high
        assert list(comparison.flipped) == []

    async def test_unfinished_or_other_dataset_is_refused(
        self, stub: Stub, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        auth = bearer(tenant_a.api_key)
        done = await _create(stub, tenant_a)
        run_as_worker(done, [[1.0, 0.0]] * 3)
        queued = await _create(stub, tenant_a)
        err = await _fails(stub.CompareEvaluations,
                           evaluations_pb2.CompareEvaluationsRequest(evaluation_a=done, evaluation_b=queued), auth)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and error_code(err) == "evaluation_not_finished"
        assert error_field(err) == "evaluation_b"
        await stub.CancelEvaluation(evaluations_pb2.CancelEvaluationRequest(evaluation_id=queued), metadata=auth)
        other = await _create(stub, tenant_a)  # another dataset
        run_as_worker(other, [[1.0, 0.0]] * 3)
        err = await _fails(stub.CompareEvaluations,
                           evaluations_pb2.CompareEvaluationsRequest(evaluation_a=done, evaluation_b=other), auth)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(err) == "evaluation_b"


class TestIsolation:
    async def test_another_tenants_evaluation_is_an_unknown_one_on_every_rpc(
        self, stub: Stub, tenant_a: TenantHeaders, tenant_b: TenantHeaders, queue: RecordingQueue
    ) -> None:
        eid = await _create(stub, tenant_a)
        run_as_worker(eid, [[1.0, 0.0]] * 3)
        own = await _create(stub, tenant_b)  # tenant b's own succeeded evaluation, to compare with a's
        run_as_worker(own, [[1.0, 0.0]] * 3)
        theirs = bearer(tenant_b.api_key)

        def requests(target: str) -> list[tuple[Any, Any]]:
            return [
                (stub.GetEvaluation, evaluations_pb2.GetEvaluationRequest(evaluation_id=target)),
                (stub.ListEvaluationItems, evaluations_pb2.ListEvaluationItemsRequest(evaluation_id=target)),
                (stub.CancelEvaluation, evaluations_pb2.CancelEvaluationRequest(evaluation_id=target)),
                (stub.ResumeEvaluation, evaluations_pb2.ResumeEvaluationRequest(evaluation_id=target)),
                (stub.CompareEvaluations, evaluations_pb2.CompareEvaluationsRequest(evaluation_a=own, evaluation_b=target)),
                (stub.CompareEvaluations, evaluations_pb2.CompareEvaluationsRequest(evaluation_a=target, evaluation_b=own)),
            ]

        for (call, foreign), (_, unknown) in zip(requests(eid), requests("eval_unknown"), strict=True):
            foreign_err = await _fails(call, foreign, theirs)
            unknown_err = await _fails(call, unknown, theirs)
            assert foreign_err.code() == unknown_err.code() == grpc.StatusCode.NOT_FOUND, (call, foreign_err.details())
            assert foreign_err.details() == f"evaluation {eid!r} not found"
            assert (foreign_err.details() or "").replace(eid, "ID") == \
                (unknown_err.details() or "").replace("eval_unknown", "ID")
            assert error_code(foreign_err) == error_code(unknown_err) == "not_found"
        listed = await stub.ListEvaluations(evaluations_pb2.ListEvaluationsRequest(), metadata=theirs)
        assert [e.id for e in listed.evaluations] == [own]
        # Nothing b tried touched a's evaluation.
        assert (await _get(stub, tenant_a, eid)).state == jobs_pb2.JOB_STATE_SUCCEEDED
