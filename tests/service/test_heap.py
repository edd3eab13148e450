"""The API processes freeze their start-up objects out of the cyclic collector's reach while they serve
(service.kit.heap), and hand them back when they stop."""

from __future__ import annotations

import gc

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.grpc.server import running_grpc
from service.kit.config import Settings, get_settings
from service.kit.heap import startup_objects_frozen


def test_on_by_default() -> None:
    assert Settings.model_fields["gc_freeze"].default is True


def test_frozen_while_inside_and_collectable_again_after() -> None:
    before = gc.get_freeze_count()
    with startup_objects_frozen():
        assert gc.get_freeze_count() > before + 10_000  # the test process's modules at least
    assert gc.get_freeze_count() == 0


def test_disabled_leaves_the_collector_alone() -> None:
    with startup_objects_frozen(enabled=False):
        assert gc.get_freeze_count() == 0


@pytest.fixture
def freeze_on(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    monkeypatch.setenv("GRPO_GC_FREEZE", "true")
    get_settings.cache_clear()


def test_the_app_serves_with_its_start_up_objects_frozen(freeze_on: None, app: FastAPI) -> None:
    with TestClient(app) as client:
        assert gc.get_freeze_count() > 10_000
        assert client.get("/healthz").status_code == 200
    assert gc.get_freeze_count() == 0


async def test_the_grpc_server_too(freeze_on: None) -> None:
    async with running_grpc(0):
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0


def test_not_when_turned_off(settings: Settings, app: FastAPI) -> None:
    assert settings.gc_freeze is False  # tests/conftest.py turns it off for the rest of the suite
    with TestClient(app):
        assert gc.get_freeze_count() == 0
