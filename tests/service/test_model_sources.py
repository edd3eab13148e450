"""Model sources are owned: `base_model` and reward models' `model` over REST (SQLite and PostgreSQL).

Tenant B tries every form that would reach tenant A's checkpoint or the service's own data; each is a 422
naming the field, and another tenant's `checkpoint:<id>` reads exactly like an unknown id. The pure policy
(jobs.model_sources) is tested at the end.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.checkpoints.models import Checkpoint
from service.jobs import model_sources
from service.jobs.model_sources import ModelSourceKind, ModelSourcePolicy, ModelSourceRefused
from service.kit.config import Settings, get_settings
from service.storage import checkpoint_prefix, get_storage
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import (
    RecordingQueue,
    job_spec,
    make_dataset,
    put_checkpoint,
    recording_queue,
    start_job,
)

__all__ = ["recording_queue"]

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"weights of tenant a"}


@pytest.fixture
def checkpoint_of_a(client: TestClient, tenant_a: TenantHeaders) -> Checkpoint:
    response = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=tenant_a)
    job_id = response.json()["id"]
    checkpoint, _ = put_checkpoint(get_storage(), job_id, start_job(job_id), 2, FILES)
    return checkpoint


def checkpoint_dir(settings: Settings, checkpoint: Checkpoint) -> Path:
    return Path(settings.storage_url) / checkpoint_prefix(checkpoint.job_id, checkpoint.id)


def model_reward(model: str) -> list[dict[str, Any]]:
    return [{"type": "model", "model": model}]


def submit(client: TestClient, tenant: TenantHeaders, field: str, value: str) -> Any:
    """POST a job whose `field` (base_model, or rewards[0].model) is `value`."""
    overrides: dict[str, Any] = (
        {"base_model": value} if field == "base_model" else {"rewards": model_reward(value)}
    )
    return client.post("/v1/jobs", json=job_spec(make_dataset(tenant.tenant_id), **overrides), headers=tenant)


def refused(response: Any, field: str) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "validation_error"
    assert [d["field"] for d in error["details"]] == [field]
    assert error["message"].startswith(f"{field}: ")
    return error


FIELDS = ["base_model", "rewards[0].model"]


class TestCrossTenantForms:
    @pytest.mark.parametrize("field", FIELDS)
    def test_path_to_another_tenants_checkpoint_in_storage(
        self,
        client: TestClient,
        settings: Settings,
        tenant_b: TenantHeaders,
        checkpoint_of_a: Checkpoint,
        recording_queue: RecordingQueue,
        field: str,
    ) -> None:
        target = checkpoint_dir(settings, checkpoint_of_a)
        assert (target / "model.safetensors").read_bytes() == FILES["model.safetensors"]
        error = refused(submit(client, tenant_b, field, str(target)), field)
        assert error["details"][0]["type"] == "model_source_refused"
        assert str(target) not in error["message"]
        assert recording_queue.sent == []

    @pytest.mark.parametrize("field", FIELDS)
    def test_the_services_data_dir_and_storage_root(
        self, client: TestClient, settings: Settings, tenant_b: TenantHeaders, field: str
    ) -> None:
        for path in (settings.data_dir, f"{settings.data_dir}/models/tiny", settings.storage_url):
            refused(submit(client, tenant_b, field, path), field)

    @pytest.mark.parametrize("field", FIELDS)
    def test_dot_dot_and_symlinks_are_resolved_first(
        self,
        client: TestClient,
        settings: Settings,
        tenant_b: TenantHeaders,
        checkpoint_of_a: Checkpoint,
        tmp_path: Path,
        field: str,
    ) -> None:
        target = checkpoint_dir(settings, checkpoint_of_a)
        dotted = tmp_path / "elsewhere" / ".." / os.path.relpath(target, tmp_path)
        link = tmp_path / "innocent-looking-model"
        link.symlink_to(target, target_is_directory=True)
        relative = os.path.relpath(target)  # relative to the API's working directory
        for value in (str(dotted), str(link), relative, f"./{relative}"):
            refused(submit(client, tenant_b, field, value), field)

    @pytest.mark.parametrize("field", FIELDS)
    def test_another_tenants_checkpoint_id_reads_like_an_unknown_id(
        self,
        client: TestClient,
        tenant_a: TenantHeaders,
        tenant_b: TenantHeaders,
        checkpoint_of_a: Checkpoint,
        field: str,
    ) -> None:
        other = submit(client, tenant_b, field, f"checkpoint:{checkpoint_of_a.id}")
        unknown_id = "ckpt_" + "0" * len(checkpoint_of_a.id.removeprefix("ckpt_"))
        unknown = submit(client, tenant_b, field, f"checkpoint:{unknown_id}")
        refused(other, field)
        assert other.text == unknown.text.replace(unknown_id, checkpoint_of_a.id)
        # The owner may train from it.
        assert submit(client, tenant_a, field, f"checkpoint:{checkpoint_of_a.id}").status_code == 201

    def test_every_bad_source_is_named(
        self, client: TestClient, tenant_b: TenantHeaders, settings: Settings
    ) -> None:
        spec = job_spec(
            make_dataset(tenant_b.tenant_id),
            base_model=settings.storage_url,
            rewards=[
                {"type": "model", "model": "checkpoint:ckpt_x"},
                {"type": "model", "model": settings.data_dir},
            ],
        )
        response = client.post("/v1/jobs", json=spec, headers=tenant_b)
        assert response.status_code == 422
        fields = [d["field"] for d in response.json()["error"]["details"]]
        assert fields == ["base_model", "rewards[0].model", "rewards[1].model"]


class TestOperatorSettings:
    def test_production_refuses_local_paths_without_roots(
        self,
        client: TestClient,
        tenant_b: TenantHeaders,
        tmp_path: Path,
        production: Callable[..., None],
    ) -> None:
        production()
        model_dir = tmp_path / "models" / "mine"
        model_dir.mkdir(parents=True)
        error = refused(submit(client, tenant_b, "base_model", str(model_dir)), "base_model")
        assert "not accepted" in error["message"]

    def test_configured_roots_admit_paths_below_them_only(
        self,
        client: TestClient,
        tenant_b: TenantHeaders,
        tmp_path: Path,
        production: Callable[..., None],
        recording_queue: RecordingQueue,
    ) -> None:
        root = tmp_path / "models"
        (root / "mine").mkdir(parents=True)
        production(GRPO_MODEL_LOCAL_ROOTS=f'["{root}"]')
        assert submit(client, tenant_b, "base_model", str(root / "mine")).status_code == 201
        refused(submit(client, tenant_b, "base_model", str(root / ".." / "other")), "base_model")
        refused(submit(client, tenant_b, "rewards[0].model", str(tmp_path)), "rewards[0].model")

    def test_a_root_that_contains_the_data_dir_still_refuses_it(
        self,
        client: TestClient,
        settings: Settings,
        tenant_b: TenantHeaders,
        tmp_path: Path,
        production: Callable[..., None],
    ) -> None:
        production(GRPO_MODEL_LOCAL_ROOTS=f'["{tmp_path}"]')
        refused(submit(client, tenant_b, "base_model", settings.storage_url), "base_model")
        refused(submit(client, tenant_b, "base_model", settings.data_dir), "base_model")

    def test_hub_ids_obey_the_allowlist(
        self,
        client: TestClient,
        tenant_b: TenantHeaders,
        production: Callable[..., None],
        recording_queue: RecordingQueue,
    ) -> None:
        production()  # no allowlist configured: no hub downloads
        error = refused(submit(client, tenant_b, "base_model", "Qwen/Qwen2.5-0.5B"), "base_model")
        assert "allowlist" in error["message"]
        production(GRPO_HUB_MODEL_ALLOWLIST='["qwen/*"]')
        assert submit(client, tenant_b, "base_model", "Qwen/Qwen2.5-0.5B").status_code == 201
        refused(submit(client, tenant_b, "rewards[0].model", "evil/model"), "rewards[0].model")


@pytest.fixture
def production(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Switch the running app to production mode (plus extra GRPO_* settings); settings are read per request."""

    def switch(**env: str) -> None:
        monkeypatch.setenv("GRPO_ENV", "production")
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        get_settings.cache_clear()

    return switch


# --- the pure policy ----------------------------------------------------------------------------


def policy(
    tmp_path: Path, *, roots: tuple[Path, ...] | None = None, hub: tuple[str, ...] = ("*",)
) -> ModelSourcePolicy:
    return ModelSourcePolicy(roots, (tmp_path / "data", tmp_path / "storage"), hub)


class TestClassify:
    @pytest.mark.parametrize(
        "value", ["gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.2-1B", "org_x/a.b-c"]
    )
    def test_hub_ids(self, value: str, tmp_path: Path) -> None:
        assert model_sources.classify(value, policy(tmp_path)).kind is ModelSourceKind.hub

    @pytest.mark.parametrize(
        "value", ["/abs/model", "./rel", "a/b/c", "a/../b", "org/-x", "org--x/y", "~/models/x", "a/b/"]
    )
    def test_anything_else_is_a_local_path(self, value: str, tmp_path: Path) -> None:
        source = model_sources.classify(value, policy(tmp_path))
        assert source.kind is ModelSourceKind.local and Path(source.value).is_absolute()

    def test_builtin_and_checkpoint(self, tmp_path: Path) -> None:
        assert model_sources.classify("builtin:tiny", policy(tmp_path)).kind is ModelSourceKind.builtin
        assert model_sources.classify("checkpoint:ckpt_1", policy(tmp_path)).value == "ckpt_1"
        with pytest.raises(ModelSourceRefused):
            model_sources.classify("checkpoint:", policy(tmp_path))

    def test_allowlist_globs_are_case_insensitive(self) -> None:
        assert model_sources.hub_id_allowed("Qwen/Qwen2.5-0.5B", ("qwen/*",))
        assert not model_sources.hub_id_allowed("qwen-evil/x", ("qwen/*",))
        assert model_sources.hub_id_allowed("meta-llama/Llama-3.2-1B", ("meta-llama/Llama-3.2-1B",))
        assert not model_sources.hub_id_allowed("meta-llama/Llama-3.2-1B-x", ("meta-llama/Llama-3.2-1B",))
        assert not model_sources.hub_id_allowed("gpt2", ())

    def test_local_paths_resolve_symlinks_and_dot_dot(self, tmp_path: Path) -> None:
        (tmp_path / "data" / "x").mkdir(parents=True)
        (tmp_path / "models").mkdir()
        (tmp_path / "models" / "link").symlink_to(tmp_path / "data" / "x")
        strict = policy(tmp_path, roots=(tmp_path / "models",))
        for value in (f"{tmp_path}/models/link", f"{tmp_path}/models/../data/x", f"{tmp_path}/data"):
            with pytest.raises(ModelSourceRefused):
                model_sources.classify(value, strict)
        (tmp_path / "models" / "real").mkdir()
        assert model_sources.classify(f"{tmp_path}/models/./real", strict).value == str(
            tmp_path / "models" / "real"
        )

    def test_local_storage_root(self) -> None:
        assert model_sources.local_storage_root("/srv/storage") == "/srv/storage"
        assert model_sources.local_storage_root("file:///srv/storage") == "/srv/storage"
        assert model_sources.local_storage_root("s3://bucket/prefix") is None

    def test_nul_byte_is_refused_not_a_crash(self, tmp_path: Path) -> None:
        with pytest.raises(ModelSourceRefused):
            model_sources.classify("/models/a\x00b", policy(tmp_path))


def test_settings_defaults_by_mode(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    development = ModelSourcePolicy.from_settings(settings)
    assert development.local_roots is None and development.hub_allowlist == ("*",)
    assert Path(os.path.realpath(settings.storage_url)) in development.forbidden
    monkeypatch.setenv("GRPO_ENV", "production")
    production = ModelSourcePolicy.from_settings(Settings())
    assert production.local_roots == () and production.hub_allowlist == ()
