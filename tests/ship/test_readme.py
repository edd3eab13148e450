"""The README's commands are the ones the Makefile and CI run (no drift), and every setting is
documented in it as its GRPO_* environment variable."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from service.kit.config import Settings
from tests.ship.conftest import REPO, resolve

README = REPO / "README.md"
MAKEFILE = REPO / "Makefile"
CI_RUN = REPO / ".ci" / "run"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def section(text: str, title: str) -> str:
    match = re.search(rf"^##\s+{re.escape(title)}\s*\n(.*?)(?=^##\s|\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def code_lines(text: str) -> list[str]:
    """Command lines of fenced code blocks (a leading `$ ` prompt removed)."""
    lines = [line.strip() for block in FENCE.findall(text) for line in block.splitlines()]
    return [line.removeprefix("$ ") for line in lines if line]


def commands(text: str, program: str) -> list[list[str]]:
    """Lines of code blocks running `program` (after any VAR=value prefixes), as argv lists."""
    found = []
    for line in code_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # not shell (JSON, Python...)
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words and (words[0] == program or words[0].endswith(f"/bin/{program}")):  # grpo, .venv/bin/grpo
            found.append([program, *words[1:]])
    return found


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z][\w-]*):(?!=)", MAKEFILE.read_text(), re.MULTILINE))


class TestTwoCommands:
    def test_quick_start_has_make_demo_and_make_test(self) -> None:
        quick_start = commands(section(README.read_text(), "Quick start"), "make")
        assert ["make", "demo"] in quick_start and ["make", "test"] in quick_start, quick_start

    def test_makefile_has_both_targets(self) -> None:
        assert {"demo", "test"} <= make_targets()

    def test_make_test_runs_lint_types_and_the_suite(self) -> None:
        dry_run = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert dry_run.returncode == 0, dry_run.stderr
        for tool in ("ruff check", "mypy", "pytest"):
            assert tool in dry_run.stdout, f"`make test` does not run {tool}:\n{dry_run.stdout}"

    def test_ci_calls_make_test(self) -> None:
        lines = [line.split("#", 1)[0].strip() for line in CI_RUN.read_text().splitlines()]
        assert "make test" in lines, "`.ci/run` must call `make test`"


class TestNoDrift:
    def test_every_make_command_in_readme_is_a_target(self) -> None:
        targets = make_targets()
        for words in commands(README.read_text(), "make"):
            unknown = [w for w in words[1:] if not w.startswith("-") and "=" not in w and w not in targets]
            assert not unknown, f"README runs `{shlex.join(words)}`: no Makefile target {unknown}"

    def test_every_grpo_command_in_readme_exists(self) -> None:
        for words in commands(README.read_text(), "grpo"):
            if words[1:2] in (["--help"], []):
                continue
            _path, command, rest = resolve(words)
            known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {
                "--help"
            }
            options = {w.split("=", 1)[0] for w in rest if w.startswith("-") and w != "-"}
            assert options <= known, (
                f"README: `{shlex.join(words)}` uses unknown options {sorted(options - known)}"
            )


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_setting_is_documented(name: str) -> None:
    """The configuration table names every setting by its environment variable."""
    assert f"GRPO_{name.upper()}" in README.read_text(), f"README does not document GRPO_{name.upper()}"
