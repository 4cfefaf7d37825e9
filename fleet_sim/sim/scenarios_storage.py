"""The catalogue's scenarios of a real distributed file system: a frozen host, a metadata engine
killed and restarted, and a stale client that JuiceFS does not fence.

A frozen host is the case the edge cannot see: the replica's kernel still accepts connections,
so to the edge it is slow, not gone. What takes it out of the ring is an orchestrator whose
readiness probe stops being answered (:class:`fleet_sim.sim.faults.Rotation`); its sessions move
once its storage session lapses (5 heartbeats of a JuiceFS client, a leasefs lease). The clients
ping their connections (a pong that does not come gives the connection up), as a client must to
notice an owner that froze under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets

from fleet_sim.juicefs import JuiceFs
from fleet_sim.keys import derive_tenant_dek
from fleet_sim.sim import checkers
from fleet_sim.sim.checkers import ClaimResult, verdict
from fleet_sim.sim.faults import (
    Rotation,
    freeze_host,
    frozen_host,
    storage_expiry_s,
    superseded_count,
    thaw_host,
)
from fleet_sim.sim.journal import Op
from fleet_sim.sim.scenario import Context, scenario
from fleet_sim.sim.scenarios_core import STANDARD, _run_workload_with
from fleet_sim.sim.substrates import NotApplicable
from fleet_sim.sim.workload import Session, new_token, prompt_ws
from replica.sealing import RecordSealer
from replica.segments import parse_segment, segment_name
from replica.store import SessionStore
from replica.transcript import Message
from wire.names import parse_session_id

# A client pings every 2 s and gives a connection up when the pong is 2 s late: a frozen owner
# is noticed 2-4 s after it stopped, far sooner than the library's 20 + 20 s.
KEEPALIVE_S = 2.0
# A frozen host is thawed once its sessions were all served elsewhere, or after this: well inside
# the edge's 65 s handshake timeout, so a handshake that reached it just before it froze is
# answered by it when it wakes (and fenced there) rather than refused by the edge.
FREEZE_CAP_S = 40.0


def _wait_served(ctx: Context, sessions: Sequence[str], since: float, until: float) -> bool:
    """Wait until every one of ``sessions`` has had a turn acknowledged that began after
    ``since``; False when ``until`` came first."""
    waiting = set(sessions)
    while waiting and time.time() < until:
        served = {
            op.session_id
            for op in ctx.ops()
            if op.op == "prompt" and op.outcome == "ok" and op.started >= since
        }
        waiting -= served
        time.sleep(0.25)
    return not waiting


@scenario(
    "takeover-after-host-freeze",
    claims=(*STANDARD, "survivor-takes-over-inside-budget"),
    substrates=("leasefs", "juicefs"),  # a local directory keeps a stopped owner's locks
)
def takeover_after_host_freeze(ctx: Context) -> list[ClaimResult]:
    """A replica's host freezes under load (the replica and its file-system client stopped); an
    orchestrator sees its /readyz stop answering and takes it out of the edge's ring; survivors
    take its sessions over once its storage session lapses. The host is thawed, restarted and
    put back in the ring, and the workload goes on through it."""
    sessions = ctx.sessions(4 if ctx.quick else 8)
    victim = ctx.owner(sessions[0].session_id)
    affected = [s.session_id for s in sessions if ctx.owner(s.session_id) == victim]
    expiry = storage_expiry_s(ctx.substrate)
    rotation = Rotation(ctx.local)
    marks: dict[str, float] = {}

    def hold(frozen: float) -> None:
        # Until every session it held has been served elsewhere, or the cap: a client whose
        # handshake reached the host in the moment before it left the ring waits for the thaw.
        _wait_served(ctx, affected, frozen, frozen + min(FREEZE_CAP_S, expiry + 20.0))

    def freeze() -> None:
        marks.update(frozen_host(ctx.faults, ctx.substrate, rotation, victim, hold))

    seconds = 35.0 if ctx.quick else 50.0
    _run_workload_with(ctx, sessions, seconds, freeze, at=3.0 / seconds, keepalive_s=KEEPALIVE_S)
    frozen = marks["frozen_at"]
    out_of_ring = frozen + marks["out_of_ring_after_s"]
    ops = ctx.ops()
    times = checkers.takeover_times(ops, frozen, affected, began_after=True)
    # The sessions whose first turn after the freeze went to the frozen host before it left the
    # ring: served only once it was thawed, they measure the edge, not the takeover.
    caught = _caught_on_the_host(ops, frozen, out_of_ring, affected)
    served = [s for s in affected if s not in caught]
    budget = ctx.fleet.retry_budget_s
    errors = [f"{sid}: not served again after the freeze" for sid in affected][len(times) :]
    errors += [f"a takeover took {t:.1f}s, over the {budget}s budget" for t in times if t > budget]
    figures = {
        "victim": victim,
        "affected_sessions": len(affected),
        "storage_expiry_s": expiry,
        **{k: v for k, v in marks.items() if k != "frozen_at"},
        **checkers.latency_figures(
            checkers.takeover_times(ops, frozen, served, began_after=True), "takeover"
        ),
        **checkers.latency_figures(
            checkers.takeover_times(ops, frozen, caught, began_after=True),
            "caught_on_the_frozen_host",
        ),
    }
    ctx.notes["takeover"] = figures
    return [
        *ctx.standard_claims(sessions),
        verdict("survivor-takes-over-inside-budget", errors, figures),
    ]


def _caught_on_the_host(
    ops: Sequence[Op], frozen: float, out_of_ring: float, sessions: Sequence[str]
) -> list[str]:
    """Of ``sessions``, those whose first acknowledged turn begun after the freeze had begun
    before the host left the ring (its handshake went to the frozen host and waited for the
    thaw)."""
    caught = []
    for sid in sessions:
        after = sorted(
            (o for o in ops if o.session_id == sid and o.outcome == "ok" and o.started >= frozen),
            key=lambda o: o.ended,
        )
        if after and after[0].started < out_of_ring:
            caught.append(sid)
    return caught


@scenario(
    "metadata-restart-loses-nothing",
    claims=(*STANDARD, "metadata-restart-loses-nothing"),
    substrates=("juicefs",),
)
def metadata_restart_loses_nothing(ctx: Context) -> list[ClaimResult]:
    """Redis, the metadata engine, is killed (SIGKILL) and started again from its AOF, twice,
    under load on both slices: every turn acknowledged before, across and after a restart is in
    storage exactly once, and every session is served again after each."""
    substrate = ctx.substrate
    if not isinstance(substrate, JuiceFs):
        raise NotApplicable("only a juicefs fleet has a metadata engine of its own")
    half = 3 if ctx.quick else 6
    sessions = ctx.sessions(half) + ctx.sessions(half, slice_name="a08")
    seconds = 18.0 if ctx.quick else 36.0
    restarts: list[tuple[float, float]] = []

    def restart_twice() -> None:
        for n in range(2):
            if n:
                time.sleep(seconds * 0.3)
            began = time.time()
            substrate.restart_metadata()
            restarts.append((began, time.time()))

    _run_workload_with(ctx, sessions, seconds, restart_twice, at=0.2)
    ops = [op for op in ctx.ops() if op.op == "prompt"]
    histories, _ = ctx.histories(sessions)
    # Every turn that was in flight at a restart, or began while Redis was down: the ones a lost
    # metadata write would have lost.
    across = [
        op for op in ops if any(op.started <= end and op.ended >= began for began, end in restarts)
    ]
    graded = checkers.no_acknowledged_turn_lost_or_duplicated(across, histories)
    errors = list(graded.errors)
    served: list[float] = []
    for began, _end in restarts:
        times = checkers.takeover_times(ops, began, [s.session_id for s in sessions])
        if len(times) < len(sessions):
            errors.append(f"{len(sessions) - len(times)} sessions not served after a restart")
        served += times
    if not any(op.outcome == "ok" for op in across):
        errors.append("no acknowledged turn was in flight at a restart: nothing was tested")
    figures = {
        "restarts": len(restarts),
        "restart_s": [round(end - began, 3) for began, end in restarts],
        "turns_across_restarts": dict(graded.figures),
        **checkers.latency_figures(served, "served_again"),
        **checkers.latency_figures(
            [op.seconds for op in across if op.outcome == "ok"], "turn_across"
        ),
    }
    return [
        *ctx.standard_claims(sessions),
        verdict("metadata-restart-loses-nothing", errors, figures),
    ]


@dataclass
class _Reader:
    """What one reader attached to the owner itself saw."""

    frames: list[dict[str, Any]] = field(default_factory=list)
    ended: str = ""

    def kinds(self) -> list[str]:
        return [
            f["event"]["kind"] if f.get("type") == "event" else str(f.get("type"))
            for f in self.frames
        ]

    @property
    def superseded(self) -> bool:
        return any(f.get("type") == "session_superseded" for f in self.frames)

    def text(self, run_id: str) -> str:
        return "".join(
            f["event"]["text"]
            for f in self.frames
            if f.get("type") == "event"
            and f["event"].get("kind") == "text_delta"
            and f["event"].get("run_id") == run_id
        )

    def run_id(self) -> str | None:
        for f in self.frames:
            if f.get("type") == "event" and f["event"].get("kind") == "turn_started":
                return str(f["event"]["run_id"])
        return None


async def _sse_reader(url: str, session: Session, reader: _Reader, opened: asyncio.Event) -> None:
    """Follow the session's event stream on ``url`` until it ends."""
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(10, read=None)) as client,
        client.stream(
            "GET",
            f"{url}/_beyond/agent/events",
            params={"session_id": session.session_id},
            headers={"x-beyond-grant": session.grant},
        ) as response,
    ):
        if response.status_code != 200:
            reader.ended = f"refused {response.status_code}"
            opened.set()
            return
        opened.set()
        try:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    reader.frames.append(json.loads(line.removeprefix("data:").strip()))
        except httpx.HTTPError as exc:
            reader.ended = type(exc).__name__
            return
    reader.ended = reader.ended or "closed"


async def _ws_prompter(
    url: str, session: Session, token: str, reader: _Reader, in_flight: asyncio.Event
) -> None:
    """Prompt on the owner itself and read what it says until it closes; ``in_flight`` is set
    once the prompt is committed and the reply has begun to stream. No pings: the reader must
    outlast the freeze, as a connection whose peer is stopped does."""
    ws_url = url.replace("http", "ws", 1) + f"/_beyond/agent?session_id={session.session_id}"
    try:
        async with websockets.connect(
            ws_url,
            additional_headers={"x-beyond-grant": session.grant},
            ping_interval=None,
            max_size=None,
        ) as ws:
            reader.frames.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "prompt", "id": token, "message": f"stale {token}"}))
            async for raw in ws:
                frame = json.loads(raw)
                reader.frames.append(frame)
                kinds = reader.kinds()
                if "committed" in kinds and "text_delta" in kinds:
                    in_flight.set()
    except websockets.ConnectionClosed as exc:
        reader.ended = f"closed {exc.rcvd.code if exc.rcvd else 1006}"
        return
    reader.ended = "closed"


@dataclass
class _StaleRun:
    prompter: _Reader
    stream: _Reader
    sent: float = 0.0
    frozen: float = 0.0
    thawed: float = 0.0
    survivor_turn: Op | None = None


async def _freeze_mid_turn(ctx: Context, victim: str, session: Session, token: str) -> _StaleRun:
    url = ctx.fleet.replicas[victim][1].url
    run = _StaleRun(_Reader(), _Reader())
    opened, in_flight = asyncio.Event(), asyncio.Event()
    stream = asyncio.create_task(_sse_reader(url, session, run.stream, opened))
    await asyncio.wait_for(opened.wait(), 30)
    run.sent = time.time()
    prompter = asyncio.create_task(_ws_prompter(url, session, token, run.prompter, in_flight))
    rotation = Rotation(ctx.local)
    try:
        await asyncio.wait_for(in_flight.wait(), 30)
        await asyncio.to_thread(freeze_host, ctx.faults, ctx.substrate, victim)
        run.frozen = time.time()
        await asyncio.to_thread(rotation.wait_unanswered, victim)
        await asyncio.to_thread(rotation.take_out, victim)
        # Through the edge: a survivor takes the session over once the frozen client's session
        # lapses, and commits a turn of its own.
        run.survivor_turn = await prompt_ws(ctx.edge, session, ctx.journal, text="survivor")
        await asyncio.to_thread(thaw_host, ctx.faults, ctx.substrate, victim)
        run.thawed = time.time()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(prompter, stream), 30)
    finally:
        for task in (prompter, stream):
            task.cancel()
        await asyncio.gather(prompter, stream, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(thaw_host, ctx.faults, ctx.substrate, victim)
        await asyncio.to_thread(ctx.faults.wait_ready, victim)
        await asyncio.to_thread(rotation.put_back, victim)
    return run


def _past_the_seal(ctx: Context, session: Session, epoch: int, bound: int) -> list[Message]:
    """The messages a segment holds past the seal its successor put on it, read from the raw
    file: what the stale owner wrote there, which no reader of the history ever sees."""
    sid = parse_session_id(session.session_id)
    directory = SessionStore(ctx.substrate.backing(str(sid.shard))).directory(session.tenant, sid)
    data = (directory / segment_name(epoch)).read_bytes()
    sealer = RecordSealer.for_session(
        derive_tenant_dek(ctx.fleet.keys, session.tenant), session.tenant, session.session_id
    )
    records = parse_segment(data, epoch, sealer).records
    return [
        Message.from_wire(m) for r in records if r.start >= bound for m in r.payload.get("m", [])
    ]


@scenario(
    "stale-client-is-fenced",
    claims=("stale-client-is-fenced", *STANDARD),
    substrates=("juicefs",),  # leasefs fails a healed host's descriptors: it fences by itself
    model="stub:ttft=200ms,per_token=40ms,tokens=80",
)
def stale_client_is_fenced(ctx: Context) -> list[ClaimResult]:
    """The owner's host freezes with a turn in flight, watched by two readers attached to the
    owner itself (the WebSocket that sent the prompt and an SSE stream); it is taken out of the
    ring, and a survivor takes the session over and commits a turn. Thawed, the stale owner,
    whose JuiceFS client still writes (JuiceFS fences nothing), finishes its turn: the commit
    finds the successor's segment and ends Superseded, both readers are told
    session_superseded, and the reply it wrote past the seal is on disk but never read."""
    session = ctx.sessions(1)[0]
    first = ctx.run(prompt_ws(ctx.edge, session, ctx.journal))  # opens it on its owner
    victim = ctx.owner(session.session_id)
    superseded_before = superseded_count(ctx.local, victim)
    token = new_token()
    run = ctx.run(_freeze_mid_turn(ctx, victim, session, token))
    superseded = superseded_count(ctx.local, victim) - superseded_before
    ctx.journal.record(
        Op(session.session_id, "prompt", token, run.sent, run.thawed, "unknown", "ws", "stale")
    )
    errors: list[str] = []
    if first.outcome != "ok":
        errors.append(f"the first turn ended {first.outcome}: {first.detail}")
    survivor = run.survivor_turn
    if survivor is None or survivor.outcome != "ok":
        errors.append(f"the survivor's turn did not succeed: {survivor and survivor.detail}")
    if superseded != 1:
        errors.append(f"the stale owner counted {superseded} supersessions, not 1")
    for name, reader in (("WebSocket", run.prompter), ("SSE", run.stream)):
        if not reader.superseded:
            errors.append(f"its {name} reader was not told session_superseded ({reader.ended})")
        elif "turn_ended" in reader.kinds():
            errors.append(f"its {name} reader was told the stale turn ended, not superseded")
    stale_run = run.prompter.run_id()
    histories, failures = ctx.histories([session])
    history = histories.get(session.session_id)
    figures: dict[str, Any] = {
        "victim": victim,
        "supersessions_counted": superseded,
        "ws_reader_saw": run.prompter.kinds()[-3:],
        "sse_reader_saw": run.stream.kinds()[-3:],
        # From the freeze to the survivor's turn acknowledged (that turn's model time included).
        "takeover_s": round(survivor.ended - run.frozen, 2) if survivor else None,
        "survivor_turn_s": round(survivor.seconds, 2) if survivor else None,
        "storage_expiry_s": storage_expiry_s(ctx.substrate),
    }
    if history is None:
        errors.append(f"the transcript does not verify: {failures.get(session.session_id)}")
    else:
        epochs = [s.epoch for s in history.segments]
        stale = history.segments[-2] if len(epochs) >= 2 else None
        figures["epochs"] = epochs
        if stale is None or stale.bound is None:
            errors.append(f"no successor sealed the stale owner's segment (epochs {epochs})")
        else:
            past = _past_the_seal(ctx, session, stale.epoch, stale.bound)
            read_ids = {m.id for m in history.transcript.messages}
            figures["stale_bytes_past_seal"] = stale.ignored_bytes
            figures["stale_messages_past_seal"] = len(past)
            if not past:
                errors.append(
                    "the stale owner wrote nothing past the seal: its commit was not tried"
                )
            if any(m.id in read_ids for m in past):
                errors.append("a message the stale owner wrote past the seal is read back")
            streamed = run.prompter.text(stale_run or "")
            if past and streamed and not any(m.content == streamed for m in past):
                errors.append("what lies past the seal is not the reply the stale turn streamed")
        contents = [m.content for m in history.transcript.messages if m.role == "user"]
        if not survivor or not any(survivor.token in c for c in contents):
            errors.append("the survivor's turn is not in the transcript")
    return [verdict("stale-client-is-fenced", errors, figures), *ctx.standard_claims([session])]
