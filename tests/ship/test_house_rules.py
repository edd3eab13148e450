"""The house rules of the code (issue 32): no file over 600 lines, no function over 80 lines, and no import
inside a function without a comment saying why (a lazy import hides a dependency, so its reason is written
down: torch only in the job's process, an optional dependency, an import cycle).

Pure `ast` and `tokenize` over the source, so the check costs no import of the project. Generated code
(`*_pb2*.py`) and migrations are outside the rules.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("service", "worker", "contract", "outbound", "cli", "client")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
# Tool pragmas are not reasons: a noqa or type: ignore (with its codes), a pragma: or fmt: comment. Words
# after a noqa's codes are one.
PRAGMA = re.compile(
    r"^\s*(noqa(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?"
    r"|type:\s*ignore(\[[^\]]*\])?"
    r"|(pragma|fmt):.*)\s*$"
)

Function = ast.FunctionDef | ast.AsyncFunctionDef
Import = ast.Import | ast.ImportFrom


def ruled_files(root: Path, folders: Iterable[str] = FOLDERS) -> Iterator[Path]:
    """The Python files under `root`'s `folders` the rules apply to: no generated code, no migrations."""
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root)
            if "_pb2" in path.name or "migrations" in relative.parts:
                continue
            yield path


def _reason_lines(source: str) -> tuple[set[int], set[int]]:
    """The lines holding a comment that says something (not just a tool pragma), and of those the lines
    that hold nothing but the comment."""
    commented: set[int] = set()
    comment_only: set[int] = set()
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        parts = [PRAGMA.sub("", part) for part in token.string.split("#")]
        if not any(part.strip() for part in parts):
            continue
        row, column = token.start
        commented.add(row)
        if not lines[row - 1][:column].strip():
            comment_only.add(row)
    return commented, comment_only


def _function_imports(tree: ast.Module) -> Iterator[list[Import]]:
    """The imports inside function bodies, as groups of consecutive import statements of one block."""
    for function in ast.walk(tree):
        if not isinstance(function, Function):
            continue
        # Every block of the function's own body (if/try/with/loops), not those of nested functions or
        # classes: ast.walk reaches a nested function on its own.
        blocks: list[list[ast.stmt]] = [function.body]
        while blocks:
            block = blocks.pop()
            group: list[Import] = []
            for statement in block:
                if isinstance(statement, Import):
                    group.append(statement)
                    continue
                if group:
                    yield group
                    group = []
                if isinstance(statement, Function | ast.ClassDef):
                    continue
                for field in ("body", "orelse", "finalbody"):
                    inner = getattr(statement, field, None)
                    if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                        blocks.append(inner)
                for handler in getattr(statement, "handlers", []):
                    blocks.append(handler.body)
                for case in getattr(statement, "cases", []):
                    blocks.append(case.body)
            if group:
                yield group


def file_offences(path: Path, root: Path) -> list[str]:
    """What in one file breaks the house rules, one line each, as `path:line: what`."""
    source = path.read_text(encoding="utf-8")
    name = path.relative_to(root).as_posix()
    offences: list[tuple[int, str]] = []
    line_count = len(source.splitlines())
    if line_count > MAX_FILE_LINES:
        offences.append((0, f"{name}: {line_count} lines (at most {MAX_FILE_LINES})"))
    tree = ast.parse(source, filename=name)
    for node in ast.walk(tree):
        if isinstance(node, Function) and node.end_lineno is not None:
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                limit = f"at most {MAX_FUNCTION_LINES}"
                offences.append(
                    (node.lineno, f"{name}:{node.lineno}: function {node.name} is {length} lines ({limit})")
                )
    commented, comment_only = _reason_lines(source)
    for group in _function_imports(tree):
        group_has_reason = group[0].lineno - 1 in comment_only
        for statement in group:
            own_lines = range(statement.lineno, (statement.end_lineno or statement.lineno) + 1)
            if group_has_reason or any(line in commented for line in own_lines):
                continue
            why = "import inside a function without a comment saying why"
            offences.append((statement.lineno, f"{name}:{statement.lineno}: {why}"))
    return [message for _, message in sorted(offences)]


def house_offences(root: Path, folders: Iterable[str] = FOLDERS) -> list[str]:
    """Every offence against the house rules in `root`'s `folders`."""
    return [offence for path in ruled_files(root, folders) for offence in file_offences(path, root)]


def test_the_code_keeps_the_house_rules() -> None:
    offences = house_offences(REPO)
    assert not offences, "House rules broken:\n" + "\n".join(offences)


# The checker itself, on synthetic trees: each rule fails just past its limit and passes at it.


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _function(name: str, lines: int) -> str:
    """A function `lines` lines long, its def line included."""
    return f"def {name}() -> None:\n" + "    pass\n" * (lines - 1)


def test_a_file_over_600_lines_fails(tmp_path: Path) -> None:
    _write(tmp_path, "service/at_limit.py", "x = 1\n" * 600)
    _write(tmp_path, "worker/over.py", "x = 1\n" * 601)
    assert house_offences(tmp_path) == ["worker/over.py: 601 lines (at most 600)"]


def test_a_function_over_80_lines_fails_methods_and_nested_ones_included(tmp_path: Path) -> None:
    method = "class Job:\n" + "".join(f"    {line}\n" for line in _function("run", 81).splitlines())
    nested = "def outer() -> None:\n" + "".join(
        f"    {line}\n" for line in _function("inner", 81).splitlines()
    )
    _write(tmp_path, "outbound/fine.py", _function("short", 80))
    _write(tmp_path, "outbound/long.py", _function("long", 81))
    _write(tmp_path, "contract/method.py", method)
    _write(tmp_path, "client/nested.py", nested)
    assert house_offences(tmp_path) == [
        "contract/method.py:2: function run is 81 lines (at most 80)",
        "outbound/long.py:1: function long is 81 lines (at most 80)",
        "client/nested.py:1: function outer is 82 lines (at most 80)",
        "client/nested.py:2: function inner is 81 lines (at most 80)",
    ]


def test_an_import_inside_a_function_needs_a_comment_saying_why(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "worker/lazy.py",
        """import os


def own_line() -> None:
    import torch  # only in the job's process: the Celery parent never initialises CUDA


def above_covers_the_group() -> None:
    # Optional dependency: only jobs with use_vllm need it.
    import vllm
    from vllm import LLM


def bare() -> None:
    x = 1
    import json


def in_a_block(flag: bool) -> None:
    if flag:
        import json  # noqa: PLC0415
        import csv  # noqa: F401  (csv's dialects register themselves)


def parted_from_its_comment() -> None:
    # A comment that is not directly above.

    import json


def a_statement_ends_the_group() -> None:
    # Breaks the cycle jobs -> worker.
    import json
    x = 1
    import csv


class Holder:
    def method(self) -> None:
        from pathlib import Path
""",
    )
    assert house_offences(tmp_path) == [
        "worker/lazy.py:16: import inside a function without a comment saying why",
        "worker/lazy.py:21: import inside a function without a comment saying why",
        "worker/lazy.py:28: import inside a function without a comment saying why",
        "worker/lazy.py:35: import inside a function without a comment saying why",
        "worker/lazy.py:40: import inside a function without a comment saying why",
    ]


def test_generated_code_migrations_and_other_folders_are_outside_the_rules(tmp_path: Path) -> None:
    _write(tmp_path, "contract/gen/jobs_pb2.py", "x = 1\n" * 700)
    _write(tmp_path, "contract/gen/jobs_pb2_grpc.py", _function("f", 100))
    _write(tmp_path, "service/migrations/versions/0001.py", _function("upgrade", 100))
    _write(tmp_path, "bench/long.py", "x = 1\n" * 700)
    assert house_offences(tmp_path) == []


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_ruled_folder_is_walked(tmp_path: Path, folder: str) -> None:
    _write(tmp_path, f"{folder}/deep/er/module.py", "x = 1\n" * 601)
    assert house_offences(tmp_path) == [f"{folder}/deep/er/module.py: 601 lines (at most 600)"]
