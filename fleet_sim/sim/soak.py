"""A soak: many sessions under a steady workload for a long time, with rolling deploys, hard
kills and (on leasefs) storage partitions interleaved at random, graded like any scenario."""

from __future__ import annotations

import random
import threading
import time

from fleet_sim.sim import checkers
from fleet_sim.sim.checkers import ClaimResult, verdict
from fleet_sim.sim.scenario import Context
from fleet_sim.sim.substrates import LeaseFs
from fleet_sim.sim.workload import drive


def soak(ctx: Context, *, duration_s: float, sessions: int) -> list[ClaimResult]:
    rng = random.Random(ctx.seed)
    pool = ctx.sessions(max(1, sessions // 2), slice_name="a07") + ctx.sessions(
        max(1, sessions - sessions // 2), slice_name="a08"
    )
    until = time.time() + duration_s
    events: list[dict[str, object]] = []
    stop = threading.Event()

    def chaos() -> None:
        while not stop.wait(rng.uniform(duration_s / 12, duration_s / 6)):
            if time.time() > until - 5:
                return
            slice_name = rng.choice(["a07", "a08"])
            victim = rng.choice(ctx.members(slice_name))
            kinds = ["deploy", "deploy", "kill"] + (
                ["partition"] if isinstance(ctx.substrate, LeaseFs) else []
            )
            kind = rng.choice(kinds)
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
        ctx.run(drive(ctx.edge, pool, ctx.journal, until=until, max_ops=10_000_000, seed=ctx.seed))
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
    }
    ctx.notes["faults"] = events
    return [*claims, verdict("soak-completes", [], figures)]
