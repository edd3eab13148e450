"""A job on several devices (docs/distributed.md), seen from the process that claimed it: it renews the lease,
launches this node's ranks (worker.grpo.launch, a process of its own that keeps the job's sockets on loopback)
after inviting the workers of the other nodes (worker.nodes), and waits.

When the launcher exits with the job still running under this attempt, a rank died or hung: event
`rank_failed`, and the attempt ends without a final state, so that the lease lapses and the job resumes from its
last checkpoint on the next attempt (any device count).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from contract.spec import Resources
from service.execution import reporting
from service.execution.lease import Claim, Heartbeat, LeaseLost, with_db_retry
from service.execution.runtime import Settings
from worker import nodes
from worker.grpo.launch import launch_command
from worker.processes import stop_process
from worker.spare_launcher import SpareLauncher, start_launcher

log = logging.getLogger(__name__)


def run_on_ranks(
    claim: Claim, heartbeat: Heartbeat, workdir: Path, resources: Resources, queue: str, settings: Settings,
    spare: SpareLauncher | None = None,
) -> str:
    """Launch the ranks (through `spare` where the task has one) and wait; the outcome as JobRunner.run returns
    it ("rank_failed" when they exited before the job ended)."""
    if resources.nodes > 1:
        invitation = nodes.invite(claim, queue, resources, settings)
        launcher = nodes.launch_node(invitation, workdir, settings=settings, spare=spare)
    else:
        launcher = start_launcher(launch_command(
            "worker.rank_job", [json.dumps(asdict(claim)), str(workdir), queue],
            nproc_per_node=resources.devices_per_node, run_id=nodes.new_run_id(),
        ), spare)
    while launcher.poll() is None:
        # The job left this attempt's hands: rank 0 finished it (the ranks are exiting), or a newer
        # attempt took it over (they must stop).
        if heartbeat.lost.wait(1.0):
            stop_process(launcher, grace_s=30)
    control = with_db_retry(lambda: reporting.read_control(claim.job_id))
    if control is None or control.attempt != claim.attempt:
        raise LeaseLost(claim.job_id, claim.attempt)
    if control.status in reporting.OWNED_STATES:
        log.warning("job %s: attempt %d: ranks exited (%d) before the job ended; it resumes when the lease lapses",
                    claim.job_id, claim.attempt, launcher.returncode)
        missing = " (or a node did not join in time)" if resources.nodes > 1 else ""
        reporting.record_event(
            claim, "rank_failed",
            f"a rank of attempt {claim.attempt} died or stopped answering{missing}; "
            "the job resumes from its last checkpoint",
            {"exit_code": launcher.returncode, "devices": resources.devices, "nodes": resources.nodes},
        )
        return "rank_failed"
    return control.status
