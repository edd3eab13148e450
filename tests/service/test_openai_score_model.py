"""POST /openai/v1/fine_tuning/alpha/graders/run with score_model graders against a real OpenAI-compatible chat
endpoint on loopback, registered as a reward function whose URL is its chat completions URL (docs/openai.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.service.factories import TenantHeaders
from tests.worker.chat_servers import Answer, chat_server, judge, user_text
from tests.worker.reward_servers import closed_port

RUN = "/openai/v1/fine_tuning/alpha/graders/run"
PROMPT = "Question: {{item.question}}\nAnswer: {{sample.output_text}}\nReference: {{item.answer}}"
ITEM = {"question": "What is 6 x 7?", "answer": "42"}


def register(client: TestClient, auth: TenantHeaders, url: str) -> str:
    response = client.post("/v1/reward-functions", headers=auth,
                           json={"name": "judge", "url": url, "headers": {"Authorization": "Bearer sk-judge"}})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def score_model(rf_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "type": "score_model", "name": "judge", "model": f"{rf_id}/judge-7b",
        "input": [{"role": "system", "content": "Grade the answer from 0 to 1."},
                  {"role": "user", "content": PROMPT}],
        **fields,
    }


def run(client: TestClient, auth: TenantHeaders, grader: dict[str, Any], sample: str,
        item: dict[str, Any] = ITEM) -> dict[str, Any]:
    response = client.post(RUN, headers=auth, json={"grader": grader, "model_sample": sample, "item": item})
    assert response.status_code == 200, response.text
    return dict(response.json())


def errors_set(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result["metadata"]["errors"].items() if v}


class TestScoreModel:
    def test_score_is_the_models_and_the_server_gets_the_rendered_prompt(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        with chat_server(judge) as server:
            grader = score_model(register(client, tenant_a, server.url),
                                 sampling_params={"temperature": 0, "seed": 3, "max_completions_tokens": 16})
            right = run(client, tenant_a, grader, "42")
            wrong = run(client, tenant_a, grader, "41")
        assert right["reward"] == 0.9 and right["sub_rewards"] == {"judge": 0.9}, right
        assert wrong["reward"] == 0.2, wrong
        assert errors_set(right) == {} and right["metadata"]["type"] == "score_model"
        assert len(server.seen) == 2
        sent = server.seen[0]
        assert sent.body["model"] == "judge-7b"  # the reward function id is ours, not the endpoint's
        assert sent.messages == [
            {"role": "system", "content": "Grade the answer from 0 to 1."},
            {"role": "user", "content": "Question: What is 6 x 7?\nAnswer: 42\nReference: 42"},
        ]
        assert (sent.body["temperature"], sent.body["seed"], sent.body["max_tokens"]) == (0, 3, 16)
        assert sent.headers["authorization"] == "Bearer sk-judge"
        assert user_text(server.seen[1].body).endswith("Answer: 41\nReference: 42")

    def test_range_is_the_graders(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        with chat_server(lambda body: "Score: 7 out of 10") as server:
            grader = score_model(register(client, tenant_a, server.url), range=[0, 10])
            assert run(client, tenant_a, grader, "42")["reward"] == 7.0
            # The same reply is outside a [0, 5] range: the lowest score.
            assert run(client, tenant_a, {**grader, "range": [1, 5]}, "42")["reward"] == 1.0

    @pytest.mark.parametrize("reply", ["I cannot grade this.", '{"result": "good"}', '{"result": 3}', ""])
    def test_reply_without_a_usable_number_is_the_lowest_score(
        self, client: TestClient, tenant_a: TenantHeaders, reply: str
    ) -> None:
        with chat_server(lambda body: reply) as server:
            grader = score_model(register(client, tenant_a, server.url), range=[-1, 1])
            result = run(client, tenant_a, grader, "42")
        assert result["reward"] == -1.0 and result["sub_rewards"] == {"judge": -1.0}, result
        assert len(server.seen) == 1

    # The endpoint's words never reach the tenant (in development a grader may name a private address, whose
    # answer would otherwise be read back through the error): its code and status do, the rest is logged.
    @pytest.mark.parametrize(("answer", "reason", "secret"), [
        (Answer(500, b'{"error": "overloaded: internal-db-7 at 10.1.2.3"}'), "reward_endpoint_unavailable",
         "internal-db-7"),
        (Answer(404, b'{"error": {"message": "model judge-7b does not exist; admin token t0p-s3cret"}}'),
         "the endpoint answered HTTP 404", "t0p-s3cret"),
        (Answer(200, b'{"rewards": [1.0], "leak": "root:x:0:0"}'), "reward_endpoint_invalid_response", "root:x"),
        (Answer(200, b'root:x:0:0:root:/root:/bin/bash not json'), "reward_endpoint_invalid_response", "root:x"),
        (Answer(302, b"", {"location": "http://169.254.169.254/latest/meta-data/iam"}), "HTTP 302", "169.254"),
    ])
    def test_failing_endpoint_is_a_server_error_flag_without_the_endpoints_words(
        self, client: TestClient, tenant_a: TenantHeaders, answer: Answer, reason: str, secret: str,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        with chat_server(lambda body: answer) as server:
            grader = score_model(register(client, tenant_a, server.url))
            response = client.post(RUN, headers=tenant_a, json={"grader": grader, "model_sample": "42", "item": ITEM})
        assert response.status_code == 200, response.text
        result = response.json()
        errors = errors_set(result)
        assert errors.keys() == {"model_grader_server_error", "model_grader_server_error_details"}, result
        details = errors["model_grader_server_error_details"]
        assert reason in details and "score_model:judge" in details, details
        assert secret not in response.text, response.text
        assert result["reward"] == 0.0
        assert len(server.seen) == 1  # one attempt: the caller sees a failing endpoint at once

    def test_endpoint_down_is_a_server_error_flag(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        url = f"http://127.0.0.1:{closed_port()}/v1/chat/completions"
        result = run(client, tenant_a, score_model(register(client, tenant_a, url)), "42")
        errors = errors_set(result)
        assert errors.keys() == {"model_grader_server_error", "model_grader_server_error_details"}, result
        assert "reward_endpoint_unavailable" in errors["model_grader_server_error_details"]

    def test_unknown_reward_function_is_a_400_naming_model(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = client.post(RUN, headers=tenant_a,
                               json={"grader": score_model("rf_missing"), "model_sample": "42", "item": ITEM})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "grader.model"

    def test_other_tenants_endpoint_is_not_found(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        with chat_server(judge) as server:
            grader = score_model(register(client, tenant_a, server.url))
            response = client.post(RUN, headers=tenant_b, json={"grader": grader, "model_sample": "42", "item": ITEM})
        assert response.status_code == 400 and response.json()["error"]["param"] == "grader.model"
        assert server.seen == []

    @pytest.mark.filterwarnings("error")  # and leaves no coroutine un-awaited behind
    def test_unrenderable_prompt_is_not_sent(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        with chat_server(judge) as server:
            rf_id = register(client, tenant_a, server.url)
            missing = run(client, tenant_a, score_model(rf_id), "42", item={"question": "q"})
            as_json = score_model(rf_id, range=[-1, 1], input=[
                {"role": "user", "content": "Answer: {{sample.output_json.value}}\nReference: {{item.answer}}"}])
            not_json = run(client, tenant_a, as_json, "42 apples")
            parsed = run(client, tenant_a, as_json, json.dumps({"value": "42"}))
        assert errors_set(missing) == {"invalid_variable_error": True, "other_error": True}, missing
        assert errors_set(not_json) == {"sample_parse_error": True} and not_json["reward"] == -1.0
        assert parsed["reward"] == 0.9
        assert [user_text(s.body) for s in server.seen] == ["Answer: 42\nReference: 42"]


class TestMulti:
    def test_formula_combines_the_model_and_the_string_check(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        def by_answer(body: dict[str, Any]) -> str:
            return "8" if "Answer: 42" in user_text(body) else "3"

        with chat_server(by_answer) as server:
            judge_grader = {**score_model(register(client, tenant_a, server.url)), "range": [0, 10]}
            exact = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                     "reference": "{{item.answer}}", "operation": "eq"}
            grader = {"type": "multi", "name": "both", "graders": {"judge": judge_grader, "exact": exact},
                      "calculate_output": "0.5 * exact + 0.05 * judge"}
            right = run(client, tenant_a, grader, "42")
            wrong = run(client, tenant_a, grader, "41")
        assert right["sub_rewards"] == {"judge": 8.0, "exact": 1.0}, right
        assert right["reward"] == pytest.approx(0.9) and errors_set(right) == {}
        assert wrong["sub_rewards"] == {"judge": 3.0, "exact": 0.0}, wrong
        assert wrong["reward"] == pytest.approx(0.15)
        assert right["metadata"]["type"] == "multi" and len(server.seen) == 2

    def test_failing_model_fails_the_multi_grader(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        with chat_server(lambda body: Answer(503)) as server:
            exact = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                     "reference": "{{item.answer}}", "operation": "eq"}
            grader = {"type": "multi", "name": "both", "calculate_output": "exact + judge",
                      "graders": {"judge": score_model(register(client, tenant_a, server.url)), "exact": exact}}
            result = run(client, tenant_a, grader, "42")
        assert errors_set(result)["model_grader_server_error"] is True and result["reward"] == 0.0
        assert len(server.seen) == 1

    def test_sub_graders_of_the_same_name_call_their_own_endpoints(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        with chat_server(lambda body: "0.25") as strict, chat_server(lambda body: "0.75") as lenient:
            # A multi grader's keys must differ; the names of its graders need not.
            graders = {"strict": score_model(register(client, tenant_a, strict.url)),
                       "lenient": score_model(register(client, tenant_a, lenient.url))}
            grader = {"type": "multi", "name": "both", "graders": graders, "calculate_output": "strict + 2 * lenient"}
            result = run(client, tenant_a, grader, "42")
        assert result["sub_rewards"] == {"strict": 0.25, "lenient": 0.75}, result
        assert result["reward"] == 1.75
        assert len(strict.seen) == len(lenient.seen) == 1
