"""The launcher of one node's ranks: `python -m worker.grpo.launch [OPTIONS] -m MODULE [ARGS...]`.

It replaces `torch.distributed.run` for a job's ranks (docs/distributed.md, docs/security.md). The elastic
launcher's c10d rendezvous serves its TCPStore on every interface, and its agent unpickles the rendezvous
state it reads back from that store on every monitor tick: the store has no authentication, so anyone who
reaches the port runs code in the launcher. This launcher keeps the job's processes off the network:

- node 0's launcher serves the job's store on one address only, through a socket it binds itself before
  the store takes it over (TCPStore's `master_listen_fd`): loopback for a job on one node, the worker's
  configured address (`GRPO_WORKER_ADDRESS`) for a job on several;
- every rank's keys live under the attempt's run id, random and published only through the broker the
  workers already trust (`PrefixStore`);
- gloo's and NCCL's own sockets bind to that address's interface (`GLOO_SOCKET_IFNAME`,
  `NCCL_SOCKET_IFNAME`), never to a wildcard;
- nothing read from the store or received through a collective is unpickled (worker.grpo.wire).

Nodes are numbered by the claiming worker (it is node 0 and serves the store), not by a rendezvous. The
ranks learn their place from the environment this launcher sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`LOCAL_WORLD_SIZE`, `GROUP_RANK` as torchrun names them, plus `GRPO_STORE_*`, `GRPO_RUN_ID` and
`GRPO_JOIN_TIMEOUT_S`) and meet in `worker.grpo.distributed.init_from_env`.

On a machine without CUDA the launcher imports the ranks' module once and forks them from itself, rather than
each importing torch and the engine again (worker.grpo.rank_fork says when that is safe and how a forked rank
matches a fresh one).

The launcher watches its ranks: the first one to exit with an error (or a signal) makes it stop the others,
and it exits with that rank's code; with every rank done it exits 0. SIGTERM or SIGINT stops the ranks the same way,
and the launcher then exits with 128 plus the signal's number, as a shell reports a process the signal ended.
No restarts: a failed rank ends the attempt and the job resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Protocol

import psutil

from worker.grpo.rank_fork import RankForker, forking_is_safe

POLL_S = 0.2
STOP_GRACE_S = 10.0
LOOPBACK = "127.0.0.1"
LAUNCHER = (sys.executable, "-m", "worker.grpo.launch")  # a launcher process of its own


@dataclass(frozen=True)
class World:
    """Where one node's launcher stands: the job's store, this node, the ranks it starts."""

    address: str  # this node's address: its ranks' sockets bind there (node 0's store too)
    store_host: str  # the address of node 0, where the store listens
    store_port: int  # 0 on node 0: any free port of store_host
    run_id: str
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    join_timeout_s: float = 600.0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def launch_command(
    module: str,
    args: Sequence[str],
    *,
    nproc_per_node: int,
    run_id: str,
    nnodes: int = 1,
    node_rank: int = 0,
    store: str | None = None,
    address: str = LOOPBACK,
    join_timeout_s: float | None = None,
) -> list[str]:
    """The command line of this launcher running `python -m module args` as `nproc_per_node` ranks (after
    `LAUNCHER`, `main`'s argv). `store` is `ip:port` of the job's store (node 0 serves it there; port 0 = a
    free one), `address` this node's IP address; without them, one node on loopback."""
    if store is None and nnodes > 1:
        raise ValueError("a job on several nodes needs the store's address")
    command = [
        *LAUNCHER,
        f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
        f"--store={store or f'{LOOPBACK}:0'}", f"--address={address}", f"--run-id={run_id}",
    ]
    if join_timeout_s is not None:
        command.append(f"--join-timeout={join_timeout_s}")
    return [*command, "-m", module, *args]


def run_ranks(module: str, args: Sequence[str], *, nproc_per_node: int, run_id: str) -> int:
    """Runs `python -m module args` as `nproc_per_node` ranks on loopback and waits; the launcher's exit code.

    This process is their launcher while it runs no other thread: a thread that holds a lock when the ranks are
    forked would leave that lock held in every rank. Otherwise a launcher process of its own starts them. A
    caller that has not loaded the module yet pays for it once either way, and one that has (a process forked
    from one that imported the engine) pays nothing: no interpreter stands between it and its ranks."""
    command = launch_command(module, args, nproc_per_node=nproc_per_node, run_id=run_id)
    if threading.active_count() > 1:
        return subprocess.call(command)
    return main(command[len(LAUNCHER):])


def interface_of(address: str) -> str:
    """The name of the network interface that holds `address` (gloo and NCCL bind to an interface)."""
    wanted = ipaddress.ip_address(address)
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(entry.address.split("%")[0]) == wanted:
                        return name
                except ValueError:
                    continue
    raise ValueError(f"no network interface of this machine holds {address}")


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host:port` only (port 0: a free one)."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    return sock


def rank_environment(world: World, local_rank: int, store_port: int, base: dict[str, str]) -> dict[str, str]:
    """The environment of one rank: its place in the world and where the store is."""
    interface = interface_of(world.address)
    env = {
        **base,
        "RANK": str(world.node_rank * world.nproc_per_node + local_rank),
        "WORLD_SIZE": str(world.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(world.nproc_per_node),
        "GROUP_RANK": str(world.node_rank),
        "GRPO_STORE_HOST": world.store_host,
        "GRPO_STORE_PORT": str(store_port),
        "GRPO_RUN_ID": world.run_id,
        "GRPO_JOIN_TIMEOUT_S": str(world.join_timeout_s),
        "GLOO_SOCKET_IFNAME": interface,
        "NCCL_SOCKET_IFNAME": interface,
    }
    # As torchrun does: one intra-op thread per rank unless the operator chose otherwise.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Rank(Protocol):
    """A running rank: a process of its own (subprocess.Popen) or forked from the launcher (ForkedProcess)."""

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class Launcher:
    """Starts one node's ranks and stops them all when one fails. `fork`: the ranks are forked from this process
    once it has imported the module (worker.grpo.rank_fork), instead of each starting `python -m module`."""

    def __init__(self, world: World, module: str, args: Sequence[str], *, fork: bool = False) -> None:
        self.world = world
        self.module = module
        self.args = list(args)
        self.fork = fork
        self.ranks: list[Rank] = []
        self._stopped_by = 0  # the signal that asked the launcher to stop, if any

    def run(self) -> int:
        listener = self._store_socket()
        port = self.world.store_port if listener is None else int(listener.getsockname()[1])
        store = None
        try:
            start = self._starter(listener)
            base = dict(os.environ)
            for local_rank in range(self.world.nproc_per_node):
                self.ranks.append(start(rank_environment(self.world, local_rank, port, base)))
            # After the ranks: the store's server runs threads, and a forked rank must not start with them.
            # Until it serves, a rank's connection waits in the socket's backlog.
            store = self._serve_store(listener)
            return self._watch()
        finally:
            self._stop()
            del store  # the store stops serving with its last reference
            if listener is not None:
                listener.close()  # if no store took it over

    def _starter(self, listener: socket.socket | None) -> Callable[[dict[str, str]], Rank]:
        if not self.fork:
            command = [sys.executable, "-m", self.module, *self.args]
            return lambda env: subprocess.Popen(command, env=env)
        # This process imports the module now, with its environment: the ranks' OpenMP default goes there first
        # (rank_environment gives each rank the same), as libgomp reads it only when torch loads.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        close = [] if listener is None else [listener.fileno()]
        return RankForker(self.module, self.args, close_fds=close).start

    def _store_socket(self) -> socket.socket | None:
        """Node 0's store socket, bound to its address only; the other nodes reach node 0's."""
        if self.world.node_rank != 0:
            return None
        return listening_socket(self.world.address, self.world.store_port)

    def _serve_store(self, listener: socket.socket | None) -> object | None:
        """Node 0 serves the job's store through `listener`, which the store takes over."""
        if listener is None:
            return None
        # torch here, on node 0, for the store (and in forking_is_safe): the worker that builds the launcher's
        # command (launch_command) imports none of it.
        import torch.distributed as dist

        port = int(listener.getsockname()[1])
        return dist.TCPStore(
            self.world.store_host, port, None, True, timedelta(seconds=self.world.join_timeout_s),
            wait_for_workers=False, master_listen_fd=listener.detach(),
        )

    def _watch(self) -> int:
        while True:
            codes = [rank.poll() for rank in self.ranks]
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                code = failed[0]
                return 128 - code if code < 0 else code  # killed by a signal: the shell's convention
            if all(code == 0 for code in codes):
                return 0
            if self._stopped_by:
                return 128 + self._stopped_by
            time.sleep(POLL_S)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stopped_by = signum

    def _stop(self) -> None:
        # Every rank, not only those without an exit code: a forked rank whose server died has one (255) and may
        # still run. Stopping a rank that has exited does nothing.
        for rank in self.ranks:
            rank.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for rank in self.ranks:
            try:
                rank.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rank.kill()
                rank.wait()


def parse(argv: Sequence[str]) -> tuple[World, list[str]]:
    """The world and `[module, *args]` of the ranks."""
    parser = argparse.ArgumentParser(prog="python -m worker.grpo.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--store", required=True, help="host:port of the job's store (node 0 serves it)")
    parser.add_argument("--address", default=LOOPBACK, help="this node's IP address (its sockets bind there)")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--join-timeout", type=float, default=600.0)
    parser.add_argument("-m", dest="module", required=True)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    host, _, port = options.store.rpartition(":")
    world = World(
        address=options.address, store_host=host.strip("[]"), store_port=int(port), run_id=options.run_id,
        nproc_per_node=options.nproc_per_node, nnodes=options.nnodes, node_rank=options.node_rank,
        join_timeout_s=options.join_timeout,
    )
    if not 0 <= world.node_rank < world.nnodes or world.nproc_per_node < 1:
        parser.error("--node-rank must be in [0, --nnodes) and --nproc-per-node at least 1")
    if world.node_rank == 0 and world.store_host != world.address:
        parser.error("node 0 serves the store on its own --address")
    return world, [options.module, *options.args]


def main(argv: Sequence[str]) -> int:
    world, (module, *args) = parse(argv)
    # Before forking_is_safe loads torch: libgomp reads it then, and forked ranks inherit what it read.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launcher = Launcher(world, module, args, fork=forking_is_safe())
    # The caller's own handlers come back afterwards (run_ranks makes the caller the launcher).
    previous = {signum: signal.signal(signum, launcher.on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        return launcher.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
