"""The job state machine table (pure logic)."""

from __future__ import annotations

import pytest

from service.jobs.states import TERMINAL, TRANSITIONS, UNFINISHED, WORKER_OWNED, JobStatus, can_transition

S = JobStatus


class TestTransitionTable:
    def test_every_state_has_a_row_and_terminal_states_are_final(self) -> None:
        assert set(TRANSITIONS) == set(JobStatus)
        assert TERMINAL == {S.succeeded, S.failed, S.cancelled}
        assert UNFINISHED == set(JobStatus) - TERMINAL
        assert WORKER_OWNED == {S.running, S.cancelling}

    @pytest.mark.parametrize(
        ("current", "target"),
        [
            (S.queued, S.running),
            (S.queued, S.cancelled),
            (S.queued, S.paused),
            (S.running, S.cancelling),
            (S.running, S.paused),
            (S.running, S.succeeded),
            (S.running, S.failed),
            (S.running, S.queued),
            (S.cancelling, S.cancelled),
            (S.cancelling, S.failed),
            (S.paused, S.queued),
            (S.paused, S.cancelled),
        ],
    )
    def test_allowed(self, current: JobStatus, target: JobStatus) -> None:
        assert can_transition(current, target)

    @pytest.mark.parametrize(
        ("current", "target"),
        [
            (S.queued, S.succeeded),
            (S.queued, S.cancelling),
            (S.paused, S.running),
            (S.cancelling, S.running),
            (S.cancelling, S.succeeded),
            (S.succeeded, S.queued),
            (S.failed, S.queued),
            (S.cancelled, S.queued),
            (S.running, S.running),
        ],
    )
    def test_refused(self, current: JobStatus, target: JobStatus) -> None:
        assert not can_transition(current, target)
