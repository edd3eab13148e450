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

import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.reward_types import RewardError, RewardUnavailable
from contract.spec import BUILTIN_PREFIX, JobSpec, ModelRewardSpec, RemoteRewardSpec, reward_function_refs
from outbound.urlpolicy import UrlRejected, check_url_syntax
from service.checkpoints import repository as checkpoints_repository
from service.checkpoints.models import Checkpoint
from service.checkpoints.service import new_checkpoint_id
from service.execution import reporting
from service.execution.lease import (
    OWNED_STATES,
    Claim,
    ClaimLimits,
    Heartbeat,
    LeaseLost,
    claim_next,
    latest_checkpoint,
    process_worker_id,
    rewind_to,
    wake_waiting_jobs,
    with_db_retry,
)
from service.jobs import repository
from service.jobs.model_sources import ModelSourceKind, ModelSourcePolicy
from service.jobs.schemas import SampleIn
from service.jobs.states import JobStatus
from service.kit.config import Settings, get_settings
from service.kit.db import session_scope, utcnow
from service.observability.logs import job_context
from service.rewards.models import RewardFunction
from service.rewards.service import previous_secret_in_overlap
from service.storage import Storage, checkpoint_key, checkpoint_prefix, get_storage, tensorboard_key
from service.usage.budget import Exhausted
from service.usage.service import StepUsageIn
from worker import metrics as worker_metrics
from worker import nodes
from worker.model_sources import ModelUnavailable, check_hub_size, check_source

if TYPE_CHECKING:
    from contract.spec import Resources
    from outbound.rewards import RemoteRewardConfig, RetryEvent
    from outbound.rewards.source import DegradedEvent
    from worker.grpo.data import PromptRow
    from worker.grpo.distributed import Ranks
    from worker.grpo.rewards import CompositeReward
    from worker.grpo.trainer import TrainResult
    from worker.tensorboard import TensorBoardLog

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
_CHUNK = 1 << 20


class JobFailure(Exception):
    """A failure with a stable error code for the job row."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class FetchedCheckpoint:
    """A checkpoint rank 0 downloaded into its working directory (to resume from, or a model source)."""

    directory: Path
    storage_path: str
    manifest: list[dict[str, Any]]


RANK_INPUTS_FILE = "rank-inputs.json"


@dataclass(frozen=True)
class RankInputs:
    """What the other ranks of a job need to train without the database. Rank 0 writes them into its working
    directory for the ranks of its node (`write`); a node other than rank 0's builds its own from the
    database and storage it trusts, given only `shared()` through the collectives (JobRunner.inputs_for_node),
    and downloads its own copies of `fetched` (`on_node`)."""

    spec: JobSpec
    queue: str
    train_rows: list[PromptRow]
    eval_rows: list[PromptRow] | None
    retain_rows: list[PromptRow] | None
    base_model: str
    resume_from: Path | None
    remote_configs: dict[str, RemoteRewardConfig]  # reward_function_id -> its endpoint, secrets included
    model_paths: dict[str, str]
    output_dir: Path
    workdir: Path  # rank 0's working directory, under which every path above lies
    node: int  # rank 0's node
    fetched: tuple[FetchedCheckpoint, ...]

    def shared(self) -> dict[str, Any]:
        """What rank 0 sends every rank through the collectives: where things are, nothing secret, no rows."""
        return {
            "queue": self.queue, "base_model": self.base_model,
            "resume_from": None if self.resume_from is None else str(self.resume_from),
            "model_paths": dict(self.model_paths), "output_dir": str(self.output_dir), "workdir": str(self.workdir),
            "node": self.node,
            "fetched": [
                {"directory": str(f.directory), "storage_path": f.storage_path, "manifest": list(f.manifest)}
                for f in self.fetched
            ],
        }

    @classmethod
    def from_shared(
        cls,
        shared: Mapping[str, Any],
        spec: JobSpec,
        rows: tuple[list[PromptRow], list[PromptRow] | None, list[PromptRow] | None],
        remote_configs: dict[str, RemoteRewardConfig],
    ) -> RankInputs:
        resume = shared["resume_from"]
        return cls(
            spec, str(shared["queue"]), *rows, str(shared["base_model"]), None if resume is None else Path(resume),
            remote_configs, dict(shared["model_paths"]), Path(shared["output_dir"]), Path(shared["workdir"]),
            int(shared["node"]),
            tuple(FetchedCheckpoint(Path(f["directory"]), f["storage_path"], f["manifest"]) for f in shared["fetched"]),
        )

    def write(self, path: Path) -> None:
        """Into this node's working directory, readable by the worker's user only (it holds secrets)."""

        def plain(rows: list[PromptRow] | None) -> list[dict[str, Any]] | None:
            return None if rows is None else [{"prompt": r.prompt, "extras": r.extras} for r in rows]

        document = {
            "shared": self.shared(), "spec": self.spec.model_dump(mode="json"),
            "rows": [plain(self.train_rows), plain(self.eval_rows), plain(self.retain_rows)],
            "remote_configs": {k: _with_secrets(c) for k, c in self.remote_configs.items()},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(document, handle)

    @classmethod
    def read(cls, path: Path) -> RankInputs:
        from outbound.rewards import RemoteRewardConfig
        from worker.grpo.data import PromptRow

        def rows(plain: list[dict[str, Any]] | None) -> list[PromptRow] | None:
            return None if plain is None else [PromptRow(prompt=r["prompt"], extras=r["extras"]) for r in plain]

        document = json.loads(path.read_text())
        train, eval_rows, retain = (rows(r) for r in document["rows"])
        assert train is not None
        configs = {k: RemoteRewardConfig.model_validate(c) for k, c in document["remote_configs"].items()}
        return cls.from_shared(document["shared"], JobSpec.model_validate(document["spec"]),
                               (train, eval_rows, retain), configs)

    def fetch_onto(self, workdir: Path, storage: Storage) -> None:
        """Download what rank 0 fetched into the same places under this node's `workdir`."""
        for checkpoint in self.fetched:
            directory = workdir / checkpoint.directory.relative_to(self.workdir)
            download_checkpoint_files(storage, checkpoint.storage_path, checkpoint.manifest, directory)

    def on_node(self, workdir: Path) -> RankInputs:
        """These inputs with rank 0's working directory replaced by this node's `workdir`."""

        def moved(path: str) -> str:
            inside = Path(path).is_relative_to(self.workdir)
            return str(workdir / Path(path).relative_to(self.workdir)) if inside else path

        return replace(
            self,
            base_model=moved(self.base_model),
            resume_from=None if self.resume_from is None else Path(moved(str(self.resume_from))),
            model_paths={name: moved(path) for name, path in self.model_paths.items()},
            output_dir=Path(moved(str(self.output_dir))),
            workdir=workdir,
        )


def _with_secrets(config: RemoteRewardConfig) -> dict[str, Any]:
    """The config as JSON with its secrets in clear (model_dump masks them), for RankInputs' file."""
    document = config.model_dump(mode="json")
    document["secret"] = config.secret.get_secret_value()
    if config.previous_secret is not None:
        document["previous_secret"] = config.previous_secret.get_secret_value()
    return document


def download_checkpoint_files(storage: Storage, storage_path: str, manifest: list[dict[str, Any]], directory: Path) -> Path:
    """Download every file `manifest` lists into `directory` and verify them (CheckpointCorrupt)."""
    from worker.grpo.checkpoint import verify_manifest

    shutil.rmtree(directory, ignore_errors=True)
    for entry in manifest:
        target = directory / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        with storage.open(f"{storage_path}/{entry['path']}") as source, target.open("wb") as handle:
            shutil.copyfileobj(source, handle, _CHUNK)
    verify_manifest(directory)
    return directory


class _NoHeartbeat:
    """A rank's stand-in for Heartbeat: the launching process renews the lease."""

    def __init__(self) -> None:
        self.lost = threading.Event()


@dataclass(frozen=True)
class JobContext:
    """What the runner reads from the database once, after the claim."""

    job_id: str
    tenant_id: str
    queue: str
    spec: JobSpec
    dataset_key: str
    eval_dataset_key: str | None
    retain_dataset_key: str | None
    reward_functions: dict[str, RewardFunction]


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
        self._step_metrics: dict[int, dict[str, float]] = {}
        self._tensorboard: TensorBoardLog | None = None
        self.ranks: Ranks | None = None  # set in rank 0 of a multi-device job (worker.rank_job)
        self._inputs_sent = False
        self._trained = False  # trainer.train() returned: every rank left the loop together
        self._remote_configs: dict[str, RemoteRewardConfig] = {}
        self._model_paths: dict[str, str] = {}
        self._fetched: list[FetchedCheckpoint] = []  # for ranks on other nodes (RankInputs.fetch_onto)
        self._meter: UsageMeter | None = None
        self._budget_reached: tuple[Exhausted, int] | None = None  # (the limit, the step that reached it)

    # --- entry point ---------------------------------------------------------------------------

    def run(self) -> str:
        """"duplicate" when the claim was refused, "lease_lost" when a newer attempt took over,
        else the job's final state for this attempt.

        The job run is the fair choice of this job's queue (service.execution.lease.claim_next): `job_id` afterwards."""
        claim = with_db_retry(self._claim)
        if claim is None:
            log.info("job %s: not claimable, nor any other job of its queue (duplicate delivery, finished, paused, "
                     "cancelled, or every queued job waits for its tenant's quota)", self.job_id)
            return "duplicate"
        self.job_id = claim.job_id
        log.info("job %s: attempt %d claimed by %s, resuming at step %d",
                 self.job_id, claim.attempt, self.worker_id, claim.resume_step)
        workdir = Path(self.settings.data_dir) / "work" / self.job_id / f"attempt-{claim.attempt}"
        try:
            with Heartbeat(claim) as heartbeat, job_context(self.job_id, claim.attempt):
                placement = with_db_retry(lambda: self._placement(claim))
                if placement is not None and placement[0].devices > 1:
                    return self._run_on_ranks(claim, heartbeat, workdir, *placement)
                return self._run_claimed(claim, heartbeat, workdir).value
        except LeaseLost:
            log.warning("job %s: attempt %d lost the job to a newer attempt; stopped", self.job_id, claim.attempt)
            return "lease_lost"
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            wake_waiting_jobs(claim.job_id)

    def _placement(self, claim: Claim) -> tuple[Resources, str] | None:
        """The job's resources and queue; None when its spec no longer validates (the attempt then fails
        in `_run_claimed` as usual)."""
        from pydantic import ValidationError

        with session_scope() as session:
            job = repository.get_job_any_tenant(session, claim.job_id)
            if job is None:
                return None
            spec, queue = job.spec, job.queue
        try:
            return JobSpec.model_validate(spec).resources, str(queue)
        except ValidationError:
            return None

    def _run_on_ranks(self, claim: Claim, heartbeat: Heartbeat, workdir: Path, resources: Resources, queue: str) -> str:
        """Launch the ranks (this node's, after inviting the other nodes' workers: worker.nodes) and wait; see
        the module docstring for what their exit means."""
        from worker.grpo.launch import launch_command

        if resources.nodes > 1:
            invitation = nodes.invite(claim, queue, resources, self.settings)
            launcher = nodes.launch_node(invitation, workdir, settings=self.settings)
        else:
            launcher = subprocess.Popen(launch_command(
                "worker.rank_job", [json.dumps(asdict(claim)), str(workdir), queue],
                nproc_per_node=resources.devices_per_node, run_id=nodes.new_run_id(),
            ))
        while launcher.poll() is None:
            # The job left this attempt's hands: rank 0 finished it (the ranks are exiting), or a newer
            # attempt took it over (they must stop).
            if heartbeat.lost.wait(1.0):
                stop_process(launcher, grace_s=30)
        control = with_db_retry(lambda: reporting.read_control(self.job_id))
        if control is None or control.attempt != claim.attempt:
            raise LeaseLost(claim.job_id, claim.attempt)
        if control.status in OWNED_STATES:
            log.warning("job %s: attempt %d: ranks exited (%d) before the job ended; it resumes when the lease lapses",
                        self.job_id, claim.attempt, launcher.returncode)
            missing = " (or a node did not join in time)" if resources.nodes > 1 else ""
            reporting.record_event(
                claim, "rank_failed",
                f"a rank of attempt {claim.attempt} died or stopped answering{missing}; "
                "the job resumes from its last checkpoint",
                {"exit_code": launcher.returncode, "devices": resources.devices, "nodes": resources.nodes},
            )
            return "rank_failed"
        return control.status

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

    def _send_inputs(self, inputs: RankInputs | None, workdir: Path | None = None) -> None:
        """Hand the other ranks their inputs (None: this attempt ends before training): the ranks of this node
        read them from `workdir`; the collectives carry only `RankInputs.shared()`."""
        from worker.grpo.distributed import wait_for_nodes
        from worker.grpo.wire import broadcast_value

        self._inputs_sent = True
        if inputs is not None and workdir is not None:
            inputs.write(workdir / RANK_INPUTS_FILE)
        broadcast_value(None if inputs is None else inputs.shared())
        if inputs is not None and self.ranks is not None:
            wait_for_nodes(self.ranks)  # the other nodes build their own (worker.rank_job)

    def inputs_for_node(self, claim: Claim, shared: Mapping[str, Any], workdir: Path) -> RankInputs:
        """A node other than rank 0's: the inputs rank 0 prepared, rebuilt from the database and storage (spec,
        rows, reward endpoints with their secrets) and `shared` (paths, what to download), with this node's
        own copies of the checkpoints rank 0 fetched, under `workdir`."""
        context = with_db_retry(lambda: self._load_context(claim))
        rows = (
            self._load_rows(context.dataset_key, workdir / "train.jsonl"),
            None if context.eval_dataset_key is None else self._load_rows(context.eval_dataset_key, workdir / "eval.jsonl"),
            None if context.retain_dataset_key is None
            else self._load_rows(context.retain_dataset_key, workdir / "retain.jsonl"),
        )
        configs = {rf_id: self._endpoint_config(context, rf_id, rf_id) for rf_id in context.reward_functions}
        inputs = RankInputs.from_shared(shared, context.spec, rows, configs)
        inputs.fetch_onto(workdir, self.storage)
        return inputs.on_node(workdir)

    def _claim(self) -> Claim | None:
        limits = ClaimLimits(self.settings.quota_max_running_jobs, self.settings.quota_max_devices)
        with session_scope() as session:
            return claim_next(session, self.job_id, self.worker_id, self.settings.lease_seconds, limits)

    def _run_claimed(self, claim: Claim, heartbeat: Heartbeat, workdir: Path) -> JobStatus:
        try:
            result = self._train(claim, heartbeat, workdir)
        except LeaseLost:
            raise
        except RewardUnavailable as exc:
            worker_metrics.reward_error(exc.source, exc.code)
            reporting.record_event(claim, "reward_endpoint_unavailable", str(exc), {"source": exc.source})
            return reporting.finish(claim, JobStatus.paused, reason=f"reward endpoint unavailable: {exc.reason}")
        except RewardError as exc:
            worker_metrics.reward_error(exc.source, exc.code)
            return self._fail(claim, exc.code, str(exc))
        except (JobFailure, ModelUnavailable) as exc:
            return self._fail(claim, exc.code, exc.message)
        except Exception as exc:
            if self.ranks is not None:
                from worker.grpo.distributed import is_collective_failure

                if is_collective_failure(exc):  # another rank died or hung: not the job's failure
                    raise
            log.exception("job %s: attempt %d crashed", self.job_id, claim.attempt)
            return self._fail(claim, "training_error", training_error_message(exc))
        if heartbeat.lost.is_set():
            raise LeaseLost(claim.job_id, claim.attempt)
        if result.stopped and self._budget_reached is not None:  # the trainer saved a checkpoint
            reached, step = self._budget_reached
            return reporting.pause_for_budget(claim, reached, step)
        if result.unhealthy is not None:  # on_unhealthy: pause (the trainer saved a checkpoint)
            finding = result.unhealthy
            return reporting.finish(
                claim, JobStatus.paused, reason=f"unhealthy at step {finding.step}: {finding.kind}: {finding.message}"
            )
        if not result.stopped:
            return reporting.finish(claim, JobStatus.succeeded, reason=f"trained {result.step} steps")
        control = reporting.read_control(self.job_id)
        if control is None or control.attempt != claim.attempt or control.status not in OWNED_STATES:
            raise LeaseLost(claim.job_id, claim.attempt)
        if control.status == JobStatus.cancelling.value:
            return reporting.finish(claim, JobStatus.cancelled, reason=f"cancelled at step {result.step}")
        return reporting.finish(claim, JobStatus.paused, reason=f"paused at step {result.step}")

    def _fail(self, claim: Claim, code: str, message: str) -> JobStatus:
        log.warning("job %s: failed (%s): %s", self.job_id, code, message)
        return reporting.finish(claim, JobStatus.failed, reason=message, error_code=code, error_message=message)

    # --- training ------------------------------------------------------------------------------

    def _train(self, claim: Claim, heartbeat: Heartbeat, workdir: Path) -> TrainResult:
        context = with_db_retry(lambda: self._load_context(claim))
        if context.spec.hyperparameters.use_vllm:
            from worker.grpo.vllm_rollout import VLLMUnavailable, vllm_installed  # imports torch

            if not vllm_installed():
                raise JobFailure("vllm_unavailable", str(VLLMUnavailable()))
        train_rows = self._load_rows(context.dataset_key, workdir / "train.jsonl")
        eval_rows = None
        if context.eval_dataset_key is not None:
            eval_rows = self._load_rows(context.eval_dataset_key, workdir / "eval.jsonl")
        retain_rows = None
        if context.retain_dataset_key is not None:
            retain_rows = self._load_rows(context.retain_dataset_key, workdir / "retain.jsonl")
        base_model = self._resolve_model(context, "base_model", context.spec.base_model, workdir / "base")
        resume_from = self._prepare_resume(claim, workdir / "resume")
        self._delete_unrecorded_checkpoints(claim)
        reward = self._build_rewards(claim, context, workdir / "reward-models")

        # torch is imported here, in the job's process
        from worker.grpo.load_errors import load_failure_reason
        from worker.grpo.trainer import GRPOTrainer

        device = "cpu" if context.queue.startswith("cpu") else None
        if self.ranks is not None:
            from worker.grpo.distributed import device_for

            device = device_for(self.ranks)
            self._send_inputs(RankInputs(
                context.spec, context.queue, train_rows, eval_rows, retain_rows, base_model, resume_from,
                self._remote_configs, self._model_paths, workdir / "checkpoints",
                workdir, self.ranks.node, tuple(self._fetched),
            ), workdir)
        if self.settings.tensorboard:
            from worker.tensorboard import TensorBoardLog

            self._tensorboard = TensorBoardLog(workdir / "tensorboard", f"attempt-{claim.attempt}")

        def should_stop() -> bool:
            return self._should_stop(claim, heartbeat)

        try:
            trainer = GRPOTrainer(
                context.spec.hyperparameters,
                base_model=base_model,
                train_rows=train_rows,
                eval_rows=eval_rows,
                retain_rows=retain_rows,
                reward=reward,
                output_dir=workdir / "checkpoints",
                model_cache_dir=Path(self.settings.data_dir) / "models",
                resume_from=resume_from,
                on_metrics=lambda step, metrics, samples: self._on_metrics(claim, step, metrics, samples),
                on_checkpoint=lambda step, path, manifest: self._on_checkpoint(claim, step, path, manifest),
                should_stop=should_stop,
                on_health=lambda finding: reporting.record_event(
                    claim, "health", f"{finding.kind}: {finding.message}", finding.as_event_data()
                ),
                device=device,
                checkpoint_metadata={"job_id": self.job_id, "attempt": claim.attempt},
                ranks=self.ranks,
            )
        except Exception as exc:
            # from_pretrained's errors describe the worker's filesystem: the tenant gets a code and the reason's
            # class (unknown architecture, corrupt safetensors, GGUF without gguf), the log the rest.
            log.exception("job %s: loading base_model %r failed", self.job_id, context.spec.base_model)
            raise ModelUnavailable(
                "model_load_failed", "base_model", context.spec.base_model, load_failure_reason(exc, base_model)
            ) from exc
        reporting.set_total_steps(claim, trainer.total_steps)
        self._meter = UsageMeter(
            tenant_id=context.tenant_id,
            num_sources=len(context.spec.rewards),
            max_completion_length=context.spec.hyperparameters.max_completion_length,
            num_iterations=context.spec.hyperparameters.num_iterations,
            parameters=sum(p.numel() for p in trainer.models.policy.parameters()),
            cpu=context.queue.startswith("cpu"),
            devices=context.spec.resources.devices,
        )
        try:
            result = trainer.train()
            self._trained = True
            return result
        finally:
            if self._tensorboard is not None:
                self._tensorboard.close()

    def _load_context(self, claim: Claim) -> JobContext:
        with session_scope() as session:
            job = repository.get_job_any_tenant(session, claim.job_id)
            if job is None:
                raise LeaseLost(claim.job_id, claim.attempt)  # deleted: only a finished job can be
            spec = JobSpec.model_validate(job.spec)
            datasets = repository.live_dataset_keys(session, job.tenant_id, [
                spec.train_dataset, spec.eval_dataset or spec.train_dataset, spec.retain_dataset or spec.train_dataset
            ])
            remote_ids = [rf_id for _, rf_id in reward_function_refs(spec.rewards)]
            functions = repository.live_reward_functions(session, job.tenant_id, remote_ids)
            session.expunge_all()
        if spec.train_dataset not in datasets:
            raise JobFailure("dataset_missing", f"train_dataset {spec.train_dataset!r} no longer exists")
        if spec.eval_dataset is not None and spec.eval_dataset not in datasets:
            raise JobFailure("dataset_missing", f"eval_dataset {spec.eval_dataset!r} no longer exists")
        if spec.retain_dataset is not None and spec.retain_dataset not in datasets:
            raise JobFailure("dataset_missing", f"retain_dataset {spec.retain_dataset!r} no longer exists")
        missing = sorted(set(remote_ids) - set(functions))
        if missing:
            raise JobFailure("reward_function_missing", f"reward function {missing[0]!r} no longer exists")
        return JobContext(
            job_id=job.id, tenant_id=job.tenant_id, queue=job.queue, spec=spec,
            dataset_key=datasets[spec.train_dataset],
            eval_dataset_key=datasets[spec.eval_dataset] if spec.eval_dataset else None,
            retain_dataset_key=datasets[spec.retain_dataset] if spec.retain_dataset else None,
            reward_functions=functions,
        )

    def _load_rows(self, key: str, path: Path) -> list[PromptRow]:
        from worker.grpo.data import DatasetError, load_jsonl

        self._download(key, path)
        try:
            return load_jsonl(path)
        except DatasetError as exc:
            raise JobFailure("dataset_invalid", str(exc)) from exc

    def _download(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.storage.open(key) as source, path.open("wb") as target:
            shutil.copyfileobj(source, target, _CHUNK)

    # --- models and checkpoints ----------------------------------------------------------------

    def _resolve_model(self, context: JobContext, field: str, value: str, directory: Path) -> str:
        """What the engine loads for a model source (worker.model_sources checks it again first):
        `builtin:` and hub ids unchanged, `checkpoint:<id>` a verified local copy, a local path its real path."""
        source = check_source(field, value, ModelSourcePolicy.from_settings(self.settings))
        if source.kind is ModelSourceKind.checkpoint:
            return str(self._fetch_tenant_checkpoint(context, field, source.value, directory / source.value))
        if source.kind is ModelSourceKind.hub:
            check_hub_size(field, value, self.settings.hub_model_max_bytes)
            return value
        return source.value

    def _fetch_tenant_checkpoint(self, context: JobContext, field: str, checkpoint_id: str, directory: Path) -> Path:
        with session_scope() as session:
            checkpoint = checkpoints_repository.get(session, context.tenant_id, checkpoint_id)
            if checkpoint is not None:
                session.expunge(checkpoint)
        if checkpoint is None:
            raise JobFailure("base_checkpoint_invalid", f"{field}: checkpoint {checkpoint_id!r} not found")
        from worker.grpo.checkpoint import CheckpointCorrupt

        try:
            return self._fetch_checkpoint(checkpoint, directory)
        except (OSError, ValueError, CheckpointCorrupt) as exc:
            log.warning("job %s: %s: checkpoint %s unusable: %s", self.job_id, field, checkpoint_id, exc)
            raise JobFailure(
                "base_checkpoint_invalid", f"{field}: checkpoint {checkpoint_id!r}: {checkpoint_problem(exc)}"
            ) from exc

    def _fetch_checkpoint(self, checkpoint: Checkpoint, directory: Path) -> Path:
        """Download every listed file and verify it against the engine's manifest (CheckpointCorrupt)."""
        download_checkpoint_files(self.storage, checkpoint.storage_path, checkpoint.manifest, directory)
        self._fetched.append(FetchedCheckpoint(directory, checkpoint.storage_path, list(checkpoint.manifest)))
        return directory

    def _prepare_resume(self, claim: Claim, root: Path) -> Path | None:
        """The newest checkpoint that verifies; older ones are tried if it does not (and steps rewound)."""
        from worker.grpo.checkpoint import CheckpointCorrupt

        with session_scope() as session:
            checkpoint = latest_checkpoint(session, claim.job_id, before_step=claim.resume_step + 1)
            if checkpoint is not None:
                session.expunge(checkpoint)
        while checkpoint is not None:
            try:
                # Named like the engine's own directories so the trainer knows that step is saved.
                return self._fetch_checkpoint(checkpoint, root / f"checkpoint-{checkpoint.step}")
            except (OSError, ValueError, CheckpointCorrupt) as exc:
                log.warning("job %s: checkpoint %s unusable: %s", claim.job_id, checkpoint.id, exc)
                reporting.record_event(claim, "checkpoint_unusable",
                                       f"checkpoint {checkpoint.id}: {checkpoint_problem(exc)}",
                                       {"checkpoint_id": checkpoint.id, "step": checkpoint.step})
                step = checkpoint.step
                with session_scope() as session:
                    checkpoint = latest_checkpoint(session, claim.job_id, before_step=step)
                    if checkpoint is not None:
                        session.expunge(checkpoint)
                    rewind_to(session, claim, checkpoint)
        return None

    def _delete_unrecorded_checkpoints(self, claim: Claim) -> None:
        """Files of checkpoints an earlier attempt uploaded but that no row records (see retention)."""
        from service.checkpoints.retention import delete_unrecorded

        with session_scope() as session:
            stray = delete_unrecorded(session, self.storage, claim.job_id)
        if stray:
            log.info("job %s: deleted unrecorded checkpoint files %s", claim.job_id, ", ".join(stray))

    def _on_checkpoint(self, claim: Claim, step: int, path: Path, manifest: dict[str, Any]) -> None:
        """Upload the checkpoint's files (manifest last), then record it; nothing is recorded half-uploaded."""
        checkpoint_id = new_checkpoint_id()
        files: dict[str, dict[str, Any]] = {name: dict(meta) for name, meta in manifest["files"].items()}
        try:
            for name in files:
                self._upload(path / name, checkpoint_key(claim.job_id, checkpoint_id, name))
            manifest_path = path / MANIFEST_NAME
            files[MANIFEST_NAME] = {"size": manifest_path.stat().st_size, "sha256": _sha256(manifest_path)}
            self._upload(manifest_path, checkpoint_key(claim.job_id, checkpoint_id, MANIFEST_NAME))
            reporting.record_checkpoint(
                claim, checkpoint_id=checkpoint_id, step=step, files=files, metrics=self._step_metrics.get(step)
            )
        except BaseException:
            self.storage.delete(checkpoint_prefix(claim.job_id, checkpoint_id))
            raise
        if self._tensorboard is not None:
            for relative in self._tensorboard.files():
                self._upload(self._tensorboard.root / relative, tensorboard_key(claim.job_id, relative.as_posix()))

    def _upload(self, path: Path, key: str) -> None:
        with path.open("rb") as handle:
            self.storage.put_stream(key, iter(lambda: handle.read(_CHUNK), b""))

    # --- hooks ---------------------------------------------------------------------------------

    def _on_metrics(self, claim: Claim, step: int, metrics: Mapping[str, float], samples: list[dict[str, Any]]) -> None:
        self._step_metrics = {step: dict(metrics)}
        worker_metrics.observe_step(metrics)
        if self._tensorboard is not None:
            self._tensorboard.write(step, metrics)
        logged = [
            SampleIn(prompt=str(s["prompt"]), completion=str(s["completion"]), reward=_finite_or_none(s.get("reward")),
                     rewards={k: _finite_or_none(v) for k, v in dict(s.get("rewards", {})).items()})
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
        if control.attempt != claim.attempt or control.status not in OWNED_STATES:
            heartbeat.lost.set()
            return True
        return control.status == JobStatus.cancelling.value or control.pause_requested

    # --- rewards -------------------------------------------------------------------------------

    def _endpoint_config(self, context: JobContext, source_name: str, rf_id: str) -> RemoteRewardConfig:
        """The endpoint of a registered reward function, with its secrets, as this worker's policy allows it."""
        from outbound.rewards import RemoteRewardConfig
        from outbound.rewards.errors import RewardEndpointRefused

        row = context.reward_functions[rf_id]
        allow_private = bool(self.settings.allow_private_reward_urls)
        try:
            # E.g. registered in development, run by a worker in production mode.
            check_url_syntax(row.url, allow_private=allow_private)
        except UrlRejected as exc:
            raise RewardEndpointRefused(
                source_name, f"the registered url is refused by this worker's policy: {exc.message}"
            ) from exc
        return RemoteRewardConfig.model_validate({
            "reward_function_id": row.id, "url": row.url, "secret": row.signing_secret,
            # Signs with the replaced secret too while a rotation's overlap lasts (outbound.signing).
            "previous_secret": previous_secret_in_overlap(
                row.previous_signing_secret, row.previous_secret_expires_at, utcnow()
            ),
            "previous_secret_until": row.previous_secret_expires_at,
            "job_id": context.job_id, "timeout_s": row.timeout_s, "max_batch_size": row.max_batch_size,
            "max_concurrency": row.max_concurrency, "headers": {str(k): str(v) for k, v in row.headers.items()},
            "allow_private": allow_private,
            "max_attempts": row.max_attempts, "backoff_base_s": row.backoff_s,
            "breaker_threshold": row.breaker_threshold, "step_deadline_s": row.step_deadline_s,
            "max_abstain_fraction": row.max_abstain_fraction,
        })

    def _build_rewards(self, claim: Claim, context: JobContext, models_dir: Path) -> CompositeReward:
        """The job's reward sources (and, for the other ranks of a multi-device job, what they need to build
        the same: endpoint configurations and local reward-model paths)."""
        from contract.graders import ScoreModelGrader
        from outbound.rewards import build_remote_source
        from outbound.rewards.chat import ChatScoreSource
        from outbound.rewards.source import EndpointRewardSource
        from worker.grpo.rewards import build_reward_sources

        async def on_retry(event: RetryEvent) -> None:
            import asyncio

            worker_metrics.reward_retry(event.source, event.reason)
            message = f"{event.source}: attempt {event.attempt} failed ({event.reason}); retrying in {event.wait_s:.2f}s"
            data = {"source": event.source, "attempt": event.attempt, "reason": event.reason,
                    "wait_s": event.wait_s, "message_id": event.message_id, "batch_size": event.batch_size}
            try:
                await asyncio.to_thread(reporting.record_event, claim, "reward_retry", message, data)
            except LeaseLost:
                log.info("job %s: retry event refused (lease lost)", claim.job_id)

        async def on_degraded(event: DegradedEvent) -> None:
            import asyncio

            message = (f"{event.source}: {event.abstained} of {event.items} completions abstain at step {event.step} "
                       f"(no answer within the step deadline: {event.reason})")
            data = {"source": event.source, "step": event.step, "abstained": event.abstained,
                    "items": event.items, "reason": event.reason}
            try:
                await asyncio.to_thread(reporting.record_event, claim, "reward_degraded", message, data)
            except LeaseLost:
                log.info("job %s: degraded event refused (lease lost)", claim.job_id)

        def endpoint_config(source_name: str, rf_id: str) -> RemoteRewardConfig:
            config = self._remote_configs[rf_id] = self._endpoint_config(context, source_name, rf_id)
            return config

        def remote(spec: RemoteRewardSpec) -> EndpointRewardSource[Any]:
            config = endpoint_config(spec.source_name, spec.reward_function_id)
            # gRPC for grpc(s):// URLs, else HTTP
            return build_remote_source(config, on_retry=on_retry, on_degraded=on_degraded)

        def chat(grader: ScoreModelGrader) -> ChatScoreSource:
            name = f"score_model:{grader.name}"
            config = endpoint_config(name, grader.reward_function_id)
            return ChatScoreSource(name, grader, config, on_retry=on_retry, on_degraded=on_degraded)

        model_paths: dict[str, str] = {}
        for i, spec in enumerate(context.spec.rewards):
            if isinstance(spec, ModelRewardSpec):
                path = self._resolve_model(context, f"rewards[{i}].model", spec.model, models_dir)
                if path.startswith(BUILTIN_PREFIX):
                    from worker.grpo.tiny import resolve_model_path

                    path = resolve_model_path(path, Path(self.settings.data_dir) / "models")
                model_paths[spec.model] = path
        self._model_paths = model_paths
        device = "cpu" if context.queue.startswith("cpu") else _default_device()
        return build_reward_sources(
            context.spec.rewards, remote=remote, device=device, model_paths=model_paths, chat=chat,
            grader_limits=self.settings.grader_limits(),
        )


class UsageMeter:
    """Turns the engine's per-step usage metrics into a usage record, timing the device between reports:
    a step's device-seconds run from the end of the previous step's report (or the start of training in this
    attempt) to the end of this one's, so evaluation and checkpoint uploads are counted once, in the step
    that follows them. A GPU job counts wall-clock seconds (the GPU is held throughout); a CPU job counts the
    CPU-seconds its process used (cores shared with other work are not billed for the waits). A job on N devices
    holds all of them for the step: N times rank 0's seconds (its ranks run in lockstep)."""

    def __init__(
        self,
        *,
        tenant_id: str,
        num_sources: int,
        max_completion_length: int,
        num_iterations: int,
        parameters: int,
        cpu: bool,
        devices: int = 1,
    ) -> None:
        self.tenant_id = tenant_id
        self.num_sources = max(num_sources, 1)
        self.max_completion_length = max_completion_length
        self.num_iterations = num_iterations
        self.parameters = parameters
        self.devices = devices
        self._clock = time.process_time if cpu else time.monotonic
        self._since = self._clock()

    def take(self, metrics: Mapping[str, float]) -> StepUsageIn | None:
        """The usage of a training step's metrics; None for reports without usage (the step-0 evaluation)."""
        if "usage/tokens_generated" not in metrics:
            return None
        now = self._clock()
        seconds, self._since = now - self._since, now
        reward_calls = int(metrics["usage/reward_calls"])
        completions = reward_calls // self.num_sources
        return StepUsageIn(
            tokens_generated=int(metrics["usage/tokens_generated"]),
            tokens_trained=int(metrics["usage/tokens_trained"]),
            reward_calls=reward_calls,
            device_seconds=seconds * self.devices,
            completions=completions,
            completion_capacity=completions * self.max_completion_length,
            num_iterations=self.num_iterations,
            parameters=self.parameters,
        )


def training_error_message(exc: Exception) -> str:
    """The tenant's view of an unexpected failure: type and message, except for filesystem errors, whose
    text names the worker's paths (the log has it)."""
    if isinstance(exc, OSError):
        return f"{type(exc).__name__} (details in the worker's log)"
    return f"{type(exc).__name__}: {exc}"


def checkpoint_problem(exc: Exception) -> str:
    """What a tenant may read about a checkpoint that failed to download or verify: the manifest's finding
    (file names relative to the checkpoint), never an exception text naming the worker's or storage's paths."""
    from worker.grpo.checkpoint import CheckpointCorrupt

    if isinstance(exc, CheckpointCorrupt):
        return f"corrupt: {exc.problem}"
    return "could not be downloaded"


def stop_process(process: subprocess.Popen[bytes], *, grace_s: float) -> None:
    """Let `process` exit by itself for `grace_s`, then terminate it, then kill it."""
    for stop in (None, process.terminate, process.kill):
        if stop is not None:
            stop()
        try:
            process.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _finite_or_none(value: Any) -> float | None:
    import math

    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
