"""A zygote: an interpreter that has imported what a command imports, and forks each process that runs it, instead
of every one starting an interpreter and importing all of it again (seconds of CPU for torch and transformers,
dozens of processes a run). tests/forked_processes.py drives it: the end-to-end stacks' `grpo worker` and `grpo
serve` processes, and the engine tests' `python -c` runs (tests/engine/preloaded.py).

A forked process is the real command: its own session and process group where asked, its own environment, working
directory and output files, the same `python -c CODE ARGS...` with the same arguments, run as __main__, and the
command's own set-up (a Celery app, an app, settings) runs in it after the fork. Only modules are loaded beforehand,
and none may read settings while imported: the zygote never sees a stack's GRPO_* environment. Everything else in
the environment must be the zygote's (library import-time state such as HF_HUB_OFFLINE or OMP_NUM_THREADS): the
caller gives the zygote the environment its processes would have had.

Protocol, one JSON object per line. In: {"args": [python, "-c", CODE, ...], "env": {...}, "cwd": ..., "stdout": ...,
"stderr": ..., "session": bool}; out: {"ready": pid} once, {"pid": N} for each request, in order, and {"exit": N,
"code": C} when a child ends (C as subprocess's returncode: -signal for a signal). The zygote stays
single-threaded (it forks) and exits when its input closes.

    python -m tests.zygote MODULE...
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
from typing import Any

REAP_INTERVAL_S = 0.1


def main() -> None:
    # What cli.main() sets before any command imports torch: OpenMP reads it when torch loads it, here.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for module in sys.argv[1:]:
        __import__(module)
    config = sys.modules.get("service.kit.config")
    if config is not None and config.get_settings.cache_info().currsize:
        raise SystemExit("the zygote's imports read settings: a forked process would keep the zygote's")
    _send({"ready": os.getpid()})
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], REAP_INTERVAL_S)
        _reap()
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line:
            return  # the test process is gone: what runs in its own session runs on until stopped
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run(request)  # raises SystemExit: the child leaves through the interpreter's own exit
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


def _run(request: dict[str, Any]) -> None:
    """In the forked child: what subprocess.Popen(args, env=, cwd=, stdout=, stderr=, start_new_session=) sets
    up, then the command's `-c` code as __main__."""
    if request["session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
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
