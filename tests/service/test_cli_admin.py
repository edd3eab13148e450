"""`grpo migrate` and `grpo admin create-tenant/create-key`, run as real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, inspect

from service.kit.config import Settings
from tests.service.jobs_support import job_spec, make_dataset

GRPO = str(Path(sys.executable).parent / "grpo")


def grpo(*args: str, database_url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "GRPO_DATABASE_URL": database_url,
        "GRPO_DATA_DIR": str(tmp_path / "cli-data"),
        "GRPO_BROKER_URL": "memory://",
    }
    return subprocess.run([GRPO, *args], env=env, capture_output=True, text=True, timeout=120, check=False)


def test_migrate_builds_the_schema_and_is_idempotent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    for _ in range(2):
        result = grpo("migrate", database_url=url, tmp_path=tmp_path)
        assert result.returncode == 0, result.stderr
    engine = create_engine(url)
    try:
        assert {"tenants", "api_keys", "datasets", "reward_functions"} <= set(
            inspect(engine).get_table_names()
        )
    finally:
        engine.dispose()


def test_create_tenant_and_keys_print_working_keys_once(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    url = settings.database_url
    created = grpo("admin", "create-tenant", "acme", database_url=url, tmp_path=tmp_path)
    assert created.returncode == 0, created.stderr
    first_key = created.stdout.strip()
    assert first_key.startswith("grpo_sk_") and "\n" not in first_key
    assert "ten_" in created.stderr

    second = grpo("admin", "create-key", "acme", database_url=url, tmp_path=tmp_path)
    assert second.returncode == 0, second.stderr
    second_key = second.stdout.strip()
    assert second_key.startswith("grpo_sk_") and second_key != first_key

    for key in (first_key, second_key):
        response = client.get("/v1/datasets", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_admin_errors_exit_non_zero(client: TestClient, settings: Settings, tmp_path: Path) -> None:
    url = settings.database_url
    assert grpo("admin", "create-tenant", "dup", database_url=url, tmp_path=tmp_path).returncode == 0
    duplicate = grpo("admin", "create-tenant", "dup", database_url=url, tmp_path=tmp_path)
    assert duplicate.returncode == 1 and "already exists" in duplicate.stderr and not duplicate.stdout
    missing = grpo("admin", "create-key", "nobody", database_url=url, tmp_path=tmp_path)
    assert missing.returncode == 1 and "not found" in missing.stderr and not missing.stdout
    bad_name = grpo("admin", "create-tenant", "bad name!", database_url=url, tmp_path=tmp_path)
    assert bad_name.returncode == 1 and "tenant name" in bad_name.stderr


def test_admin_quotas_shows_and_changes_a_tenants_overrides(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    url = settings.database_url
    created = grpo("admin", "create-tenant", "acme", database_url=url, tmp_path=tmp_path)
    key, tenant_id = created.stdout.strip(), created.stderr.split("tenant: ")[1].split()[0]
    changed = grpo(
        "admin", "quotas", "acme", "--max-running-jobs", "2", "--max-queued-jobs", "0",
        database_url=url, tmp_path=tmp_path,
    )
    assert changed.returncode == 0, changed.stderr
    lines = changed.stdout.splitlines()
    assert any(line.split()[:3] == ["max_running_jobs", "2", "(override)"] for line in lines), changed.stdout
    assert any(line.split()[:3] == ["max_devices", "no", "limit"] for line in lines), changed.stdout
    response = client.post(
        "/v1/jobs", json=job_spec(make_dataset(tenant_id)), headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 429 and response.json()["error"]["details"]["quota"] == "max_queued_jobs"

    reset = grpo("admin", "quotas", "acme", "--max-queued-jobs", "default", database_url=url, tmp_path=tmp_path)
    assert reset.returncode == 0, reset.stderr
    assert any(line.split()[:3] == ["max_queued_jobs", str(settings.quota_max_queued_jobs), "(default)"]
               for line in reset.stdout.splitlines()), reset.stdout
    assert any(line.split()[:3] == ["max_running_jobs", "2", "(override)"] for line in reset.stdout.splitlines())

    bad = grpo("admin", "quotas", "acme", "--max-devices", "lots", database_url=url, tmp_path=tmp_path)
    assert bad.returncode == 2 and "--max-devices" in bad.stderr
    negative = grpo("admin", "quotas", "acme", "--max-devices", "-1", database_url=url, tmp_path=tmp_path)
    assert negative.returncode == 1 and "max_devices" in negative.stderr
