"""The soak's pure parts: how fault kinds are dealt and how takeover times are read from a
journal; and a short soak on juicefs (the one on leasefs runs in
tests/sim/test_simulator_matrix.py)."""

from __future__ import annotations

import random
from collections import Counter

from fleet_sim.sim.journal import Op
from fleet_sim.sim.soak import DECKS, fault_kinds, takeover_figures


def test_every_deck_holds_each_kind_in_proportion() -> None:
    rng = random.Random(5)
    dealt = Counter(k for _ in range(50) for k in fault_kinds(rng, DECKS["leasefs"]))
    assert dealt == {"deploy": 100, "kill": 50, "partition": 50}
    assert Counter(fault_kinds(rng, DECKS["local-dir"])) == {"deploy": 2, "kill": 1}
    assert Counter(fault_kinds(rng, DECKS["juicefs"])) == {
        "deploy": 2,
        "kill": 1,
        "partition": 1,
        "freeze": 1,
        "metadata-restart": 1,
    }


def test_decks_are_shuffled() -> None:
    rng = random.Random(1)
    orders = {tuple(fault_kinds(rng, DECKS["leasefs"])) for _ in range(40)}
    assert len(orders) > 3


def _op(sid: str, started: float, ended: float, outcome: str = "ok") -> Op:
    return Op(sid, "prompt", "op-x", started, ended, outcome)  # type: ignore[arg-type]


def test_takeover_is_read_per_kind_from_the_victims_sessions_only() -> None:
    ops = [
        _op("s1", 9.0, 10.5),  # ended after the kill at 10.0, but began before: still counts
        _op("s2", 10.0, 14.0, "fail"),
        _op("s2", 14.0, 16.0),
        _op("s3", 10.0, 10.1),  # not the victim's
        _op("s1", 30.0, 30.2),
    ]
    events: list[dict[str, object]] = [
        {"kind": "kill", "replica": "r1", "at": 10.0},
        {"kind": "deploy", "replica": "r1", "at": 30.0},
    ]
    figures = takeover_figures(ops, events, {"r1": ["s1", "s2"], "r2": ["s3"]})
    assert figures["takeover_hard_kill_median_s"] == 3.25  # 0.5 and 6.0
    assert figures["takeover_hard_kill_max_s"] == 6.0
    assert figures["takeover_graceful_max_s"] == 0.2
    assert "takeover_partition_median_s" not in figures


def test_a_metadata_restart_waits_on_every_session_and_a_freeze_on_turns_begun_after_it() -> None:
    ops = [
        _op("s1", 9.0, 12.0),  # done before the freeze at 10.0, its close waited on the owner
        _op("s1", 12.0, 21.0),
        _op("s3", 40.5, 41.0),
        _op("s1", 40.2, 40.4),
    ]
    events: list[dict[str, object]] = [
        {"kind": "freeze", "replica": "r1", "at": 10.0},
        {"kind": "metadata-restart", "replica": None, "at": 40.0},
    ]
    figures = takeover_figures(ops, events, {"r1": ["s1"], "r2": ["s3"]})
    assert figures["takeover_host_freeze_max_s"] == 11.0
    assert figures["takeover_metadata_restart_median_s"] == 0.7  # 0.4 and 1.0
    assert figures["takeover_metadata_restart_max_s"] == 1.0
