"""Datasets API: upload (streamed, validated, size-limited), list, get, delete, tenant isolation."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.kit.config import Settings
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, job_spec, recording_queue

__all__ = ["recording_queue"]  # the fixture, re-exported for pytest

Upload = Callable[..., Any]


def jsonl(rows: list[Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


GOOD_ROWS = [
    {"prompt": "What is 2+2?", "answer": "4"},
    {"prompt": [{"role": "user", "content": "Hi"}], "answer": "hello", "level": 1},
]


def upload(client: TestClient, headers: dict[str, str], data: bytes, name: str | None = None) -> Any:
    form = {"name": name} if name is not None else None
    return client.post("/v1/datasets", headers=headers, files={"file": ("train.jsonl", data)}, data=form)


class TestUpload:
    def test_valid_upload_returns_metadata_and_stores_the_bytes(
        self, client: TestClient, tenant_a: TenantHeaders, settings: Settings
    ) -> None:
        data = jsonl(GOOD_ROWS) + b"\n"  # a trailing blank line is allowed
        response = upload(client, tenant_a, data, name="my-set")
        assert response.status_code == 201, response.text
        body = response.json()
        assert set(body) == {"id", "name", "num_rows", "bytes", "sha256", "columns", "created_at"}
        assert body["id"].startswith("ds_")
        assert body["name"] == "my-set"
        assert body["num_rows"] == 2
        assert body["bytes"] == len(data)
        assert body["sha256"] == hashlib.sha256(data).hexdigest()
        assert body["columns"] == ["prompt", "answer", "level"]
        stored = Path(settings.storage_url) / "datasets" / f"{body['id']}.jsonl"
        assert stored.read_bytes() == data

    def test_name_defaults_to_the_filename(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = upload(client, tenant_a, jsonl(GOOD_ROWS))
        assert response.status_code == 201, response.text
        assert response.json()["name"] == "train.jsonl"

    def test_invalid_lines_are_listed_with_their_numbers(
        self, client: TestClient, tenant_a: TenantHeaders, settings: Settings
    ) -> None:
        lines = [json.dumps({"prompt": f"q{i}"}) for i in range(1, 16)]
        lines[2] = json.dumps(["not", "an", "object"])  # line 3
        lines[6] = '{"prompt": "broken'  # line 7
        lines[11] = json.dumps({"question": "no prompt here"})  # line 12
        response = upload(client, tenant_a, "\n".join(lines).encode())
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "dataset_invalid"
        assert [d["line"] for d in error["details"]] == [3, 7, 12]
        assert "object" in error["details"][0]["error"]
        assert "JSON" in error["details"][1]["error"]
        assert "prompt" in error["details"][2]["error"]
        assert not list((Path(settings.storage_url) / "datasets").glob("*")), "rejected upload left a blob"

    @pytest.mark.parametrize(
        ("row", "needle"),
        [
            ({"prompt": ""}, "empty"),
            ({"prompt": []}, "empty"),
            ({"prompt": [{"role": "user"}]}, "content"),
            ({"prompt": [{"role": "user", "content": 3}]}, "content"),
            ({"prompt": 5}, "prompt"),
            ({"prompt": "2+2=\u0000"}, "NUL"),
            ({"prompt": [{"role": "user", "content": "\u0000"}]}, "NUL"),
        ],
    )
    def test_bad_prompts_are_rejected(
        self, client: TestClient, tenant_a: TenantHeaders, row: dict[str, Any], needle: str
    ) -> None:
        response = upload(client, tenant_a, jsonl([GOOD_ROWS[0], row]))
        assert response.status_code == 422
        [detail] = response.json()["error"]["details"]
        assert detail["line"] == 2 and needle in detail["error"]

    def test_at_most_20_errors_are_listed(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = upload(client, tenant_a, b"not json\n" * 50)
        assert response.status_code == 422
        error = response.json()["error"]
        assert [d["line"] for d in error["details"]] == list(range(1, 21))
        assert "50" in error["message"] or "49 more" in error["message"]

    def test_empty_file_is_rejected(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = upload(client, tenant_a, b"\n\n")
        assert response.status_code == 422
        assert response.json()["error"]["details"] == [{"line": None, "error": "the dataset has no rows"}]

    def test_missing_file_field_is_422_naming_it(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = client.post("/v1/datasets", headers=tenant_a, files={"other": ("x", b"{}")})
        assert response.status_code == 422
        assert response.json()["error"]["details"][0]["field"] == "other"
        response = client.post(
            "/v1/datasets", headers=tenant_a, data={"name": "x"}, files={"name2": ("", b"")}
        )
        assert response.status_code == 422

    def test_non_multipart_body_is_422(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        response = client.post("/v1/datasets", headers=tenant_a, content=jsonl(GOOD_ROWS))
        assert response.status_code == 422
        assert response.json()["error"]["details"][0]["field"] == "file"

    def test_over_limit_upload_is_413(
        self, client: TestClient, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch, settings: Settings
    ) -> None:
        monkeypatch.setattr(settings, "max_dataset_bytes", 10_000)
        response = upload(client, tenant_a, jsonl([{"prompt": "x" * 100}] * 200))
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "payload_too_large"
        assert not list((Path(settings.storage_url) / "datasets").glob("*"))

    def test_unauthenticated_upload_is_401(self, client: TestClient, tenant_a: TenantHeaders) -> None:
        assert upload(client, {}, jsonl(GOOD_ROWS)).status_code == 401


class TestReadAndDelete:
    def test_get_list_paginate_delete(
        self, client: TestClient, tenant_a: TenantHeaders, settings: Settings
    ) -> None:
        ids = [upload(client, tenant_a, jsonl(GOOD_ROWS), name=f"d{i}").json()["id"] for i in range(3)]
        got = client.get(f"/v1/datasets/{ids[0]}", headers=tenant_a)
        assert got.status_code == 200 and got.json()["name"] == "d0"

        page1 = client.get("/v1/datasets?limit=2", headers=tenant_a).json()
        assert [d["id"] for d in page1["data"]] == [ids[2], ids[1]]
        assert page1["has_more"] is True and page1["next_after"] == ids[1]
        page2 = client.get(f"/v1/datasets?limit=2&after={page1['next_after']}", headers=tenant_a).json()
        assert [d["id"] for d in page2["data"]] == [ids[0]]
        assert page2["has_more"] is False and page2["next_after"] is None

        assert client.delete(f"/v1/datasets/{ids[1]}", headers=tenant_a).status_code == 204
        assert client.get(f"/v1/datasets/{ids[1]}", headers=tenant_a).status_code == 404
        assert client.delete(f"/v1/datasets/{ids[1]}", headers=tenant_a).status_code == 404
        listed = [d["id"] for d in client.get("/v1/datasets", headers=tenant_a).json()["data"]]
        assert listed == [ids[2], ids[0]]
        assert not (Path(settings.storage_url) / "datasets" / f"{ids[1]}.jsonl").exists()

    @pytest.mark.parametrize("limit", [0, 101, "x"])
    def test_bad_limit_is_422(self, client: TestClient, tenant_a: TenantHeaders, limit: object) -> None:
        response = client.get(f"/v1/datasets?limit={limit}", headers=tenant_a)
        assert response.status_code == 422
        assert response.json()["error"]["details"][0]["field"] == "query.limit"

    def test_other_tenants_dataset_is_the_same_404_as_a_random_id(
        self, client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        dataset_id = upload(client, tenant_a, jsonl(GOOD_ROWS)).json()["id"]
        random_id = "ds_01J00000000000000000000000"
        for method in ("GET", "DELETE"):
            theirs = client.request(method, f"/v1/datasets/{dataset_id}", headers=tenant_b)
            missing = client.request(method, f"/v1/datasets/{random_id}", headers=tenant_b)
            assert theirs.status_code == missing.status_code == 404
            assert theirs.json() == {
                "error": {
                    **missing.json()["error"],
                    "message": missing.json()["error"]["message"].replace(random_id, dataset_id),
                }
            }
        assert client.get("/v1/datasets", headers=tenant_b).json()["data"] == []
        assert client.get(f"/v1/datasets/{dataset_id}", headers=tenant_a).status_code == 200


class TestDeleteWhileInUse:
    def test_409_while_an_unfinished_job_uses_it_then_deletable(
        self, client: TestClient, tenant_a: TenantHeaders, recording_queue: RecordingQueue
    ) -> None:
        train_id = upload(client, tenant_a, jsonl(GOOD_ROWS)).json()["id"]
        eval_id = upload(client, tenant_a, jsonl(GOOD_ROWS)).json()["id"]
        job = client.post("/v1/jobs", headers=tenant_a, json=job_spec(train_id, eval_dataset=eval_id))
        assert job.status_code == 201, job.text
        for dataset_id in (train_id, eval_id):
            response = client.delete(f"/v1/datasets/{dataset_id}", headers=tenant_a)
            assert response.status_code == 409, response.text
            assert response.json()["error"]["code"] == "dataset_in_use"
            assert client.get(f"/v1/datasets/{dataset_id}", headers=tenant_a).status_code == 200

        cancelled = client.post(f"/v1/jobs/{job.json()['id']}/cancel", headers=tenant_a)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        for dataset_id in (train_id, eval_id):
            assert client.delete(f"/v1/datasets/{dataset_id}", headers=tenant_a).status_code == 204
        # The finished job still reads fine: the dataset rows are kept (soft delete).
        assert client.get(f"/v1/jobs/{job.json()['id']}", headers=tenant_a).status_code == 200
