"""The committed generated code is exactly what `make proto` produces from proto/grpo/v1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "contract" / "gen"


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    subprocess.run(
        [sys.executable, str(REPO / "proto" / "generate.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    fresh, committed = _tree(out), _tree(COMMITTED)
    assert sorted(fresh) == sorted(committed), "generated file set drifted: run `make proto` and commit"
    drifted = [name for name in fresh if fresh[name] != committed[name]]
    assert not drifted, f"generated code drifted from the .proto files: {drifted}; run `make proto` and commit"


def test_generated_imports_are_absolute() -> None:
    # protoc's default `from grpo.v1 import ...` would only work with the proto root on sys.path.
    for path in COMMITTED.rglob("*_pb2*.py*"):
        if path.suffix not in (".py", ".pyi"):
            continue  # compiled bytecode in __pycache__
        text = path.read_text()
        assert "from grpo.v1 import" not in text, path
        assert "import grpo.v1" not in text, path
