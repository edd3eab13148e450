"""The order tests/conftest.py hands the suite's files out in: slow files first, the folders taking turns within
each group, every file's tests together and in their own order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from tests.conftest import pytest_collection_modifyitems


@dataclass
class _Item:
    """What the hook reads of a pytest.Item: its file and whether it is marked slow."""

    path: Path
    name: str
    slow: bool = False

    def get_closest_marker(self, name: str) -> Any:
        return object() if name == "slow" and self.slow else None


def _order(items: list[_Item]) -> list[str]:
    pytest_collection_modifyitems(cast(list[pytest.Item], items))
    return [item.name for item in items]


def test_slow_files_first_with_the_folders_taking_turns() -> None:
    engine, worker, service = Path("tests/engine"), Path("tests/worker"), Path("tests/service")
    items = [
        _Item(engine / "test_a.py", "engine-a", slow=True),
        _Item(engine / "test_b.py", "engine-b", slow=True),
        _Item(engine / "test_c.py", "engine-c"),
        _Item(service / "test_d.py", "service-d"),
        _Item(service / "test_e.py", "service-e"),
        _Item(worker / "test_f.py", "worker-f", slow=True),
        _Item(worker / "test_g.py", "worker-g", slow=True),
        _Item(worker / "test_h.py", "worker-h"),
    ]
    assert _order(items) == [
        "engine-a", "worker-f", "engine-b", "worker-g",  # the slow files, the folders in turn
        "engine-c", "service-d", "worker-h", "service-e",  # then the others, the same way
    ]


def test_a_file_with_one_slow_test_moves_whole_and_keeps_its_order() -> None:
    quick, mixed = Path("tests/service/test_quick.py"), Path("tests/worker/test_mixed.py")
    items = [
        _Item(quick, "quick-1"),
        _Item(mixed, "mixed-1"),
        _Item(quick, "quick-2"),
        _Item(mixed, "mixed-2", slow=True),
        _Item(mixed, "mixed-3"),
    ]
    assert _order(items) == ["mixed-1", "mixed-2", "mixed-3", "quick-1", "quick-2"]
