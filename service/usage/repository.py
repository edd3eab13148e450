"""All SQL of the usage domain."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, delete, func, literal, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.kit.db import utcnow
from service.usage.models import JobUsage, PrimitiveUsage, TenantBudget, UsageCalibration


@dataclass(frozen=True)
class Sums:
    steps: int = 0  # a job's steps; a primitive API call counts as one
    tokens_generated: int = 0
    tokens_trained: int = 0
    reward_calls: int = 0
    device_seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return self.tokens_generated + self.tokens_trained

    def __add__(self, other: Sums) -> Sums:
        return Sums(self.steps + other.steps, self.tokens_generated + other.tokens_generated,
                    self.tokens_trained + other.tokens_trained, self.reward_calls + other.reward_calls,
                    self.device_seconds + other.device_seconds)


_SUMS = (
    func.count(JobUsage.id),
    func.coalesce(func.sum(JobUsage.tokens_generated), 0),
    func.coalesce(func.sum(JobUsage.tokens_trained), 0),
    func.coalesce(func.sum(JobUsage.reward_calls), 0),
    func.coalesce(func.sum(JobUsage.device_seconds), 0.0),
)


_PRIMITIVE_SUMS = (
    func.count(PrimitiveUsage.id),
    func.coalesce(func.sum(PrimitiveUsage.tokens_generated), 0),
    func.coalesce(func.sum(PrimitiveUsage.tokens_trained), 0),
    literal(0),
    func.coalesce(func.sum(PrimitiveUsage.device_seconds), 0.0),
)


def _sums(row: Any) -> Sums:
    return Sums(int(row[0]), int(row[1]), int(row[2]), int(row[3]), float(row[4]))


def replace_step(
    session: Session,
    *,
    job_id: str,
    tenant_id: str,
    step: int,
    attempt: int,
    tokens_generated: int,
    tokens_trained: int,
    reward_calls: int,
    device_seconds: float,
) -> None:
    """A step's record; a step recorded again (a retried write, a re-run step) replaces the earlier one."""
    session.execute(delete(JobUsage).where(JobUsage.job_id == job_id, JobUsage.step == step))
    session.add(JobUsage(
        job_id=job_id, tenant_id=tenant_id, step=step, attempt=attempt, tokens_generated=tokens_generated,
        tokens_trained=tokens_trained, reward_calls=reward_calls, device_seconds=device_seconds,
        recorded_at=utcnow(),
    ))
    session.flush()


def delete_steps_after(session: Session, job_id: str, step: int) -> None:
    """Forget the records of steps after `step` (a resumed job re-runs them)."""
    session.execute(delete(JobUsage).where(JobUsage.job_id == job_id, JobUsage.step > step))


def job_sums(session: Session, job_id: str) -> Sums:
    return _sums(session.execute(select(*_SUMS).where(JobUsage.job_id == job_id)).one())


def tenant_sums(session: Session, tenant_id: str, start: datetime, end: datetime) -> Sums:
    """Jobs' steps and primitive API calls of the tenant in [start, end)."""
    jobs = _sums(session.execute(select(*_SUMS).where(
        JobUsage.tenant_id == tenant_id, JobUsage.recorded_at >= start, JobUsage.recorded_at < end
    )).one())
    calls = _sums(session.execute(select(*_PRIMITIVE_SUMS).where(
        PrimitiveUsage.tenant_id == tenant_id, PrimitiveUsage.recorded_at >= start, PrimitiveUsage.recorded_at < end
    )).one())
    return jobs + calls


def _day(session: Session, recorded_at: Any) -> ColumnElement[Any]:
    """The UTC day of recorded_at as YYYY-MM-DD (SQLite stores the UTC time as text)."""
    if session.get_bind().dialect.name == "postgresql":
        return func.to_char(func.timezone("UTC", recorded_at), "YYYY-MM-DD")
    return func.substr(recorded_at, 1, 10)


def grouped_sums(
    session: Session, tenant_id: str, start: datetime, end: datetime, group_by: str
) -> list[tuple[str, Sums]]:
    """Sums by UTC day, or by job (a primitive API training client or sampler is a group of its own)."""
    key = _day(session, JobUsage.recorded_at) if group_by == "day" else JobUsage.job_id
    call_key = _day(session, PrimitiveUsage.recorded_at) if group_by == "day" else PrimitiveUsage.target_id
    groups: dict[str, Sums] = {}
    for selected, sums, table in ((key, _SUMS, JobUsage), (call_key, _PRIMITIVE_SUMS, PrimitiveUsage)):
        rows = session.execute(
            select(selected, *sums)
            .where(table.tenant_id == tenant_id, table.recorded_at >= start, table.recorded_at < end)
            .group_by(selected)
        ).all()
        for row in rows:
            groups[str(row[0])] = groups.get(str(row[0]), Sums()) + _sums(row[1:])
    return sorted(groups.items())


def record_call(session: Session, row: PrimitiveUsage) -> None:
    session.add(row)


def job_steps(session: Session, job_id: str) -> Sequence[JobUsage]:
    return session.scalars(select(JobUsage).where(JobUsage.job_id == job_id).order_by(JobUsage.step)).all()


# --- calibration ---------------------------------------------------------------------------------------


def add_calibration(
    session: Session,
    *,
    base_model: str,
    bucket: str,
    parameters: int,
    completions: int,
    completion_capacity: int,
    tokens_generated: int,
    tokens_trained: int,
    tokens_trained_per_pass: int,
    device_seconds: float,
) -> None:
    """Add one step's measurements to its model's sums (one statement: concurrent workers never collide)."""
    values = {
        "base_model": base_model, "bucket": bucket, "parameters": parameters, "steps": 1,
        "completions": completions, "completion_capacity": completion_capacity,
        "tokens_generated": tokens_generated, "tokens_trained": tokens_trained,
        "tokens_trained_per_pass": tokens_trained_per_pass, "device_seconds": device_seconds, "updated_at": utcnow(),
    }
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    stmt = insert(UsageCalibration).values(**values)
    table = UsageCalibration.__table__.c
    summed = ("steps", "completions", "completion_capacity", "tokens_generated", "tokens_trained",
              "tokens_trained_per_pass", "device_seconds")
    stmt = stmt.on_conflict_do_update(
        index_elements=[table.base_model],
        set_={
            **{name: table[name] + stmt.excluded[name] for name in summed},
            "bucket": stmt.excluded.bucket, "parameters": stmt.excluded.parameters,
            "updated_at": stmt.excluded.updated_at,
        },
    )
    session.execute(stmt)


def calibration_for_model(session: Session, base_model: str) -> UsageCalibration | None:
    return session.get(UsageCalibration, base_model)


def calibration_for_bucket(session: Session, bucket: str) -> UsageCalibration | None:
    """The sums over every model of the bucket, as one unsaved row (None when none was measured)."""
    row = session.execute(
        select(
            func.coalesce(func.sum(UsageCalibration.steps), 0),
            func.coalesce(func.sum(UsageCalibration.completions), 0),
            func.coalesce(func.sum(UsageCalibration.completion_capacity), 0),
            func.coalesce(func.sum(UsageCalibration.tokens_generated), 0),
            func.coalesce(func.sum(UsageCalibration.tokens_trained), 0),
            func.coalesce(func.sum(UsageCalibration.tokens_trained_per_pass), 0),
            func.coalesce(func.sum(UsageCalibration.device_seconds), 0.0),
        ).where(UsageCalibration.bucket == bucket)
    ).one()
    if not row[0]:
        return None
    return UsageCalibration(
        base_model="", bucket=bucket, parameters=0, steps=int(row[0]), completions=int(row[1]),
        completion_capacity=int(row[2]), tokens_generated=int(row[3]), tokens_trained=int(row[4]),
        tokens_trained_per_pass=int(row[5]), device_seconds=float(row[6]),
    )


# --- tenant caps ---------------------------------------------------------------------------------------


def tenant_budget(session: Session, tenant_id: str) -> TenantBudget | None:
    return session.get(TenantBudget, tenant_id)


def set_tenant_budget(
    session: Session, tenant_id: str, *, monthly_max_device_seconds: float | None, monthly_max_tokens: int | None
) -> TenantBudget:
    row = session.get(TenantBudget, tenant_id)
    if row is None:
        row = TenantBudget(tenant_id=tenant_id)
        session.add(row)
    row.monthly_max_device_seconds = monthly_max_device_seconds
    row.monthly_max_tokens = monthly_max_tokens
    row.updated_at = utcnow()
    session.flush()
    return row
