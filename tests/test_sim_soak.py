"""The soak's pure parts: how fault kinds are dealt and how takeover times are read from a
journal (the soak itself runs in tests/test_simulator_matrix.py)."""

from __future__ import annotations

import random
from collections import Counter

from fleet_sim.sim.journal import Op
from fleet_sim.sim.soak import fault_kinds, takeover_figures


def test_every_deck_holds_each_kind_in_proportion() -> None:
    rng = random.Random(5)
    dealt = Counter(k for _ in range(50) for k in fault_kinds(rng, partitions=True))
    assert dealt == {"deploy": 100, "kill": 50, "partition": 50}
    assert Counter(fault_kinds(rng, partitions=False)) == {"deploy": 2, "kill": 1}


def test_decks_are_shuffled() -> None:
    rng = random.Random(1)
    orders = {tuple(fault_kinds(rng, partitions=True)) for _ in range(40)}
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
