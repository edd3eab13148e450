"""Jobs on several nodes (`resources.nodes: M > 1`): how the workers of M machines run one attempt together.

One Celery message wakes one worker, which claims the job and renews its lease as for any job (worker.runner).
That worker then:

1. picks the attempt's store endpoint, `GRPO_WORKER_ADDRESS:<a free port>`, and a random run id;
2. sends M - 1 `grpo.join_job` messages (an `Invitation`: job, attempt, claim, store endpoint, run id, and the
   node number 1 .. M - 1) to the job's queue, the queue of its devices per node, so each wakes another worker
   with that many devices. The run id travels only through the broker the workers trust;
3. launches its node's ranks as node 0 (worker.grpo.launch: its launcher serves the store on that address
   only) and waits, as for one node.

A worker that receives an invitation checks that the attempt still owns the job (a late or redelivered
invitation is dropped), then launches its node's ranks at the same endpoint and waits for them, stopping
them if the job leaves the attempt's hands. It holds no lease: the claiming worker's lease covers the attempt.

Rank 0 is on the claiming node and runs the job's reporting (worker.rank_job); each node's ranks bind their
sockets to their own worker's address. Every node's launcher ends when a rank
anywhere dies or hangs (the collectives fail after `GRPO_COLLECTIVE_TIMEOUT_SECONDS`), and the claiming
worker then records `rank_failed`; a node that never arrives makes the ranks give up waiting for the world
after `GRPO_NODE_JOIN_TIMEOUT_SECONDS`. Either way the lease lapses and the job resumes from its last checkpoint,
on whichever workers take it next.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import socket
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contract.spec import Resources
from service.execution import reporting
from service.execution.lease import OWNED_STATES, Claim, with_db_retry
from service.execution.runtime import Settings, get_settings
from worker.grpo.launch import launch_command
from worker.processes import ChildProcess, stop_process
from worker.spare_launcher import SpareLauncher, start_launcher

log = logging.getLogger(__name__)

JOIN_JOB_TASK = "grpo.join_job"
CONTROL_POLL_S = 5.0  # how often a joined node checks that the attempt still owns the job
STOP_GRACE_S = 30.0


class Invitation(BaseModel):
    """What a claiming worker sends the other nodes' workers (the `grpo.join_job` message): everything their
    launchers need."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    claim: dict[str, Any]  # service.execution.lease.Claim, as JSON
    queue: str
    endpoint: str  # ip:port of the job's store, served by node 0's launcher
    run_id: str = Field(min_length=32)  # the attempt's store keys live under it; random per attempt
    node_rank: int = Field(ge=0)  # 0: the claiming worker's node
    nnodes: int = Field(ge=2)
    nproc_per_node: int = Field(ge=1)

    @property
    def job_id(self) -> str:
        return str(self.claim["job_id"])

    @property
    def attempt(self) -> int:
        return int(self.claim["attempt"])


def new_run_id() -> str:
    """An attempt's run id: random, never derived from the job (its store keys live under it)."""
    return secrets.token_hex(16)


def node_address(settings: Settings) -> str:
    """The IP address of this worker's machine for the other nodes: GRPO_WORKER_ADDRESS, resolved (default:
    the machine's fully qualified host name). The job's sockets on this node bind there and nowhere else."""
    return socket.gethostbyname(settings.worker_address or socket.getfqdn())


def store_endpoint(settings: Settings) -> str:
    """`ip:port` where the claiming worker's launcher serves the attempt's store: this worker's address and a
    port free on it now."""
    address = node_address(settings)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        port = probe.getsockname()[1]
    return f"{address}:{port}"


def invite(claim: Claim, queue: str, resources: Resources, settings: Settings) -> Invitation:
    """Send the invitations to the other `resources.nodes - 1` nodes (node numbers 1 ..); returns node 0's."""
    # The Celery app is built when its module is imported: only the process that sends invitations builds it,
    # not the ranks, which import this module through the runner.
    from worker.celery_app import app

    invitation = Invitation(
        claim=asdict(claim), queue=queue, endpoint=store_endpoint(settings), run_id=new_run_id(), node_rank=0,
        nnodes=resources.nodes, nproc_per_node=resources.devices_per_node,
    )
    for node in range(1, resources.nodes):
        app.send_task(
            JOIN_JOB_TASK, args=[invitation.model_copy(update={"node_rank": node}).model_dump()], queue=queue
        )
    log.info("job %s: attempt %d invited %d more node(s) to %s on %s",
             claim.job_id, claim.attempt, resources.nodes - 1, invitation.endpoint, queue)
    return invitation


def launch_node(
    invitation: Invitation, workdir: Path, *, settings: Settings, spare: SpareLauncher | None = None
) -> ChildProcess:
    """This node's launcher (worker.grpo.launch) for the invitation's attempt, run by `spare` where there is one."""
    command = launch_command(
        "worker.rank_job", [json.dumps(invitation.claim), str(workdir), invitation.queue],
        nproc_per_node=invitation.nproc_per_node, run_id=invitation.run_id, nnodes=invitation.nnodes,
        node_rank=invitation.node_rank, store=invitation.endpoint, address=node_address(settings),
        join_timeout_s=settings.node_join_timeout_seconds,
    )
    return start_launcher(command, spare)


def attempt_owns_job(job_id: str, attempt: int) -> bool:
    control = reporting.read_control(job_id)
    return control is not None and control.attempt == attempt and control.status in OWNED_STATES


def join(invitation: Invitation, settings: Settings | None = None, spare: SpareLauncher | None = None) -> str:
    """Run this node's ranks of the invited attempt (through `spare` where the task has one); returns what
    happened (for the worker log)."""
    settings = settings or get_settings()
    if not with_db_retry(lambda: attempt_owns_job(invitation.job_id, invitation.attempt)):
        log.info("job %s: invitation for attempt %d is stale; dropped", invitation.job_id, invitation.attempt)
        return "stale"
    workdir = (
        Path(settings.data_dir) / "work" / invitation.job_id / f"attempt-{invitation.attempt}-node-{uuid.uuid4().hex[:8]}"
    )
    log.info("job %s: joining attempt %d at %s", invitation.job_id, invitation.attempt, invitation.endpoint)
    launcher = launch_node(invitation, workdir, settings=settings, spare=spare)
    try:
        checked = time.monotonic()
        while launcher.poll() is None:
            time.sleep(0.5)
            if time.monotonic() - checked < CONTROL_POLL_S:
                continue
            checked = time.monotonic()
            try:
                owned = attempt_owns_job(invitation.job_id, invitation.attempt)
            except Exception:
                log.warning("job %s: could not read the job's state; continuing", invitation.job_id, exc_info=True)
                continue
            if not owned:  # finished, or a newer attempt took over: these ranks must stop
                stop_process(launcher, grace_s=STOP_GRACE_S)
        return f"ranks exited ({launcher.returncode})"
    finally:
        if launcher.poll() is None:
            stop_process(launcher, grace_s=STOP_GRACE_S)
        shutil.rmtree(workdir, ignore_errors=True)
