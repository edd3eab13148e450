"""Style of proto/grpo/v1: buf lint rules (our checker always; the real `buf lint` when buf is available)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.grpc.proto_style import check_tree, upper_snake

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "proto"

GOOD = """syntax = "proto3";
// Fine.
package grpo.v1;
// A service.
service ThingService {
  // Get one.
  rpc GetThing(GetThingRequest) returns (GetThingResponse);
}
// Kinds.
enum ThingKind {
  // Unset.
  THING_KIND_UNSPECIFIED = 0;
  // Big.
  THING_KIND_BIG = 1;
}
// Request.
message GetThingRequest {
  // Id.
  string thing_id = 1;
}
// Response.
message GetThingResponse {
  // Kind.
  ThingKind kind = 1;
}
"""

# Each mutation of GOOD must be reported under the named rule.
BAD = {
    "ENUM_ZERO_VALUE_SUFFIX": ("THING_KIND_UNSPECIFIED = 0", "THING_KIND_NONE = 0"),
    "ENUM_VALUE_PREFIX": ("THING_KIND_BIG = 1", "BIG = 1"),
    "RPC_REQUEST_STANDARD_NAME": ("rpc GetThing(GetThingRequest)", "rpc GetThing(GetThingResponse)"),
    "RPC_RESPONSE_STANDARD_NAME": ("returns (GetThingResponse)", "returns (GetThingRequest)"),
    "SERVICE_SUFFIX": ("service ThingService", "service Things"),
    "COMMENT_FIELD": ("  // Id.\n", ""),
    "COMMENT_ENUM_VALUE": ("  // Big.\n", ""),
    "FIELD_LOWER_SNAKE_CASE": ("thing_id", "thingId"),
}


def _write(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return root


def _buf() -> str | None:
    """A buf binary: $GRPO_BUF, `buf` on PATH, or proto/node_modules (npm @bufbuild/buf, pinned in proto/package.json)."""
    local = PROTO_ROOT / "node_modules" / ".bin" / "buf"
    if not local.exists() and shutil.which("npm"):
        # `npm ci`: installs exactly the lock file and never rewrites it (a test run must leave the checkout
        # clean). It needs every platform's optional buf binary in the lock (test_lock_file_is_complete).
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=PROTO_ROOT, capture_output=True, timeout=300)
    for candidate in (os.environ.get("GRPO_BUF"), shutil.which("buf"), str(local)):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def test_lock_file_is_complete() -> None:
    """`npm ci` refuses a lock file that lacks an optional dependency of a locked package (npm install would
    add it, modifying the tracked file): every platform's buf binary must be listed."""
    packages = json.loads((PROTO_ROOT / "package-lock.json").read_text())["packages"]
    optional = packages["node_modules/@bufbuild/buf"]["optionalDependencies"]
    assert len(optional) >= 5
    assert [name for name in optional if f"node_modules/{name}" not in packages] == []


class TestOurChecker:
    def test_repo_protos_are_clean(self) -> None:
        assert check_tree(PROTO_ROOT) == []

    def test_good_example_is_clean(self, tmp_path: Path) -> None:
        assert check_tree(_write(tmp_path, "grpo/v1/thing.proto", GOOD)) == []

    @pytest.mark.parametrize("rule", sorted(BAD))
    def test_each_rule_fires(self, tmp_path: Path, rule: str) -> None:
        old, new = BAD[rule]
        assert old in GOOD
        problems = check_tree(_write(tmp_path, "grpo/v1/thing.proto", GOOD.replace(old, new)))
        assert any(f": {rule}: " in p for p in problems), problems

    def test_package_must_match_directory(self, tmp_path: Path) -> None:
        problems = check_tree(_write(tmp_path, "grpo/v2/thing.proto", GOOD))
        assert any("PACKAGE_DIRECTORY_MATCH" in p for p in problems), problems

    def test_file_name_must_be_lower_snake(self, tmp_path: Path) -> None:
        problems = check_tree(_write(tmp_path, "grpo/v1/Thing.proto", GOOD))
        assert any("FILE_LOWER_SNAKE_CASE" in p for p in problems), problems

    def test_upper_snake(self) -> None:
        assert upper_snake("JobState") == "JOB_STATE"
        assert upper_snake("HTTPCode") == "HTTP_CODE"


class TestBufLint:
    """The real `buf lint` (STANDARD + COMMENTS, proto/buf.yaml)."""

    @pytest.fixture(scope="class")
    def buf(self) -> str:
        found = _buf()
        if found is None:
            pytest.skip("no buf binary and no npm to install @bufbuild/buf; TestOurChecker enforces the same rules")
        return found

    def test_repo_protos_pass_buf_lint(self, buf: str) -> None:
        result = subprocess.run([buf, "lint"], cwd=PROTO_ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr

    def test_buf_lint_catches_a_bad_zero_value(self, buf: str, tmp_path: Path) -> None:
        root = _write(tmp_path, "grpo/v1/thing.proto", GOOD.replace("THING_KIND_UNSPECIFIED = 0", "THING_KIND_NONE = 0"))
        shutil.copy(PROTO_ROOT / "buf.yaml", root / "buf.yaml")
        result = subprocess.run([buf, "lint"], cwd=root, capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and "UNSPECIFIED" in result.stdout + result.stderr
