"""What runs inside a grading process (`service.openai.grading`): stdlib only, so that the fork server imports
it once and a child unpickles its target without importing anything (an import there would hold the parent's
write of the arguments, and so its event loop, for as long as it takes)."""

from __future__ import annotations

import contextlib
import os
import resource
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def nothing() -> None:
    """A child that does nothing: starting one waits until the fork server is ready."""


def run(conn: Connection, memory_bytes: int, cpu_seconds: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Yield the CPU to the API's own work (nice 10), cap this process's address space and CPU time, call
    `fn(*args)` and send ("ok", value), ("error", exception), ("memory", None) or ("failed", text)."""
    with contextlib.suppress(OSError):
        os.nice(10)
    with contextlib.suppress(ValueError, OSError):  # a hard limit below ours: keep the one in force
        resource.setrlimit(resource.RLIMIT_AS, (_address_space() + memory_bytes,) * 2)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    try:
        outcome: tuple[str, Any] = ("ok", fn(*args))
    except MemoryError:
        outcome = ("memory", None)
    except Exception as exc:  # sent to the parent, which decides
        outcome = ("error", exc)
    try:
        conn.send(outcome)
    except Exception:  # an exception that does not pickle
        conn.send(("failed", "".join(traceback.format_exception_only(outcome[1])).strip()))
    conn.close()


def _address_space() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0
