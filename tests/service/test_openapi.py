"""The OpenAPI document: every endpoint of the contract, job spec examples, the error shape, /docs."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from contract.spec import JobSpec

CONTRACT = {
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("post", "/v1/datasets"),
    ("get", "/v1/datasets"),
    ("get", "/v1/datasets/{dataset_id}"),
    ("delete", "/v1/datasets/{dataset_id}"),
    ("post", "/v1/reward-functions"),
    ("get", "/v1/reward-functions"),
    ("get", "/v1/reward-functions/{reward_function_id}"),
    ("delete", "/v1/reward-functions/{reward_function_id}"),
    ("post", "/v1/reward-functions/{reward_function_id}/rotate-secret"),
    ("post", "/v1/jobs"),
    ("get", "/v1/jobs"),
    ("get", "/v1/jobs/{job_id}"),
    ("post", "/v1/jobs/{job_id}/cancel"),
    ("post", "/v1/jobs/{job_id}/pause"),
    ("post", "/v1/jobs/{job_id}/resume"),
    ("get", "/v1/jobs/{job_id}/events"),
    ("get", "/v1/jobs/{job_id}/metrics"),
    ("get", "/v1/jobs/{job_id}/samples"),
    ("get", "/v1/jobs/{job_id}/stream"),
    ("get", "/v1/jobs/{job_id}/checkpoints"),
    ("get", "/v1/checkpoints"),
    ("get", "/v1/checkpoints/{checkpoint_id}"),
    ("get", "/v1/checkpoints/{checkpoint_id}/files/{path}"),
    ("get", "/v1/checkpoints/{checkpoint_id}/archive"),
}


def resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


class TestOpenApi:
    def test_every_endpoint_is_documented(self, app: FastAPI) -> None:
        doc = app.openapi()
        documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
        assert CONTRACT <= documented, sorted(CONTRACT - documented)
        for method, path in CONTRACT:
            operation = doc["paths"][path][method]
            assert operation.get("summary"), (method, path)

    def test_job_spec_has_examples(self, app: FastAPI) -> None:
        doc = app.openapi()
        body = doc["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]
        examples = body["examples"]
        assert len(examples) >= 2
        for example in examples.values():
            JobSpec.model_validate(example["value"])  # the documented examples are valid specs
        headers = [p["name"] for p in doc["paths"]["/v1/jobs"]["post"]["parameters"]]
        assert "Idempotency-Key" in headers

    def test_error_shape_is_documented_on_job_routes(self, app: FastAPI) -> None:
        doc = app.openapi()
        for path, ops in doc["paths"].items():
            if not path.startswith(("/v1/jobs", "/v1/checkpoints")):
                continue
            for method, operation in ops.items():
                for status in ("401", "404"):
                    if status == "404" and "{" not in path:
                        continue
                    response = operation["responses"][status]
                    schema = resolve(doc, response["content"]["application/json"]["schema"])
                    error = resolve(doc, schema["properties"]["error"])
                    assert {"code", "message", "details"} <= set(error["properties"]), (method, path)
        assert "default" in doc["paths"]["/v1/jobs"]["post"]["responses"]

    def test_docs_are_served(self, client: TestClient) -> None:
        assert client.get("/docs").status_code == 200
        assert client.get("/openapi.json").json()["info"]["title"]
