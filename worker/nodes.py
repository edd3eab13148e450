"""Jobs on several nodes (`resources.nodes: M > 1`): how the workers of M machines run one attempt together.

One Celery message wakes one worker, which claims the job and renews its lease as for any job (worker.runner).
That worker then:

1. opens the attempt's rendezvous at `GRPO_WORKER_ADDRESS:<a free port>` (torch.distributed's c10d rendezvous:
   its launcher serves the store there);
2. sends M - 1 `grpo.join_job` messages (an `Invitation`: job, attempt, claim, endpoint) to the job's queue,
   the queue of its devices per node, so each wakes another worker with that many devices;
3. launches its node's ranks with `--nnodes M` at that endpoint and waits, as for one node.

A worker that receives an invitation checks that the attempt still owns the job (a late or redelivered
invitation is dropped), then launches its node's ranks at the same endpoint and waits for them, stopping
them if the job leaves the attempt's hands. It holds no lease: the claiming worker's lease covers the attempt.

The rendezvous assigns the nodes their ranks; rank 0 runs the job's reporting (worker.rank_job) on whichever
node it lands, with that worker's database and storage settings. Every node's launcher ends when a rank
anywhere dies or hangs (the collectives fail after `GRPO_COLLECTIVE_TIMEOUT_SECONDS`), and the claiming
worker then records `rank_failed`; a node that never arrives ends the rendezvous after
`GRPO_NODE_JOIN_TIMEOUT_SECONDS`. Either way the lease lapses and the job resumes from its last checkpoint,
on whichever workers take it next.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contract.spec import Resources
from service.kit.config import Settings, get_settings
from worker import reporting
from worker.lease import OWNED_STATES, Claim

log = logging.getLogger(__name__)

JOIN_JOB_TASK = "grpo.join_job"
CONTROL_POLL_S = 5.0  # how often a joined node checks that the attempt still owns the job
STOP_GRACE_S = 30.0


class Invitation(BaseModel):
    """What a claiming worker sends the other nodes' workers (the `grpo.join_job` message): everything their
    launchers need."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    claim: dict[str, Any]  # worker.lease.Claim, as JSON
    queue: str
    endpoint: str  # host:port of the rendezvous
    nnodes: int = Field(ge=2)
    nproc_per_node: int = Field(ge=1)

    @property
    def job_id(self) -> str:
        return str(self.claim["job_id"])

    @property
    def attempt(self) -> int:
        return int(self.claim["attempt"])


def rendezvous_endpoint(settings: Settings) -> str:
    """`host:port` where the claiming worker's launcher serves the attempt's rendezvous: the worker's address
    and a port free on it now."""
    host = settings.worker_address or socket.getfqdn()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((socket.gethostbyname(host), 0))
        port = probe.getsockname()[1]
    return f"{host}:{port}"


def invite(claim: Claim, queue: str, endpoint: str, resources: Resources) -> Invitation:
    """Send the invitations to the other `resources.nodes - 1` nodes; returns what was sent."""
    from worker.celery_app import app

    invitation = Invitation(
        claim=asdict(claim), queue=queue, endpoint=endpoint, nnodes=resources.nodes,
        nproc_per_node=resources.devices_per_node,
    )
    for _ in range(resources.nodes - 1):
        app.send_task(JOIN_JOB_TASK, args=[invitation.model_dump()], queue=queue)
    log.info("job %s: attempt %d invited %d more node(s) to %s on %s",
             claim.job_id, claim.attempt, resources.nodes - 1, endpoint, queue)
    return invitation


def launch_node(invitation: Invitation, workdir: Path, *, host: bool, settings: Settings) -> subprocess.Popen[bytes]:
    """This node's launcher (`torch.distributed.run --nnodes M`) for the invitation's attempt."""
    from worker.grpo.distributed import launch_command

    command = launch_command(
        "worker.rank_job", [json.dumps(invitation.claim), str(workdir), invitation.queue],
        nproc_per_node=invitation.nproc_per_node, nnodes=invitation.nnodes, rdzv_endpoint=invitation.endpoint,
        rdzv_id=f"{invitation.job_id}-{invitation.attempt}", rdzv_host=host,
        join_timeout_s=settings.node_join_timeout_seconds,
    )
    return subprocess.Popen(command)


def attempt_owns_job(job_id: str, attempt: int) -> bool:
    control = reporting.read_control(job_id)
    return control is not None and control.attempt == attempt and control.status in OWNED_STATES


def join(invitation: Invitation, settings: Settings | None = None) -> str:
    """Run this node's ranks of the invited attempt; returns what happened (for the worker log)."""
    from worker.lease import with_db_retry
    from worker.runner import stop_process

    settings = settings or get_settings()
    if not with_db_retry(lambda: attempt_owns_job(invitation.job_id, invitation.attempt)):
        log.info("job %s: invitation for attempt %d is stale; dropped", invitation.job_id, invitation.attempt)
        return "stale"
    workdir = (
        Path(settings.data_dir) / "work" / invitation.job_id / f"attempt-{invitation.attempt}-node-{uuid.uuid4().hex[:8]}"
    )
    log.info("job %s: joining attempt %d at %s", invitation.job_id, invitation.attempt, invitation.endpoint)
    launcher = launch_node(invitation, workdir, host=False, settings=settings)
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
