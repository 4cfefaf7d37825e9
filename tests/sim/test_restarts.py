"""The restart policy of ``fleet-sim up``, with the clock given."""

from __future__ import annotations

import pytest

from fleet_sim.restarts import GiveUp, History, Restart, RestartPolicy, after_exit

POLICY = RestartPolicy()


def test_the_delay_doubles_up_to_the_cap_and_resets_after_a_healthy_minute() -> None:
    history = History(started_at=0.0)
    delays = []
    now = 0.0
    for _ in range(6):
        now += 20.0  # up 20 s each time: not a failed start, not yet healthy
        decision = after_exit(POLICY, history, now)
        assert isinstance(decision, Restart) and not decision.failed_start
        delays.append(decision.delay_s)
        history.started_at = now + decision.delay_s
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    decision = after_exit(POLICY, history, history.started_at + 61.0)
    assert decision == Restart(0.5, failed_start=False)


def test_five_failed_starts_in_a_minute_give_up() -> None:
    history = History(started_at=0.0)
    now = 0.0
    for n in range(4):
        now += 1.0
        decision = after_exit(POLICY, history, now)
        assert isinstance(decision, Restart) and decision.failed_start, n
        history.started_at = now
    decision = after_exit(POLICY, history, now + 1.0)
    assert decision == GiveUp("5 failed starts in 60 s")


def test_failed_starts_outside_the_window_are_forgotten() -> None:
    history = History(started_at=0.0)
    for now in (1.0, 2.0, 3.0, 4.0, 100.0, 101.0):
        history.started_at = now - 1.0  # each start fails a second after it is made
        decision = after_exit(POLICY, history, now)
        assert isinstance(decision, Restart) and decision.failed_start
    assert history.failed_starts == [100.0, 101.0]


@pytest.mark.parametrize(
    "bad", [{"first_delay_s": 0.0}, {"first_delay_s": 5.0}, {"max_failed_starts": 0}]
)
def test_a_policy_that_cannot_work_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**bad)  # type: ignore[arg-type]
