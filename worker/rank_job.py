"""One rank of a multi-device job: `python -m worker.rank_job CLAIM_JSON WORKDIR QUEUE`, launched by JobRunner
through worker.grpo.launch (worker.runner; docs/distributed.md).

Rank 0 is a JobRunner for the claimed attempt: it prepares the inputs, reports and finishes the job, and
hands the other ranks their inputs (RankInputs), through a file of WORKDIR on its own node. The others train
their share without reporting anything. On a node other than rank 0's (the claiming worker's node), that
node's first rank rebuilds the inputs from the database and storage its worker trusts (spec, rows, reward
endpoints and their secrets) and downloads its own copies of the checkpoints rank 0 fetched (a resume point,
a `checkpoint:` model); only their locations come through the collectives. WORKDIR is always the local
worker's.

Exit codes: 0 when the job ended with every rank together; 3 when rank 0 ended the attempt alone (a
failure it recorded, or the lease lost), so the launcher stops the others at once; a rank whose collective
fails (a peer died or hung past the process-group timeout) kills its peers on this node, so that a stopped
(SIGSTOP) rank does not hold the attempt for the launcher's grace period too.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

from outbound.rewards import build_remote_source
from service.execution.lease import Claim
from service.execution.runtime import get_settings, prepare_worker_process
from worker.grpo.distributed import (
    Ranks,
    device_for,
    init_from_env,
    local_peer_pids,
    shutdown,
    wait_for_nodes,
)
from worker.grpo.rewards import build_reward_sources
from worker.grpo.trainer import GRPOTrainer
from worker.grpo.wire import broadcast_value
from worker.job_inputs import RANK_INPUTS_FILE, RankInputs
from worker.runner import JobRunner

log = logging.getLogger(__name__)
EXIT_ALONE = 3


def main(claim_json: str, workdir: Path, queue: str) -> int:
    prepare_worker_process()  # rank 0 reports the job's events from this process
    settings = get_settings()
    claim = Claim(**json.loads(claim_json))
    ranks = init_from_env(settings.collective_timeout_seconds, cpu=queue.startswith("cpu"))
    peers = local_peer_pids(ranks)
    try:
        if ranks.is_main:
            outcome, together = JobRunner(claim.job_id, worker_id=claim.worker_id).run_rank0(claim, workdir, ranks)
            log.info("job %s: rank 0 -> %s", claim.job_id, outcome)
            return 0 if together else EXIT_ALONE
        _follow(ranks, claim, workdir)
        return 0
    except BaseException:
        for pid in peers:  # they wait in a collective that will not complete
            _kill(pid)
        raise
    finally:
        shutdown()


def _follow(ranks: Ranks, claim: Claim, workdir: Path) -> None:
    """A rank other than 0: its share of the training, no hooks."""
    shared = broadcast_value(None)
    if shared is None:
        return  # rank 0 ended the attempt before training (a failure it recorded, or nothing to do)
    elsewhere = ranks.node != shared["node"]
    if elsewhere and ranks.local_rank == 0:
        inputs = JobRunner(claim.job_id, worker_id=claim.worker_id).inputs_for_node(claim, shared, workdir)
        inputs.write(workdir / RANK_INPUTS_FILE)
        log.info("node %d: built its inputs and downloaded %d checkpoint(s)", ranks.node, len(inputs.fetched))
    wait_for_nodes(ranks)
    inputs = RankInputs.read(workdir / RANK_INPUTS_FILE)
    spec = inputs.spec
    reward = build_reward_sources(
        spec.rewards,
        remote=lambda s: build_remote_source(inputs.remote_configs[s.reward_function_id]),
        device=device_for(ranks) or "cpu",
        model_paths=inputs.model_paths,
        grader_limits=get_settings().grader_limits(),
    )
    trainer = GRPOTrainer(
        spec.hyperparameters,
        base_model=inputs.base_model,
        train_rows=inputs.train_rows,
        eval_rows=inputs.eval_rows,
        retain_rows=inputs.retain_rows,
        reward=reward,
        output_dir=inputs.output_dir,
        model_cache_dir=Path(get_settings().data_dir) / "models",
        resume_from=inputs.resume_from,
        device=device_for(ranks),
        ranks=ranks,
    )
    trainer.train()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
