"""tests/zygote.py: a process forked from a zygote is set up as subprocess.Popen would start it (its own
session, environment, working directory, standard streams and arguments), its exit status and signals reach the
test as a Popen's do, and an environment the zygote's imports could have read differently gets a fresh process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked_processes import Zygote, fork_process, library_environment, process_zygote

REPO = Path(__file__).resolve().parents[2]
REPORT = (
    "import json, os, sys; print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'sid': os.getsid(0), "
    "'pid': os.getpid(), 'setting': os.environ.get('GRPO_PROBE'), 'stdin': sys.stdin.read(), "
    "'fds': sorted(int(fd) for fd in os.listdir('/proc/self/fd')), 'torch': 'torch' in sys.modules})); "
    "sys.stderr.write('to the log too\\n'); sys.exit(int(sys.argv[1]))"
)


@pytest.fixture
def zygote() -> Zygote:
    return process_zygote("worker", dict(os.environ), REPO)


def test_a_forked_process_starts_as_popen_would_start_it(zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    env = {**zygote.environment, "GRPO_PROBE": "mine"}
    child = zygote.fork([sys.executable, "-c", REPORT, "3", "--flag"], env, tmp_path, log)
    assert child.wait(timeout=30) == 3 and child.poll() == 3
    report_line, stderr_line = log.read_text().splitlines()
    report = json.loads(report_line)
    assert report["argv"] == ["-c", "3", "--flag"]
    assert report["cwd"] == str(tmp_path) and report["setting"] == "mine"
    assert report["sid"] == report["pid"] == child.pid  # a session and process group of its own
    assert report["stdin"] == ""  # /dev/null, not the zygote's requests
    assert report["fds"][:3] == [0, 1, 2] and len(report["fds"]) <= 4  # 0-2 and the listing's own descriptor
    assert report["torch"]  # what the zygote imported is there already
    assert stderr_line == "to the log too"


def test_a_signal_ends_it_with_the_code_popen_gives(zygote: Zygote, tmp_path: Path) -> None:
    child = zygote.fork([sys.executable, "-c", "import time; time.sleep(60)"], zygote.environment, tmp_path,
                        tmp_path / "sleep.log")
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.3)
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_an_environment_the_imports_could_read_differently_gets_a_fresh_process(zygote: Zygote, tmp_path: Path) -> None:
    env = {**zygote.environment, "GRPO_ANY_SETTING": "x", "PYTEST_CURRENT_TEST": "another"}
    assert library_environment(env) == zygote.environment
    same = fork_process("worker", [sys.executable, "-c", "pass"], env, REPO, tmp_path / "same.log")
    assert same is not None and same.wait(timeout=30) == 0
    changed = {**env, "HF_HUB_OFFLINE": "0" if env.get("HF_HUB_OFFLINE") == "1" else "1"}
    assert fork_process("worker", [sys.executable, "-c", "pass"], changed, REPO, tmp_path / "other.log") is None


def test_the_api_zygote_has_the_app_imported_and_never_torch(tmp_path: Path) -> None:
    code = "import json, sys; print(json.dumps([m in sys.modules for m in ('service.app', 'uvicorn', 'torch')]))"
    api = process_zygote("api", dict(os.environ), REPO)
    child = api.fork([sys.executable, "-c", code], api.environment, tmp_path, tmp_path / "api.log")
    assert child.wait(timeout=30) == 0
    assert json.loads((tmp_path / "api.log").read_text()) == [True, True, False]
