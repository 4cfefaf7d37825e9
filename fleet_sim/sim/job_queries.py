"""What the job scenarios ask of the fleet and of storage about a background job, and how they
drive one: start a job through the model, end it when the scenario says, wait until storage tells
its end, and count how often it was told ("told once" is the number of event messages whose
``job_end.job_id`` names the job). Also the sandbox's and the control plane's own view of a job,
and :class:`SetupFailed` for a scenario that could not build the situation it grades.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import httpx

from fleet_sim.sim import checkers
from fleet_sim.sim.checkers import ClaimResult, verdict
from fleet_sim.sim.scenario import Context
from fleet_sim.sim.workload import Session, prompt_ws
from replica.history import History
from replica.transcript import Message

LOCAL = ("local-dir", "leasefs", "juicefs")
ANYWHERE = (*LOCAL, "attached")

TOLD_WAIT_S: Final = 25.0  # a job's end to the notice in storage, at most
SETTLE_S: Final = 2.5  # longer than the reconciler's 1 s spacing: a second notice would show
_READ_TAIL: Final = re.compile(r"\n\[read (\d+)-(\d+)( \(job ended, end of output\))?\]$")


class SetupFailed(RuntimeError):
    """The scenario could not build the situation it grades (not a verdict on the product)."""


def sandbox_get(ctx: Context, session: Session, path: str) -> dict[str, Any] | None:
    """The session's sandbox, asked directly (the sandbox is named after the session id)."""
    url, headers = ctx.local.fleet.sandbox.exec_for(session.session_id)
    try:
        response = httpx.get(f"{url}{path}", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    found: dict[str, Any] = response.json()
    return found


def callback_attempts(ctx: Context, job_id: str) -> list[int | None]:
    """Every status the sandbox got for this job's callbacks, in order (no tokens are here)."""
    try:
        listing = httpx.get(f"{ctx.local.fleet.sandbox.url}/_sim/notifications", timeout=10)
    except httpx.HTTPError:
        return []
    statuses: list[int | None] = []
    for record in listing.json().get("notifications", []):
        if record.get("job_id") == job_id:
            statuses += [a.get("status") for a in record.get("attempts", [])]
    return statuses


def lifecycle_events(ctx: Context, kind: str, session_id: str) -> list[dict[str, Any]]:
    try:
        response = httpx.get(
            f"{ctx.fleet.control_plane_url}/v1/lifecycle",
            params={"type": kind, "session_id": session_id},
            timeout=10,
        )
    except httpx.HTTPError:
        return []
    events: list[dict[str, Any]] = response.json().get("events", [])
    return events


def sessions_with_one_owner(ctx: Context, count: int, pool: int = 12) -> list[Session]:
    """``count`` placed sessions of slice a07 that hash to the same replica."""
    for _ in range(5):
        made = ctx.sessions(pool)
        by_owner: dict[str, list[Session]] = {}
        for s in made:
            by_owner.setdefault(ctx.owner(s.session_id), []).append(s)
        best = max(by_owner.values(), key=len)
        if len(best) >= count:
            return best[:count]
    raise SetupFailed(f"no {count} sessions share an owner")


def history_of(ctx: Context, session: Session) -> History | None:
    found, _ = ctx.histories([session])
    return found.get(session.session_id)


# -- what storage says about a job (pure) -------------------------------------------------------


def job_notices(history: History, job_id: str) -> list[Message]:
    out = []
    for message in history.transcript.messages:
        job_end = message.extra.get("job_end") if message.role == "event" else None
        if isinstance(job_end, dict) and job_end.get("job_id") == job_id:
            out.append(message)
    return out


def started_jobs(history: History) -> list[str]:
    return [
        str(m.extra["job_id"])
        for m in history.transcript.messages
        if m.role == "tool" and m.extra.get("background") is True and "job_id" in m.extra
    ]


def committed_by(history: History, message_id: str) -> str | None:
    """The owner of the segment that holds a message (messages are in commit order)."""
    index = next((i for i, m in enumerate(history.transcript.messages) if m.id == message_id), None)
    if index is None or history.transcript.resets:
        return None
    seen = 0
    for segment in history.segments:
        seen += segment.messages
        if index < seen:
            return segment.owner
    return None


@dataclass(frozen=True, slots=True)
class Read:
    """One ``job_output`` result the model got: the bytes and the range they cover."""

    job_id: str
    start: int
    end: int
    ended: bool
    data: str
    by: str | None


def job_reads(history: History, job_id: str) -> list[Read]:
    reads = []
    for message in history.transcript.messages:
        if message.role != "tool" or message.extra.get("job_id") != job_id:
            continue
        match = _READ_TAIL.search(message.content)
        if match is None:
            continue
        reads.append(
            Read(
                job_id,
                int(match.group(1)),
                int(match.group(2)),
                match.group(3) is not None,
                message.content[: match.start()],
                committed_by(history, message.id),
            )
        )
    return reads


@dataclass(frozen=True, slots=True)
class Telling:
    """How often storage says the model was told of one job's end."""

    session_id: str
    job_id: str
    told: int
    after_end_s: float | None = None  # from the job's end to the first notice's commit
    told_by: str | None = None
    path: Sequence[int | None] = ()  # the statuses the sandbox's callback attempts got


def told_exactly_once(
    claim: str, tellings: Sequence[Telling], figures: Mapping[str, Any] | None = None
) -> ClaimResult:
    """Every job's end is in storage exactly once."""
    errors = []
    for t in tellings:
        if t.told != 1:
            how = "never" if t.told == 0 else f"{t.told} times"
            errors.append(
                f"{t.session_id}: the end of {t.job_id} was told {how} "
                f"(callback answers {list(t.path)})"
            )
    waits = [t.after_end_s for t in tellings if t.told and t.after_end_s is not None]
    return verdict(
        claim,
        errors,
        {
            "jobs": len(tellings),
            "told_once": sum(1 for t in tellings if t.told == 1),
            "never_told": sum(1 for t in tellings if t.told == 0),
            "told_more_than_once": sum(1 for t in tellings if t.told > 1),
            **checkers.latency_figures(waits, "told_after_the_end"),
            "told_by": {t.job_id: t.told_by for t in tellings},
            "callback_answers": {t.job_id: list(t.path) for t in tellings},
            **(figures or {}),
        },
    )


# -- driving jobs through the edge --------------------------------------------------------------


def prompt(ctx: Context, session: Session, text: str) -> None:
    op = ctx.run(prompt_ws(ctx.edge, session, ctx.journal, text=text))
    if op.outcome != "ok":
        raise SetupFailed(f"{session.session_id}: a prompt ended {op.outcome}: {op.detail}")


def start_job(ctx: Context, session: Session, command: str) -> str:
    """Have the model start ``command`` in the background; the job's id, from storage."""
    history = history_of(ctx, session)
    before = set(started_jobs(history)) if history else set()
    prompt(ctx, session, f"bg: {command}\nstart that in the background")
    history = history_of(ctx, session)
    new = [j for j in (started_jobs(history) if history else []) if j not in before]
    if len(new) != 1:
        raise SetupFailed(f"{session.session_id}: {len(new)} jobs were recorded as started")
    return new[0]


def wait_told(
    ctx: Context,
    session: Session,
    job_id: str,
    *,
    timeout_s: float = TOLD_WAIT_S,
    settle_s: float = SETTLE_S,
) -> Telling:
    """Poll storage until the job's end is told (bounded), then give a duplicate time to show."""
    deadline = time.monotonic() + timeout_s
    history = None
    while time.monotonic() < deadline:
        history = history_of(ctx, session)
        if history is not None and job_notices(history, job_id):
            break
        time.sleep(0.2)
    else:
        return Telling(session.session_id, job_id, 0, path=callback_attempts(ctx, job_id))
    time.sleep(settle_s)
    history = history_of(ctx, session) or history
    assert history is not None
    notices = job_notices(history, job_id)
    ended_at = job_state(ctx, session, job_id).get("ended_at")
    return Telling(
        session.session_id,
        job_id,
        len(notices),
        round(notices[0].ts - ended_at, 3) if notices and ended_at else None,
        committed_by(history, notices[0].id) if notices else None,
        callback_attempts(ctx, job_id),
    )


def recount(ctx: Context, session: Session, telling: Telling) -> Telling:
    """A telling counted again: a job waited for early gets the later waits' settling time."""
    return replace(telling, told=told_now(ctx, session, telling.job_id))


def held_job(release_file: str, says: str) -> str:
    """A job that runs until the scenario releases it (at most a minute), then prints ``says``:
    the scenario, not the clock, decides when it ends."""
    return (
        f"for i in $(seq 1 1200); do [ -e {release_file} ] && break; sleep 0.05; done; echo {says}"
    )


def release(ctx: Context, session: Session, release_file: str = "end") -> None:
    """End a :func:`held_job` (or the survivor's loop): the file appears in its workspace."""
    workspace = ctx.local.fleet.root / "sandboxes" / session.session_id / "workspace"
    (workspace / release_file).touch()


def started_by(ctx: Context, session: Session, job_id: str) -> str | None:
    history = history_of(ctx, session)
    if history is None:
        return None
    started = next(
        (m for m in history.transcript.messages if m.extra.get("job_id") == job_id), None
    )
    return committed_by(history, started.id) if started else None


def with_errors(claim: ClaimResult, errors: Sequence[str]) -> ClaimResult:
    """The claim, failed by ``errors`` too (a premise the scenario could not set up, or a second
    view of the same claim)."""
    if not errors:
        return claim
    return verdict(claim.claim, [*claim.errors, *errors], claim.figures)


def told_now(ctx: Context, session: Session, job_id: str) -> int:
    history = history_of(ctx, session)
    return len(job_notices(history, job_id)) if history else 0


def job_state(ctx: Context, session: Session, job_id: str) -> dict[str, Any]:
    return sandbox_get(ctx, session, f"/jobs/{job_id}") or {}


def committed_holder(ctx: Context, sessions: Sequence[Session]) -> dict[str, str | None]:
    """Who owns the newest segment of each session."""
    found, _ = ctx.histories(sessions)
    return {sid: (h.segments[-1].owner if h.segments else None) for sid, h in found.items()}


def seen_by_the_holder(ctx: Context, session: Session) -> dict[str, int]:
    """How often each job's end appears in what the session's holder serves a client."""
    response = httpx.post(
        f"{ctx.edge}/_beyond/agent",
        params={"session_id": session.session_id},
        content=b'{"type":"get_messages"}',
        headers={"x-beyond-grant": session.grant},
        timeout=150,
    )
    counts: dict[str, int] = {}
    if response.status_code != 200:
        return counts
    for message in response.json().get("data", {}).get("messages", []):
        job_end = message.get("job_end") if message.get("role") == "event" else None
        if isinstance(job_end, dict) and isinstance(job_end.get("job_id"), str):
            counts[job_end["job_id"]] = counts.get(job_end["job_id"], 0) + 1
    return counts


__all__ = [
    "ANYWHERE",
    "LOCAL",
    "SETTLE_S",
    "TOLD_WAIT_S",
    "Read",
    "SetupFailed",
    "Telling",
    "callback_attempts",
    "committed_by",
    "committed_holder",
    "held_job",
    "history_of",
    "job_notices",
    "job_reads",
    "job_state",
    "lifecycle_events",
    "prompt",
    "recount",
    "release",
    "sandbox_get",
    "seen_by_the_holder",
    "sessions_with_one_owner",
    "start_job",
    "started_by",
    "started_jobs",
    "told_exactly_once",
    "told_now",
    "wait_told",
    "with_errors",
]
