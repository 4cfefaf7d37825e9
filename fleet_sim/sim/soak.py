"""A soak: many sessions under a steady workload for a long time, with rolling deploys, hard
kills and storage faults interleaved, graded like any scenario.

Faults come every ``fault_every_s`` (jittered by a third either way) on a random replica; their
kinds are dealt from a shuffled deck (:data:`DECKS`: two deploys and one kill per deck
everywhere; on leasefs one partition; on juicefs one partition of a host from its metadata
engine, one host freeze and one restart of the engine itself), so a long run is sure to see each
kind in proportion rather than by luck of the draw.

A partitioned or frozen host is restarted before it serves again, as an orchestrator would a
replica that lost its storage session: once healed or thawed it would still answer the sessions
it held from memory (see ``faults.frozen_host``). On juicefs the clients ping their connections,
so that one whose owner froze gives it up and reconnects (through the edge, which no longer
routes there) rather than wait for the thaw.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Sequence

from fleet_sim.juicefs import JuiceFs
from fleet_sim.sim import checkers
from fleet_sim.sim.checkers import ClaimResult, verdict
from fleet_sim.sim.faults import Rotation, frozen_host, storage_expiry_s
from fleet_sim.sim.journal import Op
from fleet_sim.sim.scenario import Context
from fleet_sim.sim.workload import Session, drive

DECKS: dict[str, tuple[str, ...]] = {
    "local-dir": ("deploy", "deploy", "kill"),
    "leasefs": ("deploy", "deploy", "kill", "partition"),
    "juicefs": ("deploy", "deploy", "kill", "partition", "freeze", "metadata-restart"),
}
KIND_LABEL = {
    "deploy": "graceful",
    "kill": "hard_kill",
    "partition": "partition",
    "freeze": "host_freeze",
    "metadata-restart": "metadata_restart",
}
COUNT_LABEL = {
    "deploy": "deploys",
    "kill": "kills",
    "partition": "partitions",
    "freeze": "freezes",
    "metadata-restart": "metadata_restarts",
}
# Pings of the clients when hosts can freeze: wide enough for a loaded box's replica to answer
# in time, narrow enough that a client gives up on a frozen owner well before its lease lapses.
KEEPALIVE_S = 5.0


def fault_kinds(rng: random.Random, deck: Sequence[str]) -> list[str]:
    """One deck of fault kinds, shuffled."""
    dealt = list(deck)
    rng.shuffle(dealt)
    return dealt


def takeover_figures(
    ops: Sequence[Op], events: Sequence[dict[str, object]], owned: dict[str, list[str]]
) -> dict[str, float]:
    """Per fault kind, how long the victims' sessions waited: from the fault to each one's
    first acknowledged turn after it (median and maximum over all such sessions). A fault of no
    replica (a metadata restart) has every session for a victim."""
    by_session: dict[str, list[Op]] = {}
    for op in ops:  # grouped once: a long soak has many operations and many faults
        by_session.setdefault(op.session_id, []).append(op)
    everyone = [sid for sids in owned.values() for sid in sids]
    figures: dict[str, float] = {}
    for kind, label in KIND_LABEL.items():
        samples: list[float] = []
        for event in events:
            if event["kind"] == kind:
                replica = event.get("replica")
                victims = everyone if replica is None else owned.get(str(replica), [])
                theirs = [op for sid in victims for op in by_session.get(sid, ())]
                samples += checkers.takeover_times(
                    theirs,
                    float(event["at"]),  # type: ignore[arg-type]
                    victims,
                    began_after=kind == "freeze",
                )
        if samples:
            figures[f"takeover_{label}_median_s"] = round(statistics.median(samples), 3)
            figures[f"takeover_{label}_max_s"] = round(max(samples), 3)
    return figures


class _Chaos:
    """The fault thread: deals kinds, picks victims, injects, records each event."""

    def __init__(self, ctx: Context, rng: random.Random, deck: Sequence[str]) -> None:
        self.ctx = ctx
        self.rng = rng
        self.deck = deck
        self.expiry = storage_expiry_s(ctx.substrate)
        self.rotation = Rotation(ctx.local) if "freeze" in deck else None
        self.events: list[dict[str, object]] = []

    def span_s(self, kind: str) -> float:
        """About how long a fault of ``kind`` keeps its victim away: none is begun that would
        not be over before the workload ends."""
        if kind == "partition":
            return self.expiry * 1.5 + 5
        if kind == "freeze":
            return self.expiry * 1.5 + 20
        return 5.0

    def run(self, every: float, until: float, stop: threading.Event) -> None:
        dealt: list[str] = []
        while not stop.wait(self.rng.uniform(every * 2 / 3, every * 4 / 3)):
            dealt = dealt or fault_kinds(self.rng, self.deck)
            kind = dealt.pop()
            if time.time() + self.span_s(kind) > until:
                return
            self.inject(kind)

    def inject(self, kind: str) -> None:
        ctx = self.ctx
        at = time.time()
        event: dict[str, object] = {"kind": kind, "replica": None, "at": at}
        if kind == "metadata-restart":
            substrate = ctx.substrate
            assert isinstance(substrate, JuiceFs)
            substrate.restart_metadata()
        else:
            victim = self.rng.choice(ctx.members(self.rng.choice(["a07", "a08"])))
            event["replica"] = victim
            if kind == "deploy":
                ctx.faults.drain(victim)
            elif kind == "kill":
                ctx.faults.kill(victim)
            elif kind == "partition":
                ctx.substrate.partition(victim)
                time.sleep(self.expiry * 1.5)
                ctx.substrate.heal(victim)
                ctx.faults.kill(victim)  # a healed owner restarts cleanly
            else:
                assert self.rotation is not None
                marks = frozen_host(
                    ctx.faults,
                    ctx.substrate,
                    self.rotation,
                    victim,
                    lambda frozen: time.sleep(
                        max(0.0, frozen + self.expiry * 1.5 + 3 - time.time())
                    ),
                )
                event.update({k: v for k, v in marks.items() if k != "frozen_at"})
                event["at"] = marks["frozen_at"]
            if kind != "freeze":  # a frozen host was restarted already
                ctx.faults.restart(victim)
                ctx.faults.wait_ready(victim)
        event["back_after_s"] = round(time.time() - at, 2)
        self.events.append(event)


def soak(
    ctx: Context, *, duration_s: float, sessions: int, fault_every_s: float | None = None
) -> list[ClaimResult]:
    rng = random.Random(ctx.seed)
    pool = ctx.sessions(max(1, sessions // 2), slice_name="a07") + ctx.sessions(
        max(1, sessions - sessions // 2), slice_name="a08"
    )
    every = fault_every_s if fault_every_s is not None else duration_s / 8
    until = time.time() + duration_s
    deck = DECKS[ctx.substrate.name]
    chaos = _Chaos(ctx, rng, deck)
    stop = threading.Event()
    thread = threading.Thread(target=chaos.run, args=(every, until, stop), daemon=True)
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
                keepalive_s=KEEPALIVE_S if "freeze" in deck else None,
            )
        )
    finally:
        stop.set()
        thread.join(timeout=300)
    events = chaos.events
    claims = ctx.standard_claims(pool)
    ops = ctx.ops()
    prompts = [op for op in ops if op.op == "prompt"]
    figures = {
        "turns_ok": sum(1 for op in prompts if op.outcome == "ok"),
        "turns_unknown": sum(1 for op in prompts if op.outcome == "unknown"),
        "turns_failed": sum(1 for op in prompts if op.outcome == "fail"),
        "sessions": len(pool),
        **{label: sum(1 for e in events if e["kind"] == k) for k, label in COUNT_LABEL.items()},
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
