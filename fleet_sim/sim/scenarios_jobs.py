"""The catalogue's job-end and sandbox-job scenarios.

A background job belongs to its session's sandbox, not to a replica. When it ends, the sandbox
calls back through the edge; the replica holding the session (or, through the control plane's
wake, the one that opens it next) tells the model. The scenarios here follow real jobs' ends
through hard kills, ring changes, reaps and drains, and hold each to being told exactly once.
"Told once" is always read from storage: the number of event messages whose ``job_end.job_id``
names the job. The edge's own rules for callbacks (E1-E7) are in
:mod:`fleet_sim.sim.scenarios_callbacks`; the queries and waits both use are in
:mod:`fleet_sim.sim.job_queries`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from edge.core.ring import Ring
from fleet_sim.sim.checkers import ClaimResult, verdict
from fleet_sim.sim.job_queries import (
    LOCAL,
    SetupFailed,
    committed_holder,
    held_job,
    history_of,
    job_reads,
    job_state,
    lifecycle_events,
    prompt,
    recount,
    release,
    sandbox_get,
    seen_by_the_holder,
    sessions_with_one_owner,
    start_job,
    started_by,
    told_exactly_once,
    told_now,
    wait_told,
    with_errors,
)
from fleet_sim.sim.observe import replica_metric
from fleet_sim.sim.scenario import Context, scenario
from fleet_sim.sim.scenarios_core import STANDARD
from fleet_sim.sim.workload import prompt_ws

# == job ends across ownership changes ===========================================================


@scenario(
    "job-ended-after-takeover",
    claims=("job-ended-after-takeover", *STANDARD),
    substrates=LOCAL,
)
def after_takeover(ctx: Context) -> list[ClaimResult]:
    """Jobs start on replica A; A is killed -9. One job ends while nobody holds its session: it
    is handed off and the wake opens the session elsewhere. The other session is taken over
    first, and its job's callback walks to the new holder. Each end is told exactly once."""
    taken, idle = sessions_with_one_owner(ctx, 2)
    victim = ctx.owner(taken.session_id)
    taken_job = start_job(ctx, taken, held_job("end", "after-takeover"))
    idle_job = start_job(ctx, idle, held_job("end", "nobody-holds-it"))
    ctx.faults.kill(victim)
    release(ctx, idle)
    idle_told = wait_told(ctx, idle, idle_job, settle_s=0)
    prompt(ctx, taken, "still there?")  # the takeover, before the job ends
    release(ctx, taken)
    taken_told = wait_told(ctx, taken, taken_job)
    idle_told = recount(ctx, idle, idle_told)
    starters = {job: started_by(ctx, s, job) for s, job in ((taken, taken_job), (idle, idle_job))}
    premise = [
        f"{job} was started by {who}, not {victim}"
        for job, who in starters.items()
        if who != victim
    ]
    holders = committed_holder(ctx, [taken, idle])
    premise += [
        f"{sid} is still held by the killed replica" for sid, h in holders.items() if h == victim
    ]
    claim = told_exactly_once(
        "job-ended-after-takeover",
        [taken_told, idle_told],
        {"victim": victim, "started_by": starters, "holders": holders},
    )
    return [with_errors(claim, premise), *ctx.standard_claims([taken, idle])]


@scenario(
    "job-ended-across-a-ring-change",
    claims=("job-ended-across-a-ring-change", *STANDARD),
    substrates=LOCAL,
)
def across_a_ring_change(ctx: Context) -> list[ClaimResult]:
    """A job starts on the session's owner; a replica joins the slice and the edge reloads, so
    the session now hashes to the newcomer, which does not hold it; then the job ends. The
    model is told once."""
    after = Ring((*ctx.members("a07"), "r9"))
    session = next((s for s in ctx.sessions(24) if after.owner(s.session_id) == "r9"), None)
    if session is None:
        raise SetupFailed("no session moves to the new replica")
    old_owner = ctx.owner(session.session_id)
    job = start_job(ctx, session, held_job("end", "across-the-ring"))
    ctx.local.start_replica("r9", "a07")
    ctx.faults.wait_ready("r9")
    ctx.local.reload_edge()
    time.sleep(1.0)  # the edge reloads on SIGHUP, asynchronously
    release(ctx, session)
    telling = wait_told(ctx, session, job)
    holder = committed_holder(ctx, [session]).get(session.session_id)
    claim = told_exactly_once(
        "job-ended-across-a-ring-change",
        [telling],
        {
            "old_owner": old_owner,
            "new_owner": "r9",
            "holder": holder,
            "reports_handed_to_the_control_plane": len(
                lifecycle_events(ctx, "job_ended", session.session_id)
            ),
        },
    )
    premise = [] if holder == old_owner else [f"the session moved to {holder} before the end"]
    return [with_errors(claim, premise), *ctx.standard_claims([session])]


@scenario(
    "job-ended-after-the-session-closed",
    claims=("job-ended-after-the-session-closed", *STANDARD),
    substrates=LOCAL,
    idle_timeout_s=1.0,
)
def after_the_session_closed(ctx: Context) -> list[ClaimResult]:
    """The session is reaped (idle timeout 1 s) while its job runs; the job's end reaches a
    replica that does not hold it, the control plane's wake opens the session, and the model is
    told once."""
    session = ctx.sessions(1)[0]
    job = start_job(ctx, session, held_job("end", "after-the-reap"))
    deadline = time.monotonic() + 10
    reaped = False
    while time.monotonic() < deadline and not reaped:
        reaped = replica_metric(ctx, "agent_sessions_live", slice_name="a07") == 0
        time.sleep(0.1)
    release(ctx, session)
    telling = wait_told(ctx, session, job)
    handed = lifecycle_events(ctx, "job_ended", session.session_id)
    premise = [] if reaped else ["the session was still open 10 s after its turn"]
    if telling.told and not handed:
        premise.append("told, but no replica handed the job's end to the control plane")
    claim = told_exactly_once(
        "job-ended-after-the-session-closed",
        [telling],
        {
            "reaped_before_the_end": reaped,
            "reports_handed_to_the_control_plane": len(handed),
            "sessions_reaped": replica_metric(ctx, "agent_sessions_reaped_total"),
        },
    )
    return [with_errors(claim, premise), *ctx.standard_claims([session])]


# == sandbox jobs outliving their replica ========================================================


@scenario(
    "sandbox-job-survives-its-replica",
    claims=("sandbox-job-survives-its-replica", "sandbox-job-end-told-once", *STANDARD),
    substrates=LOCAL,
)
def survives_its_replica(ctx: Context) -> list[ClaimResult]:
    """A long job keeps running across a hard kill of its replica: the next holder finds it
    still running under the same id, reads its output on from where the model left off, and
    its end, once it comes, is told once."""
    session = ctx.sessions(1)[0]
    victim = ctx.owner(session.session_id)
    command = "for i in $(seq 1 1200); do [ -e end ] && break; echo line-$i; sleep 0.1; done"
    job = start_job(ctx, session, command)
    time.sleep(1.0 if ctx.quick else 5.0)
    prompt(ctx, session, f"read: {job} 0\nwhat has it printed?")
    history = history_of(ctx, session)
    first = job_reads(history, job) if history else []
    if len(first) != 1:
        raise SetupFailed(f"the first read of {job} is not in storage")
    before_kill = job_state(ctx, session, job)
    ctx.faults.kill(victim)
    time.sleep(0.5)  # the job goes on printing while nobody holds the session
    prompt(ctx, session, f"read: {job} {first[0].end}\nand since then?")
    after_kill = job_state(ctx, session, job)
    told_while_running = told_now(ctx, session, job)
    history = history_of(ctx, session)
    reads = job_reads(history, job) if history else []
    errors = []
    if len(reads) != 2:
        errors.append(f"{len(reads)} reads of {job} are stored, not 2")
    else:
        second = reads[1]
        whole = sandbox_get(ctx, session, f"/jobs/{job}/output?offset=0&limit={second.end}")
        if second.by == victim or second.by is None:
            errors.append(f"the second read was made by {second.by}, not a new holder")
        if second.start != reads[0].end or second.end <= second.start:
            errors.append(f"the second read covered {second.start}-{second.end}")
        if second.ended:
            errors.append("the new holder read the job as ended while it ran")
        if whole is None or whole.get("data") != reads[0].data + second.data:
            errors.append("the two reads are not the job's output, end to end")
    if after_kill.get("status") != "running" or after_kill.get("job_id") != job:
        errors.append(f"after the kill the sandbox reports {after_kill.get('status')!r}")
    if after_kill.get("started_at") != before_kill.get("started_at"):
        errors.append("the job was started again")
    if told_while_running:
        errors.append(f"the running job's end was told {told_while_running} times")
    figures = {
        "victim": victim,
        "job_id": job,
        "status_after_kill": after_kill.get("status"),
        "reads": [{"range": [r.start, r.end], "by": r.by, "ended": r.ended} for r in reads],
        "told_while_running": told_while_running,
    }
    release(ctx, session)
    return [
        verdict("sandbox-job-survives-its-replica", errors, figures),
        told_exactly_once("sandbox-job-end-told-once", [wait_told(ctx, session, job)]),
        *ctx.standard_claims([session]),
    ]


@scenario(
    "sandbox-job-exit-noticed-once",
    claims=("sandbox-job-exit-noticed-once", *STANDARD),
    substrates=LOCAL,
    model="stub:ttft=50ms,per_token=25ms,tokens=8",
)
def exit_noticed_once(ctx: Context) -> list[ClaimResult]:
    """Two jobs of one session finish around a drain of its replica (a long turn keeps the
    drain going): one while the draining replica still holds the session, one after it exited
    and before anyone else opened it. The next holder shows each end exactly once, and storage
    holds each exactly once."""
    session = ctx.sessions(1)[0]
    victim = ctx.owner(session.session_id)
    during = start_job(ctx, session, held_job("end-1", "finished-in-the-drain"))
    between = start_job(ctx, session, held_job("end-2", "finished-after-the-drain"))
    marks: dict[str, Any] = {}

    def long_turn() -> None:
        marks["turn"] = ctx.run(
            prompt_ws(ctx.edge, session, ctx.journal, text="words: 120\nkeep talking")
        )

    def drain() -> None:
        marks["drain_began"] = time.time()
        marks["exit_code"] = ctx.faults.drain(victim)
        marks["drain_ended"] = time.time()

    talker = threading.Thread(target=long_turn, daemon=True)
    talker.start()
    time.sleep(0.6)
    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    time.sleep(0.8)
    release(ctx, session, "end-1")
    drainer.join(60)
    talker.join(60)
    release(ctx, session, "end-2")
    tellings = [wait_told(ctx, session, during, settle_s=0), wait_told(ctx, session, between)]
    tellings[0] = recount(ctx, session, tellings[0])
    prompt(ctx, session, "who holds this now?")
    seen = seen_by_the_holder(ctx, session)
    began, ended = marks.get("drain_began", 0.0), marks.get("drain_ended", 0.0)
    ends = {job: job_state(ctx, session, job).get("ended_at") or 0.0 for job in (during, between)}
    premise = []
    if not began < ends[during] < ended:
        premise.append(f"{during} did not end inside the drain")
    if ends[between] < ended:
        premise.append(f"{between} ended before the drained replica exited")
    if marks.get("exit_code") != 0:
        premise.append(f"the drained replica exited {marks.get('exit_code')}")
    errors = [
        f"the next holder shows the end of {job} {seen.get(job, 0)} times"
        for job in (during, between)
        if seen.get(job, 0) != 1
    ]
    turn = marks.get("turn")
    claim = told_exactly_once(
        "sandbox-job-exit-noticed-once",
        tellings,
        {
            "drained": victim,
            "drain_s": round(ended - began, 3),
            "ended_into_the_drain_s": {job: round(at - began, 3) for job, at in ends.items()},
            "turn_in_flight": turn.outcome if turn is not None else None,
            "shown_by_the_next_holder": seen,
            "holder_after": committed_holder(ctx, [session]).get(session.session_id),
        },
    )
    return [with_errors(claim, [*errors, *premise]), *ctx.standard_claims([session])]
