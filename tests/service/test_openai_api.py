"""The OpenAI-compatible door (/openai/v1) in process: files, job creation and its refusals, OpenAI's error
shape (only there), tenant isolation and idempotency. The live run with the official SDK is in
tests/ship/test_openai_client.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.service.factories import TenantHeaders

BASE = "/openai/v1"
ROWS = [
    {"messages": [{"role": "user", "content": f"Repeat the letter {c}"}], "answer": c, "meta": {"tags": [c]}}
    for c in "abcd"
]
EXACT = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
         "reference": "{{item.answer}}", "operation": "eq"}
SIMILAR = {"type": "text_similarity", "name": "similar", "input": "{{sample.output_text}}",
           "reference": "{{item.answer}}", "evaluation_metric": "rouge_l"}
MULTI = {"type": "multi", "name": "both", "graders": {"exact": EXACT, "similar": SIMILAR},
         "calculate_output": "0.5 * exact + 0.5 * similar"}


def upload(client: TestClient, headers: TenantHeaders, rows: list[dict[str, Any]] = ROWS) -> dict[str, Any]:
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    response = client.post(f"{BASE}/files", headers=headers, files={"file": ("rft.jsonl", body)},
                           data={"purpose": "fine-tune"})
    assert response.status_code == 200, response.text
    return dict(response.json())


def job_body(file_id: str, grader: dict[str, Any] = MULTI, **hyper: Any) -> dict[str, Any]:
    return {
        "model": "builtin:tiny-instruct",
        "training_file": file_id,
        "method": {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": hyper}},
    }


def assert_openai_error(response: Any, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    return dict(error)


class TestFiles:
    def test_upload_list_get_content_delete(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        file = upload(client, tenant_a)
        assert file["object"] == "file" and file["purpose"] == "fine-tune" and file["status"] == "processed"
        assert file["filename"] == "rft.jsonl" and file["bytes"] > 0
        # OpenAI's prefix (client code checks it); the body is the dataset's, so both ids name the same rows.
        assert file["id"].startswith("file-")
        dataset_id = "ds_" + file["id"].removeprefix("file-")
        assert client.get(f"{BASE}/files/{dataset_id}", headers=tenant_a).json() == file
        listed = client.get(f"{BASE}/files", headers=tenant_a).json()
        assert listed["object"] == "list" and [f["id"] for f in listed["data"]] == [file["id"]]
        assert listed["has_more"] is False
        assert client.get(f"{BASE}/files/{file['id']}", headers=tenant_a).json() == file
        content = client.get(f"{BASE}/files/{file['id']}/content", headers=tenant_a)
        assert [json.loads(line) for line in content.content.splitlines()] == ROWS
        # The same file is one of our datasets, its rows read as prompts.
        dataset = client.get(f"/v1/datasets/{dataset_id}", headers=tenant_a).json()
        assert dataset["num_rows"] == len(ROWS) and dataset["id"] == dataset_id
        deleted = client.delete(f"{BASE}/files/{file['id']}", headers=tenant_a).json()
        assert deleted == {"object": "file", "id": file["id"], "deleted": True}
        assert_openai_error(client.get(f"{BASE}/files/{file['id']}", headers=tenant_a), 404, None)

    def test_invalid_line_is_named(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        body = json.dumps(ROWS[0]) + "\n" + json.dumps({"messages": [], "answer": "x"}) + "\n"
        response = client.post(f"{BASE}/files", headers=tenant_a, files={"file": ("bad.jsonl", body.encode())},
                               data={"purpose": "fine-tune"})
        error = assert_openai_error(response, 400, None)
        assert "line 2" in error["message"] and "messages" in error["message"], error

    def test_purpose_must_be_fine_tune(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = client.post(f"{BASE}/files", headers=tenant_a, files={"file": ("a.jsonl", b"{}")},
                               data={"purpose": "batch"})
        assert_openai_error(response, 400, "purpose")

    def test_other_tenant_sees_nothing(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        file = upload(client, tenant_a)
        assert client.get(f"{BASE}/files", headers=tenant_b).json()["data"] == []
        assert_openai_error(client.get(f"{BASE}/files/{file['id']}/content", headers=tenant_b), 404, None)


class TestCreateJob:
    def test_job_is_an_ordinary_job(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        file = upload(client, tenant_a)
        body = job_body(file["id"], n_epochs=2, batch_size=2, learning_rate_multiplier=3.0, compute_multiplier=0.5)
        body.update(suffix="letters", seed=7, metadata={"team": "rl"})
        response = client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=body)
        assert response.status_code == 200, response.text
        job = response.json()
        assert job["object"] == "fine_tuning.job" and job["status"] == "queued" and job["seed"] == 7
        assert job["method"]["reinforcement"]["grader"]["graders"]["exact"]["operation"] == "eq"
        assert job["training_file"] == file["id"]
        ours = client.get(f"/v1/jobs/{job['id']}", headers=tenant_a).json()
        assert ours["spec"]["train_dataset"] == "ds_" + file["id"].removeprefix("file-")
        hyper = ours["spec"]["hyperparameters"]
        assert (hyper["num_epochs"], hyper["prompts_per_step"], hyper["num_generations"]) == (2, 2, 4)
        assert hyper["learning_rate"] == pytest.approx(3e-6) and hyper["seed"] == 7
        assert ours["name"] == "letters" and ours["metadata"] == {"team": "rl"}
        assert ours["spec"]["rewards"][0]["type"] == "grader"
        listed = client.get(f"{BASE}/fine_tuning/jobs", headers=tenant_a).json()
        assert [j["id"] for j in listed["data"]] == [job["id"]]
        cancelled = client.post(f"{BASE}/fine_tuning/jobs/{job['id']}/cancel", headers=tenant_a).json()
        assert cancelled["status"] == "cancelled"

    @pytest.mark.parametrize("after", ["99999999999999999999", "9223372036854775808", "-1", "1_0", "٣", " 7", "x"])
    def test_event_cursor_that_is_not_an_event_id(
        self, client: TestClient, tenant_a: TenantHeaders, after: str
    ) -> None:
        job = client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=job_body(upload(client, tenant_a)["id"]))
        events = f"{BASE}/fine_tuning/jobs/{job.json()['id']}/events"
        assert_openai_error(client.get(events, headers=tenant_a, params={"after": after}), 400, "after")
        first = client.get(events, headers=tenant_a, params={"limit": 1}).json()["data"][0]
        largest = client.get(events, headers=tenant_a, params={"after": "9223372036854775807"})
        assert largest.status_code == 200 and largest.json()["data"] == []
        assert client.get(events, headers=tenant_a, params={"after": first["id"]}).status_code == 200

    def test_auto_is_our_defaults(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        file = upload(client, tenant_a)
        auto = dict.fromkeys(("n_epochs", "batch_size", "learning_rate_multiplier", "compute_multiplier",
                              "eval_interval", "eval_samples"), "auto")
        job = client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=job_body(file["id"], **auto)).json()
        hyper = client.get(f"/v1/jobs/{job['id']}", headers=tenant_a).json()["spec"]["hyperparameters"]
        assert (hyper["num_epochs"], hyper["prompts_per_step"], hyper["num_generations"]) == (1, 4, 8)
        assert (hyper["learning_rate"], hyper["eval_every"], hyper["eval_samples"]) == (1e-6, None, 32)

    def test_idempotent_retry_returns_the_same_job(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        file = upload(client, tenant_a)
        headers = {**tenant_a, "Idempotency-Key": "create-1"}
        first = client.post(f"{BASE}/fine_tuning/jobs", headers=headers, json=job_body(file["id"]))
        again = client.post(f"{BASE}/fine_tuning/jobs", headers=headers, json=job_body(file["id"]))
        assert first.status_code == again.status_code == 200
        assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
        assert len(client.get(f"{BASE}/fine_tuning/jobs", headers=tenant_a).json()["data"]) == 1

    def test_grader_field_missing_from_a_line(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        rows = [ROWS[0], ROWS[1], {"messages": ROWS[2]["messages"], "solution": "c"}]
        file = upload(client, tenant_a, rows)
        response = client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=job_body(file["id"]))
        error = assert_openai_error(response, 400, "training_file")
        assert "line 3" in error["message"] and "'answer'" in error["message"], error
        # Nested paths are looked up too: every row has meta.tags[0], none has meta.tags[1].
        deep = {**EXACT, "reference": "{{item.meta.tags[1]}}"}
        response = client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=job_body(file["id"], deep))
        assert "line 1" in assert_openai_error(response, 400, "training_file")["message"]

    def test_unknown_file_and_other_tenants_file(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        file = upload(client, tenant_a)
        response = client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_b, json=job_body(file["id"]))
        assert_openai_error(response, 400, "training_file")


HYPER = "method.reinforcement.hyperparameters"
GRADER = "method.reinforcement.grader"
BAD_HYPERPARAMETERS = [
    ({"n_epochs": 0}, f"{HYPER}.n_epochs"),
    ({"n_epochs": "many"}, f"{HYPER}.n_epochs"),
    ({"batch_size": -1}, f"{HYPER}.batch_size"),
    ({"learning_rate_multiplier": 0}, f"{HYPER}.learning_rate_multiplier"),
    ({"learning_rate_multiplier": 2e6}, f"{HYPER}.learning_rate_multiplier"),
    ({"compute_multiplier": 0.1}, f"{HYPER}.compute_multiplier"),
    ({"compute_multiplier": 100}, f"{HYPER}.compute_multiplier"),
    ({"eval_interval": 5}, f"{HYPER}.eval_interval"),  # no validation_file
    ({"eval_samples": 0}, f"{HYPER}.eval_samples"),
    ({"reasoning_effort": "high"}, f"{HYPER}.reasoning_effort"),
    ({"reasoning_effort": "extreme"}, f"{HYPER}.reasoning_effort"),
    ({"max_steps": 3}, f"{HYPER}.max_steps"),
]
BAD_GRADERS = [
    ({**EXACT, "operation": "contains"}, f"{GRADER}.operation"),
    ({**EXACT, "input": "{{answer}}"}, f"{GRADER}.input"),
    ({**EXACT, "reference": "{{sample.output_tools}}"}, f"{GRADER}.reference"),
    ({**EXACT, "reference": "{{sample.output_text.x}}"}, f"{GRADER}.reference"),
    ({k: v for k, v in EXACT.items() if k != "name"}, f"{GRADER}.name"),
    ({**EXACT, "extra": 1}, f"{GRADER}.extra"),
    ({**SIMILAR, "evaluation_metric": "cosine"}, f"{GRADER}.evaluation_metric"),
    ({**SIMILAR, "evaluation_metric": "meteor"}, f"{GRADER}.evaluation_metric"),
    ({**SIMILAR, "evaluation_metric": "rouge_9"}, f"{GRADER}.evaluation_metric"),
    ({"type": "python", "name": "p", "source": "def grade(sample, item): return 1"}, f"{GRADER}.type"),
    ({"type": "label_model", "name": "l"}, f"{GRADER}.type"),
    ({"type": "regex"}, f"{GRADER}.type"),
    ({"type": "score_model", "name": "s", "model": "gpt-4o", "input": [{"role": "user", "content": "x"}]},
     f"{GRADER}.model"),
    ({"type": "score_model", "name": "s", "model": "rf_x/m", "input": []}, f"{GRADER}.input"),
    ({"type": "score_model", "name": "s", "model": "rf_x/m", "input": [{"role": "user", "content": "x"}],
      "range": [1, 0]}, f"{GRADER}.range"),
    ({"type": "score_model", "name": "s", "model": "rf_missing/m", "input": [{"role": "user", "content": "x"}]},
     f"{GRADER}.model"),
    ({**MULTI, "calculate_output": "exact + __import__('os').getpid()"}, f"{GRADER}.calculate_output"),
    ({**MULTI, "calculate_output": "exact + unknown"}, f"{GRADER}.calculate_output"),
    ({**MULTI, "calculate_output": "exact if similar else 0"}, f"{GRADER}.calculate_output"),
    ({**MULTI, "calculate_output": "exact +"}, f"{GRADER}.calculate_output"),
    ({**MULTI, "calculate_output": "(lambda: 1)()"}, f"{GRADER}.calculate_output"),
    ({**MULTI, "calculate_output": "exact.real"}, f"{GRADER}.calculate_output"),
    ({**MULTI, "calculate_output": "'a' * 9"}, f"{GRADER}.calculate_output"),
    ({**MULTI, "graders": {}}, f"{GRADER}.graders"),
    ({**MULTI, "graders": {"exact": {**EXACT, "operation": "like?"}}}, f"{GRADER}.graders.exact.operation"),
    ({**MULTI, "graders": {"inner": MULTI}}, f"{GRADER}.graders.inner.type"),
    ({**MULTI, "graders": {"not-a-name": EXACT}}, f"{GRADER}.graders.not-a-name"),
]


class TestBadInput:
    @pytest.mark.parametrize(("hyper", "param"), BAD_HYPERPARAMETERS, ids=[p for _, p in BAD_HYPERPARAMETERS])
    def test_hyperparameter(
        self, client: TestClient, tenant_a: TenantHeaders, hyper: dict[str, Any], param: str
    ) -> None:
        response = client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=job_body("ds_any", **hyper))
        assert_openai_error(response, 400, param)

    @pytest.mark.parametrize(("grader", "param"), BAD_GRADERS, ids=[str(i) for i in range(len(BAD_GRADERS))])
    def test_grader(self, client: TestClient, tenant_a: TenantHeaders, grader: dict[str, Any], param: str) -> None:
        file = upload(client, tenant_a)
        response = client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=job_body(file["id"], grader))
        assert_openai_error(response, 400, param)
        validated = client.post(f"{BASE}/fine_tuning/alpha/graders/validate", headers=tenant_a, json={"grader": grader})
        assert_openai_error(validated, 400, param.replace("method.reinforcement.", ""))

    @pytest.mark.parametrize("method", ["supervised", "dpo"])
    def test_other_methods_are_not_supported(self, client: TestClient, tenant_a: TenantHeaders, method: str) -> None:
        body = {"model": "builtin:tiny", "training_file": "ds_any", "method": {"type": method}}
        error = assert_openai_error(client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=body), 400,
                                    "method.type")
        assert "not supported" in error["message"] and error["code"] == "unsupported_method"
        no_method = {"model": "builtin:tiny", "training_file": "ds_any"}
        assert_openai_error(client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=no_method), 400,
                            "method.type")

    def test_unknown_model_and_field(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        file = upload(client, tenant_a)
        body = {**job_body(file["id"]), "model": "builtin:huge"}
        assert_openai_error(client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=body), 400, "model")
        body = {**job_body(file["id"]), "integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}
        assert_openai_error(client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=body), 400,
                            "integrations")
        body = {**job_body(file["id"]), "suffix": "x" * 65}
        assert_openai_error(client.post(f"{BASE}/fine_tuning/jobs", headers=tenant_a, json=body), 400, "suffix")


class TestErrorShape:
    def test_openai_shape_only_under_openai(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        error = assert_openai_error(client.get(f"{BASE}/fine_tuning/jobs/job_nope", headers=tenant_a), 404, None)
        assert error["type"] == "invalid_request_error" and error["code"] == "not_found"
        unauthenticated = assert_openai_error(client.get(f"{BASE}/files"), 401, None)
        assert unauthenticated["type"] == "authentication_error"
        ours = client.get("/v1/jobs/job_nope", headers=tenant_a).json()["error"]
        assert set(ours) == {"code", "message", "details"} and ours["code"] == "not_found"


class TestGraders:
    def test_validate_and_run(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        validated = client.post(f"{BASE}/fine_tuning/alpha/graders/validate", headers=tenant_a,
                                json={"grader": MULTI})
        assert validated.status_code == 200 and validated.json()["grader"]["calculate_output"] == MULTI["calculate_output"]
        run = client.post(f"{BASE}/fine_tuning/alpha/graders/run", headers=tenant_a,
                          json={"grader": MULTI, "model_sample": "b", "item": {"answer": "b"}}).json()
        assert run["reward"] == 1.0 and run["sub_rewards"] == {"exact": 1.0, "similar": 1.0}
        missing = client.post(f"{BASE}/fine_tuning/alpha/graders/run", headers=tenant_a,
                              json={"grader": EXACT, "model_sample": "b", "item": {}}).json()
        assert missing["reward"] == 0.0 and missing["metadata"]["errors"]["invalid_variable_error"] is True
