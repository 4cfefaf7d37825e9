"""A soak: many sessions under a steady workload for a long time, with rolling deploys, hard
kills and (on leasefs) storage partitions interleaved, graded like any scenario.

Faults come every ``fault_every_s`` (jittered by a third either way) on a random replica; their
kinds are dealt from a shuffled deck (two deploys, one kill and, on leasefs, one partition per
deck), so a long run is sure to see each kind in proportion rather than by luck of the draw.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Sequence

from fleet_sim.sim import checkers
from fleet_sim.sim.checkers import ClaimResult, verdict
from fleet_sim.sim.journal import Op
from fleet_sim.sim.scenario import Context
from fleet_sim.sim.substrates import LeaseFs
from fleet_sim.sim.workload import Session, drive

KIND_LABEL = {"deploy": "graceful", "kill": "hard_kill", "partition": "partition"}


def fault_kinds(rng: random.Random, partitions: bool) -> list[str]:
    """One deck of fault kinds, shuffled."""
    deck = ["deploy", "deploy", "kill"] + (["partition"] if partitions else [])
    rng.shuffle(deck)
    return deck


def takeover_figures(
    ops: Sequence[Op], events: Sequence[dict[str, object]], owned: dict[str, list[str]]
) -> dict[str, float]:
    """Per fault kind, how long the victim's sessions waited: from the fault to each one's
    first acknowledged turn after it (median and maximum over all such sessions)."""
    by_session: dict[str, list[Op]] = {}
    for op in ops:  # grouped once: a long soak has many operations and many faults
        by_session.setdefault(op.session_id, []).append(op)
    figures: dict[str, float] = {}
    for kind, label in KIND_LABEL.items():
        samples: list[float] = []
        for event in events:
            if event["kind"] == kind:
                victims = owned.get(str(event["replica"]), [])
                theirs = [op for sid in victims for op in by_session.get(sid, ())]
                samples += checkers.takeover_times(theirs, float(event["at"]), victims)  # type: ignore[arg-type]
        if samples:
            figures[f"takeover_{label}_median_s"] = round(statistics.median(samples), 3)
            figures[f"takeover_{label}_max_s"] = round(max(samples), 3)
    return figures


def soak(
    ctx: Context, *, duration_s: float, sessions: int, fault_every_s: float | None = None
) -> list[ClaimResult]:
    rng = random.Random(ctx.seed)
    pool = ctx.sessions(max(1, sessions // 2), slice_name="a07") + ctx.sessions(
        max(1, sessions - sessions // 2), slice_name="a08"
    )
    every = fault_every_s if fault_every_s is not None else duration_s / 8
    until = time.time() + duration_s
    events: list[dict[str, object]] = []
    stop = threading.Event()
    partitions = isinstance(ctx.substrate, LeaseFs)

    def chaos() -> None:
        deck: list[str] = []
        while not stop.wait(rng.uniform(every * 2 / 3, every * 4 / 3)):
            if time.time() > until - 5:
                return
            deck = deck or fault_kinds(rng, partitions)
            kind = deck.pop()
            slice_name = rng.choice(["a07", "a08"])
            victim = rng.choice(ctx.members(slice_name))
            at = time.time()
            if kind == "deploy":
                ctx.faults.drain(victim)
            elif kind == "kill":
                ctx.faults.kill(victim)
            else:
                ctx.substrate.partition(victim)
                time.sleep(ctx.substrate.lease_s * 1.5)  # type: ignore[attr-defined]
                ctx.substrate.heal(victim)
                ctx.faults.kill(victim)  # a healed owner restarts cleanly
            ctx.faults.restart(victim)
            ctx.faults.wait_ready(victim)
            events.append(
                {
                    "kind": kind,
                    "replica": victim,
                    "at": at,
                    "back_after_s": round(time.time() - at, 2),
                }
            )

    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    try:
        ctx.run(
            drive(
                ctx.edge,
                pool,
                ctx.journal,
                until=until,
                max_ops=10_000_000,
                seed=ctx.seed,
                fresh_grant=ctx.fresh_grant,
                grant_refresh_s=ctx.fleet.grant_ttl_s / 2,
            )
        )
    finally:
        stop.set()
        thread.join(timeout=300)
    claims = ctx.standard_claims(pool)
    ops = ctx.ops()
    prompts = [op for op in ops if op.op == "prompt"]
    figures = {
        "turns_ok": sum(1 for op in prompts if op.outcome == "ok"),
        "turns_unknown": sum(1 for op in prompts if op.outcome == "unknown"),
        "turns_failed": sum(1 for op in prompts if op.outcome == "fail"),
        "sessions": len(pool),
        "deploys": sum(1 for e in events if e["kind"] == "deploy"),
        "kills": sum(1 for e in events if e["kind"] == "kill"),
        "partitions": sum(1 for e in events if e["kind"] == "partition"),
        **checkers.latency_figures([op.seconds for op in prompts if op.outcome == "ok"], "turn"),
        **takeover_figures(prompts, events, _owned(ctx, pool)),
    }
    ctx.notes["faults"] = events
    return [*claims, verdict("soak-completes", [], figures)]


def _owned(ctx: Context, pool: Sequence[Session]) -> dict[str, list[str]]:
    """Replica name -> the pool's sessions it owns on the full ring."""
    owned: dict[str, list[str]] = {}
    for session in pool:
        owned.setdefault(ctx.owner(session.session_id), []).append(session.session_id)
    return owned
