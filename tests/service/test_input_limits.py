"""Bounded inputs on REST: the JSON body limit (enforced while the body streams), job metadata caps, dataset
column caps, free-text caps. Each refusal is a 413/422 naming the limit, and an oversized body is never held.

The server's memory while it refuses them is measured on a real `grpo serve` process in
tests/worker/test_input_memory.py (the in-process test client buffers a request body whole).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from contract.dataset_format import MAX_COLUMN_NAME_CHARS, MAX_COLUMNS
from contract.spec import MAX_METADATA_JSON_BYTES, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS
from service.kit.config import Settings, get_settings
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import job_spec, make_dataset

MIB = 1024 * 1024
LIMIT = 8 * MIB  # GRPO_MAX_REQUEST_BODY_BYTES's default


def metadata_body(spec: dict[str, Any], value_bytes: int) -> Iterator[bytes]:
    """A job spec whose metadata value is `value_bytes` long, produced 1 MiB at a time (never held whole)."""
    head = json.dumps({**spec, "metadata": {"note": ""}})
    before, after = head.rsplit('""', 1)
    yield (before + '"').encode()
    for _ in range(value_bytes // MIB):
        yield b"x" * MIB
    yield ('"' + after).encode()


class TestBodyLimit:
    def test_settings_default(self, settings: Settings) -> None:
        assert settings.max_request_body_bytes == LIMIT

    def test_the_limit_in_force_is_the_served_settings_one(
        self, app: FastAPI, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The app reads its settings when it serves, not when it is built (the test fixture shares one app)."""
        monkeypatch.setenv("GRPO_MAX_REQUEST_BODY_BYTES", str(64 * 1024))
        get_settings.cache_clear()
        with TestClient(app) as client:
            response = client.post("/v1/jobs", content=b"x" * (64 * 1024 + 1), headers=tenant_a)
        assert response.status_code == 413, response.text[:300]
        assert response.json()["error"]["details"] == {"limit_bytes": 64 * 1024}

    @pytest.mark.parametrize("declared", [True, False])
    def test_100_mb_metadata_is_413_within_seconds(
        self, client: TestClient, tenant_a: TenantHeaders, declared: bool
    ) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id))
        body: Any = metadata_body(spec, 100 * MIB)
        headers = {**tenant_a, "content-type": "application/json"}
        if declared:  # Content-Length sent: refused before the body is read
            body = b"".join(body)
            headers["content-length"] = str(len(body))
        started = time.monotonic()
        response = client.post("/v1/jobs", content=body, headers=headers)
        elapsed = time.monotonic() - started
        assert response.status_code == 413, response.text[:300]
        error = response.json()["error"]
        assert error["code"] == "payload_too_large" and error["details"] == {"limit_bytes": LIMIT}
        assert str(LIMIT) in error["message"]
        assert elapsed < 10
        assert client.get("/v1/jobs", headers=tenant_a).json()["data"] == []

    def test_a_body_under_the_limit_still_reaches_validation(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        response = client.post("/v1/jobs", content=b"{" + b" " * MIB + b"}", headers={
            **tenant_a, "content-type": "application/json"})
        assert response.status_code == 422  # parsed, then refused by the schema

    def test_other_json_routes_are_limited_too(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        big = {"name": "r", "url": "https://rewards.example.com/", "headers": {"X-A": "a" * (9 * MIB)}}
        response = client.post("/v1/reward-functions", json=big, headers=tenant_a)
        assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"

    def test_dataset_uploads_keep_their_own_limit(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        rows = b"".join(json.dumps({"prompt": "p" * 1000, "i": i}).encode() + b"\n" for i in range(10_000))
        assert len(rows) > LIMIT
        response = client.post("/v1/datasets", headers=tenant_a, files={"file": ("big.jsonl", rows)})
        assert response.status_code == 201, response.text


class TestMetadataCaps:
    @pytest.mark.parametrize(
        ("metadata", "needle"),
        [
            ({f"k{i}": "v" for i in range(33)}, "at most 32"),
            ({"k" * (MAX_METADATA_KEY_CHARS + 1): "v"}, f"at most {MAX_METADATA_KEY_CHARS}"),
            ({"": "v"}, "at least 1"),
            ({"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}, f"at most {MAX_METADATA_VALUE_CHARS}"),
            ({f"k{i}": "\u00e9" * 1000 for i in range(10)}, f"the limit is {MAX_METADATA_JSON_BYTES}"),
        ],
    )
    def test_oversized_metadata_is_422_naming_the_limit(
        self, client: TestClient, tenant_a: TenantHeaders, metadata: dict[str, str], needle: str
    ) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id), metadata=metadata)
        response = client.post("/v1/jobs", json=spec, headers=tenant_a)
        assert response.status_code == 422, response.text[:300]
        error = response.json()["error"]
        assert error["details"][0]["field"].startswith("body.metadata")
        assert needle in error["message"]

    def test_metadata_at_the_limits_is_accepted(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        metadata = {f"{i:0{MAX_METADATA_KEY_CHARS}d}": "v" * 400 for i in range(32)}
        assert len(json.dumps(metadata).encode()) <= MAX_METADATA_JSON_BYTES
        spec = job_spec(make_dataset(tenant_a.tenant_id), metadata=metadata)
        response = client.post("/v1/jobs", json=spec, headers=tenant_a)
        assert response.status_code == 201, response.text[:300]
        assert response.json()["metadata"] == metadata


class TestFreeTextCaps:
    @pytest.mark.parametrize(
        ("overrides", "field"),
        [
            ({"rewards": [{"type": "builtin", "name": "exact_match", "params": {"answer_column": "a" * 257}}]},
             "body.rewards"),
            ({"lora": {"target_modules": ["q_proj"] * 257}}, "body.lora"),
            ({"lora": {"target_modules": ["q" * 257]}}, "body.lora"),
            ({"base_model": "m" * 513}, "body.base_model"),
        ],
    )
    def test_overlong_free_text_is_422(
        self, client: TestClient, tenant_a: TenantHeaders, overrides: dict[str, Any], field: str
    ) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id), **overrides)
        response = client.post("/v1/jobs", json=spec, headers=tenant_a)
        assert response.status_code == 422, response.text[:300]
        assert response.json()["error"]["details"][0]["field"].startswith(field)


    @pytest.mark.parametrize(
        "metadata", [{f"c{i}": 1 for i in range(MAX_COLUMNS + 1)}, {"c" * (MAX_COLUMN_NAME_CHARS + 1): 1}]
    )
    def test_reward_dry_run_metadata_is_bounded_like_dataset_columns(
        self, client: TestClient, tenant_a: TenantHeaders, metadata: dict[str, int]
    ) -> None:
        created = client.post("/v1/reward-functions", headers=tenant_a,
                              json={"name": "judge", "url": "http://127.0.0.1:9/score"})
        item = {"prompt": "p", "completion": "c", "metadata": metadata}
        response = client.post(f"/v1/reward-functions/{created.json()['id']}/test", headers=tenant_a,
                               json={"items": [item]})
        assert response.status_code == 422, response.text[:300]
        assert response.json()["error"]["details"][0]["field"].startswith("body.items.0.metadata")


def upload(client: TestClient, tenant: TenantHeaders, data: bytes) -> Any:
    return client.post("/v1/datasets", headers=tenant, files={"file": ("train.jsonl", data)})


class TestDatasetColumnCaps:
    def test_a_line_with_200k_columns_is_422_naming_the_line_and_the_limit(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        wide = {"prompt": "p", **{f"c{i}": 0 for i in range(200_000)}}
        data = b'{"prompt": "ok"}\n' + json.dumps(wide).encode() + b"\n"
        started = time.monotonic()
        response = upload(client, tenant_a, data)
        assert time.monotonic() - started < 10
        assert response.status_code == 422, response.text[:300]
        problem = response.json()["error"]["details"][0]
        assert problem["line"] == 2
        assert "200001 columns" in problem["error"] and f"at most {MAX_COLUMNS}" in problem["error"]
        assert client.get("/v1/datasets", headers=tenant_a).json()["data"] == []

    def test_too_many_distinct_columns_across_lines_is_422(
        self, client: TestClient, tenant_a: TenantHeaders
    ) -> None:
        # 4 M distinct keys in all, a few per line: each line is fine, the dataset is not.
        rows = [{"prompt": "p", **{f"k{line}_{j}": 1 for j in range(4)}} for line in range(1000)]
        response = upload(client, tenant_a, b"".join(json.dumps(r).encode() + b"\n" for r in rows))
        assert response.status_code == 422, response.text[:300]
        first = response.json()["error"]["details"][0]
        assert first["line"] == (MAX_COLUMNS - 1) // 4 + 1  # the line that passes MAX_COLUMNS
        assert f"the limit is {MAX_COLUMNS}" in first["error"]

    def test_overlong_column_name_is_422(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        row = {"prompt": "p", "c" * (MAX_COLUMN_NAME_CHARS + 1): 1}
        response = upload(client, tenant_a, json.dumps(row).encode() + b"\n")
        assert response.status_code == 422
        problem = response.json()["error"]["details"][0]
        assert problem["line"] == 1 and f"the limit is {MAX_COLUMN_NAME_CHARS}" in problem["error"]

    def test_columns_at_the_limit_are_accepted(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        row = {"prompt": "p", **{f"{i:0{MAX_COLUMN_NAME_CHARS}d}": i for i in range(MAX_COLUMNS - 1)}}
        response = upload(client, tenant_a, json.dumps(row).encode() + b"\n")
        assert response.status_code == 201, response.text[:300]
        assert len(response.json()["columns"]) == MAX_COLUMNS


class TestJobSizeCaps:
    """Issue 30: `resources.nodes` and `resources.devices` are bounded by the deployment's settings
    (GRPO_MAX_JOB_NODES, GRPO_MAX_JOB_DEVICES), checked at submission with a 422 naming the field and the bound."""

    def test_settings_defaults(self, settings: Settings) -> None:
        assert (settings.max_job_nodes, settings.max_job_devices) == (16, 128)

    @pytest.mark.parametrize(
        ("resources", "field", "bound"),
        [
            ({"devices": 64, "nodes": 64}, "resources.nodes", 16),
            ({"devices": 34, "nodes": 17}, "resources.nodes", 16),
            ({"devices": 256, "nodes": 16}, "resources.devices", 128),
            ({"devices": 129}, "resources.devices", 128),
        ],
    )
    def test_a_job_past_the_bounds_is_422_naming_the_field_and_the_bound(
        self, client: TestClient, tenant_a: TenantHeaders, resources: dict[str, int], field: str, bound: int
    ) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id), resources=resources)
        spec["hyperparameters"]["prompts_per_step"] = resources["devices"]  # whole groups per device
        response = client.post("/v1/jobs", json=spec, headers=tenant_a)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "validation_error"
        assert error["details"][0]["field"] == field and error["details"][0]["limit"] == bound
        assert error["message"] == f"{field}: must be at most {bound} (this service's limit), got {resources[field[10:]]}"
        assert client.get("/v1/jobs", headers=tenant_a).json()["data"] == []

    def test_the_review_s_1024_nodes_are_refused(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        spec = job_spec(make_dataset(tenant_a.tenant_id), resources={"devices": 1024, "nodes": 1024})
        response = client.post("/v1/jobs", json=spec, headers=tenant_a)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["details"][0]["field"].endswith("resources.nodes")

    def test_the_bounds_follow_the_settings(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from service.kit.config import get_settings

        monkeypatch.setenv("GRPO_MAX_JOB_NODES", "2")
        monkeypatch.setenv("GRPO_MAX_JOB_DEVICES", "4")
        get_settings.cache_clear()
        dataset = make_dataset(tenant_a.tenant_id)
        too_wide = job_spec(dataset, resources={"devices": 4, "nodes": 4})
        too_many = job_spec(dataset, resources={"devices": 8, "nodes": 2})
        fits = job_spec(dataset, resources={"devices": 4, "nodes": 2})
        for spec in (too_wide, too_many, fits):
            spec["hyperparameters"]["prompts_per_step"] = spec["resources"]["devices"]
        for spec, field in ((too_wide, "resources.nodes"), (too_many, "resources.devices")):
            response = client.post("/v1/jobs", json=spec, headers=tenant_a)
            assert response.status_code == 422 and response.json()["error"]["details"][0]["field"] == field
        assert client.post("/v1/jobs", json=fits, headers=tenant_a).status_code == 201, "4 devices on 2 nodes fit"
