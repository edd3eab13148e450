"""One rank of a multi-device job: `python -m worker.rank_job CLAIM_JSON WORKDIR QUEUE`, launched by JobRunner
through torch.distributed.run (worker.runner; docs/distributed.md).

Rank 0 is a JobRunner for the claimed attempt: it prepares the inputs, reports and finishes the job, and
hands the other ranks their inputs (RankInputs). The others train their share without the database; on a
node other than rank 0's, that node's first rank downloads its own copies of the checkpoints rank 0
fetched (a resume point, a `checkpoint:` model) from storage. With several nodes (worker.nodes) rank 0 may
be on any of them, as the rendezvous numbers the nodes; WORKDIR is always the local worker's.

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

import service.models  # noqa: F401  # every table, so the ORM mappers configure (as in worker.tasks)
from service.kit.config import get_settings
from worker.lease import Claim

log = logging.getLogger(__name__)
EXIT_ALONE = 3


def main(claim_json: str, workdir: Path, queue: str) -> int:
    from worker.grpo.distributed import init_from_env, local_peer_pids, shutdown

    settings = get_settings()
    claim = Claim(**json.loads(claim_json))
    ranks = init_from_env(settings.collective_timeout_seconds, cpu=queue.startswith("cpu"))
    peers = local_peer_pids(ranks)
    try:
        if ranks.is_main:
            from worker.runner import JobRunner

            outcome, together = JobRunner(claim.job_id, worker_id=claim.worker_id).run_rank0(claim, workdir, ranks)
            log.info("job %s: rank 0 -> %s", claim.job_id, outcome)
            return 0 if together else EXIT_ALONE
        _follow(ranks, workdir)
        return 0
    except BaseException:
        for pid in peers:  # they wait in a collective that will not complete
            _kill(pid)
        raise
    finally:
        shutdown()


def _follow(ranks: object, workdir: Path) -> None:
    """A rank other than 0: its share of the training, no hooks. On another node than rank 0's, the first
    rank of the node downloads its own copies of the checkpoints rank 0 fetched, into `workdir`."""
    from outbound.rewards import build_remote_source
    from service.storage import get_storage
    from worker.grpo.distributed import Ranks, broadcast_object, device_for, wait_for_nodes
    from worker.grpo.rewards import build_reward_sources
    from worker.grpo.trainer import GRPOTrainer
    from worker.runner import RankInputs

    assert isinstance(ranks, Ranks)
    inputs = broadcast_object(None)
    if not isinstance(inputs, RankInputs):
        return  # rank 0 ended the attempt before training (a failure it recorded, or nothing to do)
    elsewhere = ranks.node != inputs.node
    if elsewhere and ranks.local_rank == 0:
        inputs.fetch_onto(workdir, get_storage())
        log.info("node %d: downloaded its copies of %d checkpoint(s) rank 0 fetched", ranks.node, len(inputs.fetched))
    wait_for_nodes(ranks)
    if elsewhere:
        inputs = inputs.on_node(workdir)
    spec = inputs.spec
    reward = build_reward_sources(
        spec.rewards,
        remote=lambda s: build_remote_source(inputs.remote_configs[s.reward_function_id]),
        device=device_for(ranks) or "cpu",
        model_paths=inputs.model_paths,
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
