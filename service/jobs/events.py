"""The types of job events (the `job_events.type` column) that more than one module names.

The one place they are spelled: the jobs domain writes them (states, progress), the worker writes health and
budget events through it, and readers match on them (the webhook outbox, gRPC WatchJob). Other types (logs,
`pause_requested`, reward warnings...) are named only where they are written.
"""

from __future__ import annotations

from service.usage.budget import BUDGET_EXHAUSTED

STATUS_EVENT = "status"  # every transition (service.jobs.states.transition)
METRICS_EVENT = "metrics"  # a step's metrics (service.jobs.progress.record_metrics)
SAMPLES_EVENT = "samples"  # a step's logged samples with their episodes, multi-turn jobs (service.jobs.progress)
CHECKPOINT_EVENT = "checkpoint"  # a registered checkpoint (service.jobs.progress.record_checkpoint)
HEALTH_EVENT = "health"  # a training-health finding (worker.grpo.health, written by the worker)
# A budget paused the job (service.jobs.service.pause_if_exhausted, service.execution.reporting); also the error code, so
# spelled by service.usage.budget.
BUDGET_EXHAUSTED_EVENT = BUDGET_EXHAUSTED
EVAL_PREFIX = "eval/"  # metric names of evaluations: a metrics event carrying one is an evaluation
# The results of an evaluation of one of the job's checkpoints (service.evaluations.scheduled writes it; the
# job's plot draws it).
CHECKPOINT_EVALUATED_EVENT = "checkpoint_evaluated"
