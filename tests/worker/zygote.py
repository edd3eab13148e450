"""Zygotes for the end-to-end tests' `grpo worker` and `grpo serve` processes: an interpreter per kind and test
process that has imported what that command imports, and forks each such process from there, instead of every
one starting an interpreter and importing all of it again (seconds of CPU each, dozens a run).

- `worker`: what a worker with the engine preloaded imports (torch, transformers, peft, Celery and the engine).
- `api`: what `grpo serve` imports (FastAPI, the app's modules, gRPC, uvicorn, Alembic); never torch.

A forked process is the real command: its own session and process group, its own environment, working directory
and log file, the same `from cli import main; main()` code with the same arguments, and the command's own
set-up (its Celery app, its app and settings) runs in it after the fork. Only modules are loaded beforehand, and
nothing imported here reads settings: the zygote never sees a stack's GRPO_* environment. Everything else in the
environment must equal the zygote's (library import-time state such as HF_HUB_OFFLINE or OMP_NUM_THREADS): a
request that differs gets a fresh process instead (tests/worker/forked_processes.py decides).

Protocol, one JSON object per line. In: {"args": [...], "env": {...}, "cwd": ..., "log": ...}; out: {"pid": N}
for each request, in order, and {"exit": N, "code": C} when a child ends (C as subprocess's returncode: -signal
for a signal). The zygote stays single-threaded (it forks) and exits when its input closes.

    python -m tests.worker.zygote worker|api
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
from typing import Any

PRELOAD = {
    # What `grpo worker` with GRPO_WORKER_PRELOAD_ENGINE imports before its pool forks, less the modules that read
    # settings when imported (worker.celery_app builds its Celery app from them; worker.tasks imports it).
    "worker": [
        "cli", "cli.worker", "celery.apps.worker", "celery.worker", "kombu.transport.redis", "service.kit.config",
        "service.observability.logs", "service.execution", "worker.grpo.trainer",
    ],
    # What `grpo serve` imports before it serves (cli/serve.py), less the app itself, which it builds.
    "api": [
        "cli", "cli.serve", "cli.migrate", "alembic.command", "uvicorn", "service.app", "service.grpc.server",
        "service.execution.reaper", "service.kit.queue", "service.observability.logs",
    ],
}
REAP_INTERVAL_S = 0.1


def main() -> None:
    kind = sys.argv[1]
    # What cli.main() sets before any command imports torch: OpenMP reads it when torch loads it, here.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for module in PRELOAD[kind]:
        __import__(module)
    from service.kit.config import get_settings  # loaded by PRELOAD; checked, not imported anew

    if get_settings.cache_info().currsize:
        raise SystemExit("the zygote's imports read settings: a forked process would keep the zygote's")
    if kind == "api" and "torch" in sys.modules:
        raise SystemExit("the API zygote imported torch, which `grpo serve` never does")
    _send({"ready": os.getpid()})
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], REAP_INTERVAL_S)
        _reap()
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line:
            return  # the test process is gone: its workers run on in their own sessions until stopped
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _become_worker(request)  # raises SystemExit: the child leaves through the interpreter's own exit
        _send({"pid": pid})


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()  # before any fork: a child must not inherit a buffer and write it again


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become_worker(request: dict[str, Any]) -> None:
    """In the forked child: what subprocess.Popen(args, env=, cwd=, stdout=log, stderr=STDOUT,
    start_new_session=True) sets up, then the command's `-c` code as __main__."""
    os.setsid()
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _executable, flag, code, *argv = request["args"]
    if flag != "-c":
        raise SystemExit(f"the zygote runs `python -c CODE ARGS...`, not {request['args'][:3]}")
    sys.argv = ["-c", *argv]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    raise SystemExit(0)


if __name__ == "__main__":
    main()
