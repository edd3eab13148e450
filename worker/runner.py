"""JobRunner: one delivery of `grpo.run_job(job_id)`, from claim to final state.

    claim (or return quietly: duplicate delivery / cancelled / finished)
      -> heartbeat thread renews the lease
      -> spec from the job row -> dataset from storage -> base model (checked again: worker.model_sources)
      -> resume point: the latest checkpoint that downloads and verifies against its manifest
      -> rewards (built-ins, reward models, remote endpoints with retry events)
      -> GRPOTrainer with hooks: every step's metrics/samples, every checkpoint (uploaded, then recorded),
         should_stop polled between steps (cancel, pause, lost lease)
      -> final state: succeeded | paused | cancelled | failed (with a code)

Every report is fenced by the attempt (service.execution.reporting); when a newer attempt owns the job the runner
stops without writing anything more. How the outcome maps to states:

- trained to the end -> `succeeded` (or `cancelled` if a cancel arrived meanwhile);
- stopped by should_stop -> the trainer saved a checkpoint; `paused` after a pause request, `cancelled`
  after a cancel; `paused` with error `budget_exhausted` when the step just recorded reached the job's budget
  or its tenant's monthly cap (service.usage.budget);
- `RewardUnavailable` (an endpoint stayed down: its circuit opened, or too many completions of a step went
  unanswered by the step deadline) -> event `reward_endpoint_unavailable`, `paused`; a flaky endpoint whose
  few unanswered completions abstain is only reported (event `reward_degraded`);
  `POST /v1/jobs/{id}/resume` re-enqueues it and it resumes from its last checkpoint;
- `EnvironmentOutage` (not one episode of a step could open: the environment stayed busy or down) -> event
  `environment_unavailable`, `paused`, resumable the same way; episodes that fail one by one only count in
  `env/errors`; a model whose chat template has no tool format -> `environment_tool_format`;
- `RewardError` -> `failed` with the error's code (`reward_endpoint_invalid_response`, ...) and message;
  a registered reward URL this worker's policy refuses fails it as `reward_endpoint_url_rejected`;
- a dataset that no longer parses -> `failed` (`dataset_invalid`); a `checkpoint:<id>` model that is
  missing or corrupt -> `failed` (`base_checkpoint_invalid`); a model source the worker refuses
  (worker.model_sources) -> `model_source_refused` / `model_too_large`; a model that does not load ->
  `model_load_failed` (the reason's class only: unknown architecture, corrupt safetensors file, GGUF without
  the gguf package; the loader's error in the log); anything else -> `failed`
  (`training_error`, with the exception type and message; only the type for filesystem errors).
Metrics, events and checkpoints already recorded always stay.

A job with `resources.devices: N > 1` (worker.rank_job, docs/distributed.md): this process claims it and
renews the lease, then launches N ranks (worker.grpo.launch, a process of its own that keeps the job's
sockets on loopback). Rank 0 runs everything above, talking to the database and storage alone, and hands
the other ranks their inputs (RankInputs: spec, rows, local model and resume paths, reward endpoint
configurations) through a file of its working directory; through the collectives go only paths and storage
locations, so that no secret and no training data leaves a node that way. When the launcher exits with the job still running under this
attempt, a rank died or hung: event `rank_failed`, and the attempt ends without a final state, so that the
lease lapses and the job resumes from its last checkpoint on the next attempt (any device count). With
`resources.nodes: M > 1` this process also invites the workers of M - 1 other machines to the attempt
(worker.nodes) and launches its own node's ranks only.

torch is imported only inside `run()` (through the trainer), never when this module is imported: the
Celery parent process that forks children must not initialise CUDA.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.reward_types import RewardError, RewardUnavailable
from outbound.openenv_session import EnvironmentOutage
from outbound.urlpolicy import UrlRejected
from service.execution import inputs as port
from service.execution import reporting
from service.execution.lease import (
    Claim,
    ClaimLimits,
    Heartbeat,
    LeaseLost,
    claim_delivery,
    process_worker_id,
    wake_waiting_jobs,
    with_db_retry,
)
from service.execution.reporting import Exhausted, JobStatus, SampleIn
from service.execution.runtime import Settings, Storage, get_settings, get_storage, job_context
from worker import metrics as worker_metrics
from worker.checkpoint_upload import upload_checkpoint
from worker.environment_setup import URL_REJECTED, environment_for
from worker.evaluation_run import run_evaluation
from worker.failures import JobFailure, training_error_message
from worker.grpo.tool_calls import NoToolFormat
from worker.job_inputs import RANK_INPUTS_FILE, InputFetcher, RankInputs, Rows
from worker.model_sources import ModelUnavailable
from worker.ranks import run_on_ranks
from worker.reward_setup import RewardSetup, build_rewards, endpoint_config
from worker.spare_launcher import SpareLauncher
from worker.usage_meter import UsageMeter

if TYPE_CHECKING:
    from worker.grpo.distributed import Ranks
    from worker.grpo.trainer import GRPOTrainer, TrainResult
    from worker.tensorboard import TensorBoardLog

log = logging.getLogger(__name__)


class _NoHeartbeat:
    """A rank's stand-in for Heartbeat: the launching process renews the lease."""

    def __init__(self) -> None:
        self.lost = threading.Event()


def default_worker_id() -> str:
    """An opaque id per worker process (job events show it to tenants): see service.execution.lease.process_worker_id."""
    return process_worker_id()


class JobRunner:
    """Runs one delivery of a job. `run()` returns what happened (for logs and tests)."""

    def __init__(self, job_id: str, *, settings: Settings | None = None, worker_id: str | None = None) -> None:
        self.job_id = job_id
        self.settings = settings or get_settings()
        self.worker_id = worker_id or default_worker_id()
        self.storage: Storage = get_storage()
        self.fetcher = InputFetcher(job_id, self.settings, self.storage)
        self._step_metrics: dict[int, dict[str, float]] = {}
        self._tensorboard: TensorBoardLog | None = None
        self.ranks: Ranks | None = None  # set in rank 0 of a multi-device job (worker.rank_job)
        self._inputs_sent = False
        self._trained = False  # trainer.train() returned: every rank left the loop together
        self._evaluation = False  # this job runs an evaluation (worker.evaluation_run)
        self._meter: UsageMeter | None = None
        self._budget_reached: tuple[Exhausted, int] | None = None  # (the limit, the step that reached it)

    # --- entry points --------------------------------------------------------------------------

    def run(self, spare: SpareLauncher | None = None) -> str:
        """"duplicate" when the claim was refused, "lease_lost" when a newer attempt took over,
        else the job's final state for this attempt. `spare` launches the ranks of a job on several devices
        (worker.spare_launcher), where the task has one.

        The job run is the fair choice of this job's queue (service.execution.lease.claim_next): `job_id` afterwards."""
        claim = with_db_retry(self._claim)
        if claim is None:
            log.info("job %s: not claimable, nor any other job of its queue (duplicate delivery, finished, paused, "
                     "cancelled, or every queued job waits for its tenant's quota)", self.job_id)
            return "duplicate"
        self.job_id = self.fetcher.job_id = claim.job_id
        log.info("job %s: attempt %d claimed by %s, resuming at step %d",
                 self.job_id, claim.attempt, self.worker_id, claim.resume_step)
        workdir = Path(self.settings.data_dir) / "work" / self.job_id / f"attempt-{claim.attempt}"
        try:
            with Heartbeat(claim) as heartbeat, job_context(self.job_id, claim.attempt):
                placement = with_db_retry(lambda: port.job_placement(claim.job_id))
                if placement is not None and placement[0].devices > 1:
                    return run_on_ranks(claim, heartbeat, workdir, *placement, self.settings, spare)
                return self._run_claimed(claim, heartbeat, workdir).value
        except LeaseLost:
            log.warning("job %s: attempt %d lost the job to a newer attempt; stopped", self.job_id, claim.attempt)
            return "lease_lost"
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            wake_waiting_jobs(claim.job_id)

    def run_rank0(self, claim: Claim, workdir: Path, ranks: Ranks) -> tuple[str, bool]:
        """Rank 0 of a multi-device job: the claimed attempt, as `run()` would train it in one process.
        Returns (outcome, whether the other ranks left training with it)."""
        self.ranks = ranks
        finished = False
        try:
            with job_context(self.job_id, claim.attempt):
                status = self._run_claimed(claim, _NoHeartbeat(), workdir)  # type: ignore[arg-type]
                finished = self._inputs_sent and self._trained
                return status.value, finished
        except LeaseLost:
            return "lease_lost", False
        finally:
            if not self._inputs_sent:
                self._send_inputs(None)  # the other ranks stop waiting: this attempt ends here

    def inputs_for_node(self, claim: Claim, shared: Mapping[str, Any], workdir: Path) -> RankInputs:
        """A node other than rank 0's: the inputs rank 0 prepared, rebuilt from the database and storage (spec,
        rows, reward endpoints with their secrets) and `shared` (paths, what to download), with this node's
        own copies of the checkpoints rank 0 fetched, under `workdir`."""
        inputs = with_db_retry(lambda: self._load_inputs(claim))
        rows = self.fetcher.rows(inputs, workdir)
        configs = {rf_id: endpoint_config(inputs, rf_id, rf_id, self.settings) for rf_id in inputs.reward_endpoints}
        rank_inputs = RankInputs.from_shared(shared, inputs.spec, rows, configs)
        rank_inputs.fetch_onto(workdir, self.storage)
        return rank_inputs.on_node(workdir)

    def _send_inputs(self, inputs: RankInputs | None, workdir: Path | None = None) -> None:
        """Hand the other ranks their inputs (None: this attempt ends before training): the ranks of this node
        read them from `workdir`; the collectives carry only `RankInputs.shared()`."""
        # The collectives import torch: only the job's process may (the Celery parent forks children).
        from worker.grpo.distributed import wait_for_nodes
        from worker.grpo.wire import broadcast_value

        self._inputs_sent = True
        if inputs is not None and workdir is not None:
            inputs.write(workdir / RANK_INPUTS_FILE)
        broadcast_value(None if inputs is None else inputs.shared())
        if inputs is not None and self.ranks is not None:
            wait_for_nodes(self.ranks)  # the other nodes build their own (worker.rank_job)

    def _claim(self) -> Claim | None:
        limits = ClaimLimits(self.settings.quota_max_running_jobs, self.settings.quota_max_devices)
        return claim_delivery(self.job_id, self.worker_id, self.settings.lease_seconds, limits)

    def _load_inputs(self, claim: Claim) -> port.JobInputs:
        try:
            return port.load_inputs(claim)
        except port.InputMissing as exc:
            raise JobFailure(exc.code, exc.message) from exc

    # --- outcome -------------------------------------------------------------------------------

    def _run_claimed(self, claim: Claim, heartbeat: Heartbeat, workdir: Path) -> JobStatus:
        try:
            result = self._train(claim, heartbeat, workdir)
        except LeaseLost:
            raise
        except RewardUnavailable as exc:
            worker_metrics.reward_error(exc.source, exc.code)
            reporting.record_event(claim, "reward_endpoint_unavailable", str(exc), {"source": exc.source})
            return reporting.finish(claim, JobStatus.paused, reason=f"reward endpoint unavailable: {exc.reason}")
        except EnvironmentOutage as exc:
            reporting.record_event(claim, exc.code, str(exc), {"environment_id": exc.environment_id})
            return reporting.finish(claim, JobStatus.paused, reason=f"environment unavailable: {exc.reason}")
        except UrlRejected as exc:  # the environment's host resolved to an address the policy refuses
            return self._fail(claim, URL_REJECTED, f"environment: {exc.message}")
        except RewardError as exc:
            worker_metrics.reward_error(exc.source, exc.code)
            return self._fail(claim, exc.code, str(exc))
        except (JobFailure, ModelUnavailable) as exc:
            return self._fail(claim, exc.code, exc.message)
        except Exception as exc:
            if self.ranks is not None and _is_collective_failure(exc):
                raise  # another rank died or hung: not the job's failure
            log.exception("job %s: attempt %d crashed", self.job_id, claim.attempt)
            return self._fail(claim, "training_error", training_error_message(exc))
        if heartbeat.lost.is_set():
            raise LeaseLost(claim.job_id, claim.attempt)
        return self._outcome(claim, result)

    def _outcome(self, claim: Claim, result: TrainResult) -> JobStatus:
        """The final state of an attempt whose training returned."""
        if result.stopped and self._budget_reached is not None:  # the trainer saved a checkpoint
            reached, step = self._budget_reached
            return reporting.pause_for_budget(claim, reached, step)
        if result.unhealthy is not None:  # on_unhealthy: pause (the trainer saved a checkpoint)
            finding = result.unhealthy
            return reporting.finish(
                claim, JobStatus.paused, reason=f"unhealthy at step {finding.step}: {finding.kind}: {finding.message}"
            )
        if not result.stopped and self._evaluation:
            return reporting.finish_evaluation(claim, reason=f"evaluated {result.step} items")
        if not result.stopped:
            return reporting.finish(claim, JobStatus.succeeded, reason=f"trained {result.step} steps")
        control = reporting.read_control(self.job_id)
        if control is None or control.attempt != claim.attempt or control.status not in reporting.OWNED_STATES:
            raise LeaseLost(claim.job_id, claim.attempt)
        if control.status == JobStatus.cancelling.value:
            return reporting.finish(claim, JobStatus.cancelled, reason=f"cancelled at step {result.step}")
        return reporting.finish(claim, JobStatus.paused, reason=f"paused at step {result.step}")

    def _fail(self, claim: Claim, code: str, message: str) -> JobStatus:
        log.warning("job %s: failed (%s): %s", self.job_id, code, message)
        return reporting.finish(claim, JobStatus.failed, reason=message, error_code=code, error_message=message)

    # --- training ------------------------------------------------------------------------------

    def _train(self, claim: Claim, heartbeat: Heartbeat, workdir: Path) -> TrainResult:
        inputs = with_db_retry(lambda: self._load_inputs(claim))
        if inputs.evaluation is not None:
            return self._evaluate(claim, heartbeat, inputs, workdir)
        if inputs.spec.hyperparameters.use_vllm:
            # vllm_rollout imports torch: only the job's process may (the Celery parent forks children).
            from worker.grpo.vllm_rollout import VLLMUnavailable, vllm_installed

            if not vllm_installed():
                raise JobFailure("vllm_unavailable", str(VLLMUnavailable()))
        rows = self.fetcher.rows(inputs, workdir)
        base_model = self.fetcher.resolve_model(inputs, "base_model", inputs.spec.base_model, workdir / "base")
        resume_from = self.fetcher.resume_point(claim, workdir / "resume")
        stray = port.delete_unrecorded_checkpoints(self.storage, claim.job_id)
        if stray:
            log.info("job %s: deleted unrecorded checkpoint files %s", claim.job_id, ", ".join(stray))
        cpu = inputs.queue.startswith("cpu")
        rewards = build_rewards(claim, inputs, self.fetcher, self.settings, workdir / "reward-models",
                                device="cpu" if cpu else _default_device())
        device = "cpu" if cpu else None
        if self.ranks is not None:
            # The collectives import torch: only the job's process may (the Celery parent forks children).
            from worker.grpo.distributed import device_for

            device = device_for(self.ranks)
            self._send_inputs(RankInputs(
                inputs.spec, inputs.queue, *rows, base_model, resume_from, rewards.remote_configs,
                rewards.model_paths, workdir / "checkpoints", workdir, self.ranks.node, tuple(self.fetcher.fetched),
            ), workdir)
        if self.settings.tensorboard:
            from worker.tensorboard import (
                TensorBoardLog,  # imports torch's SummaryWriter: the job's process only
            )

            self._tensorboard = TensorBoardLog(workdir / "tensorboard", f"attempt-{claim.attempt}")
        trainer = self._trainer(claim, heartbeat, inputs, rows, rewards, base_model, resume_from, workdir, device)
        reporting.set_total_steps(claim, trainer.total_steps)
        self._meter = UsageMeter(
            tenant_id=inputs.tenant_id,
            num_sources=len(inputs.spec.rewards),
            max_completion_length=inputs.spec.hyperparameters.max_completion_length,
            num_iterations=inputs.spec.hyperparameters.num_iterations,
            parameters=sum(p.numel() for p in trainer.models.policy.parameters()),
            cpu=cpu,
            devices=inputs.spec.resources.devices,
        )
        try:
            result = trainer.train()
            self._trained = True
            return result
        finally:
            if self._tensorboard is not None:
                self._tensorboard.close()

    def _evaluate(self, claim: Claim, heartbeat: Heartbeat, inputs: port.JobInputs, workdir: Path) -> TrainResult:
        """An evaluation's attempt (worker.evaluation_run), its outcome as the trainer's."""
        # The trainer's result type imports torch: only the job's process may (the Celery parent forks children).
        from worker.grpo.trainer import TrainResult

        self._evaluation = True
        device = "cpu" if inputs.queue.startswith("cpu") else _default_device()
        outcome = run_evaluation(claim, inputs, self.fetcher, self.settings, workdir, device=device,
                                 should_stop=lambda: self._should_stop(claim, heartbeat))
        self._budget_reached = outcome.budget
        return TrainResult(step=outcome.items_done, stopped=outcome.stopped, last_checkpoint=None)

    def _trainer(
        self, claim: Claim, heartbeat: Heartbeat, inputs: port.JobInputs, rows: Rows, rewards: RewardSetup,
        base_model: str, resume_from: Path | None, workdir: Path, device: str | None,
    ) -> GRPOTrainer:
        """The engine's trainer with this attempt's hooks: every step's report, every checkpoint's upload, the
        stop poll between steps, health findings as events."""
        # The engine imports torch: only the job's process may (the Celery parent forks children).
        from worker.grpo.load_errors import load_failure_reason
        from worker.grpo.trainer import GRPOTrainer

        train_rows, eval_rows, retain_rows = rows
        environment = environment_for(inputs.spec, inputs.environment, self.settings, claim)
        try:
            return GRPOTrainer(
                inputs.spec.hyperparameters,
                base_model=base_model,
                train_rows=train_rows,
                eval_rows=eval_rows,
                retain_rows=retain_rows,
                reward=rewards.reward,
                output_dir=workdir / "checkpoints",
                model_cache_dir=Path(self.settings.data_dir) / "models",
                resume_from=resume_from,
                on_metrics=lambda step, metrics, samples: self._on_metrics(claim, step, metrics, samples),
                on_checkpoint=lambda step, path, manifest: self._on_checkpoint(claim, step, path, manifest),
                should_stop=lambda: self._should_stop(claim, heartbeat),
                on_health=lambda finding: reporting.record_event(
                    claim, "health", f"{finding.kind}: {finding.message}", finding.as_event_data()
                ),
                device=device,
                checkpoint_metadata={"job_id": self.job_id, "attempt": claim.attempt},
                ranks=self.ranks,
                environment=environment,
            )
        except NoToolFormat as exc:
            raise JobFailure("environment_tool_format", f"base_model: {exc}") from exc
        except Exception as exc:
            # from_pretrained's errors describe the worker's filesystem: the tenant gets a code and the reason's
            # class (unknown architecture, corrupt safetensors, GGUF without gguf), the log the rest.
            log.exception("job %s: loading base_model %r failed", self.job_id, inputs.spec.base_model)
            raise ModelUnavailable(
                "model_load_failed", "base_model", inputs.spec.base_model, load_failure_reason(exc, base_model)
            ) from exc

    # --- hooks ---------------------------------------------------------------------------------

    def _on_checkpoint(self, claim: Claim, step: int, path: Path, manifest: dict[str, Any]) -> None:
        upload_checkpoint(self.storage, claim, step, path, manifest,
                          metrics=self._step_metrics.get(step), tensorboard=self._tensorboard)

    def _on_metrics(self, claim: Claim, step: int, metrics: Mapping[str, float], samples: list[dict[str, Any]]) -> None:
        self._step_metrics = {step: dict(metrics)}
        worker_metrics.observe_step(metrics)
        if self._tensorboard is not None:
            self._tensorboard.write(step, metrics)
        logged = [
            SampleIn(prompt=str(s["prompt"]), completion=str(s["completion"]), reward=_finite_or_none(s.get("reward")),
                     rewards={k: _finite_or_none(v) for k, v in dict(s.get("rewards", {})).items()},
                     policy_version=s.get("policy_version"), episode=s.get("episode"))
            for s in samples
        ]
        usage = self._meter.take(metrics) if self._meter is not None else None
        reached = reporting.record_step(claim, step, metrics, logged, usage)
        if usage is not None and self._meter is not None:
            worker_metrics.observe_usage(self._meter.tenant_id, usage)
        if reached is not None and self._budget_reached is None:
            log.info("job %s: %s at step %d; pausing", claim.job_id, reached.message, step)
            self._budget_reached = (reached, step)

    def _should_stop(self, claim: Claim, heartbeat: Heartbeat) -> bool:
        """Polled between steps: a cancel or pause request, a reached budget, or this attempt no longer owning
        the job."""
        if heartbeat.lost.is_set() or self._budget_reached is not None:
            return True
        try:
            control = reporting.read_control(claim.job_id)
        except Exception:
            log.warning("job %s: could not read the job's state; continuing", claim.job_id, exc_info=True)
            return False
        if control is None:
            return True
        if control.attempt != claim.attempt or control.status not in reporting.OWNED_STATES:
            heartbeat.lost.set()
            return True
        return control.status == JobStatus.cancelling.value or control.pause_requested


def _is_collective_failure(exc: Exception) -> bool:
    # The collectives import torch: only the job's process may (the Celery parent forks children).
    from worker.grpo.distributed import is_collective_failure

    return is_collective_failure(exc)


def _default_device() -> str:
    import torch  # the job's process only (the Celery parent forks children and must not initialise CUDA)

    return "cuda" if torch.cuda.is_available() else "cpu"


def _finite_or_none(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None
