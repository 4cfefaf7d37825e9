"""Pure claim checkers graded from journals (the scenarios that feed them run in
tests/sim/test_simulator_matrix.py)."""

from __future__ import annotations

from fleet_sim.sim.checkers import paused_owner_stalls_only_its_own
from fleet_sim.sim.journal import Op


def turn(sid: str, started: float, ended: float, outcome: str = "ok") -> Op:
    return Op(sid, "prompt", "op-x", started, ended, outcome)  # type: ignore[arg-type]


def test_other_sessions_served_during_a_pause_and_held_ones_waiting_pass() -> None:
    ops = [
        turn("other", 10.5, 10.7),
        turn("other", 11.0, 11.2),
        turn("held", 10.2, 14.3),  # held over the pause, then answered
        turn("other", 13.5, 14.5),  # begun in the second half: may wait, not graded
    ]
    claim = paused_owner_stalls_only_its_own(ops, 10.0, 14.0, {"held"})
    assert claim.verdict == "pass", claim.errors
    assert claim.figures["other_turns_during_pause"] == 2
    assert claim.figures["own_turns_held_over"] == 1
    assert claim.figures["own_turn_max_s"] == 4.1


def test_another_session_stalled_by_the_pause_fails() -> None:
    ops = [turn("other", 10.5, 14.2), turn("held", 10.2, 14.3)]
    claim = paused_owner_stalls_only_its_own(ops, 10.0, 14.0, {"held"})
    assert claim.verdict == "fail"
    assert "waited for the resume" in claim.errors[0]


def test_a_held_turn_lost_over_the_pause_fails_and_an_idle_run_proves_nothing() -> None:
    lost = [turn("other", 10.5, 10.7), turn("held", 10.2, 14.3, "unknown")]
    assert paused_owner_stalls_only_its_own(lost, 10.0, 14.0, {"held"}).verdict == "fail"
    idle = paused_owner_stalls_only_its_own([turn("held", 10.2, 14.3)], 10.0, 14.0, {"held"})
    assert idle.verdict == "fail"
    assert "no session of another replica" in idle.errors[0]
