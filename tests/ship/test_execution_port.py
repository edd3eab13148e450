"""The worker reaches the service through its execution port only: the import-linter contract that pins it must
name every other part of the service, including folders added later."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = "The worker imports only the execution port of the service (service.execution)"


def _service_parts() -> set[str]:
    service = ROOT / "service"
    folders = {p.name for p in service.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in service.glob("*.py") if p.stem != "__init__"}
    return {f"service.{name}" for name in folders | modules}


def test_the_port_contract_forbids_every_other_part_of_the_service() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}
    contract = contracts[CONTRACT]
    assert contract["type"] == "forbidden"
    assert contract["source_modules"] == ["worker"]
    assert set(contract["forbidden_modules"]) == _service_parts() - {"service.execution"}
