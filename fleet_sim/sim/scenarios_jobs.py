"""The catalogue's job-end and sandbox-job scenarios.

A background job belongs to its session's sandbox, not to a replica. When it ends, the sandbox
calls back through the edge; the replica holding the session (or, through the control plane's
wake, the one that opens it next) tells the model. The scenarios here hold the edge to rules
E1-E7 with raw bytes on real sockets, and follow real jobs' ends through hard kills, ring
changes, reaps and drains. "Told once" is always read from storage: the number of event messages
whose ``job_end.job_id`` names the job.

Some rules need a replica that misbehaves on purpose (never answers, answers a chosen status,
reports the exact bytes it got). For those a scenario starts a :class:`Backend` of its own and a
second edge process whose one slice is that backend, next to the real fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlencode, urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from edge.config import EdgeOptions, parse_config_text
from edge.errors import ConfigError
from edge.retry import CALLBACK_BUDGET_S
from edge.ring import Ring
from fleet_sim.ports import free_port
from fleet_sim.sim import checkers
from fleet_sim.sim.checkers import ClaimResult, verdict
from fleet_sim.sim.scenario import Context, scenario
from fleet_sim.sim.scenarios_core import STANDARD
from fleet_sim.sim.workload import Session, prompt_ws
from fleet_sim.up import SLICES
from replica.history import History
from replica.keyfiles import read_key_file
from replica.notify import NotifyKey, NotifyTokenError
from replica.transcript import Message

LOCAL = ("local-dir", "leasefs", "juicefs")
ANYWHERE = (*LOCAL, "attached")

TOLD_WAIT_S: Final = 25.0  # a job's end to the notice in storage, at most
SETTLE_S: Final = 2.5  # longer than the reconciler's 1 s spacing: a second notice would show
HOP_BY_HOP: Final = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade"}
)
TOKEN_BYTES: Final = re.compile(rb"bjn_v1\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{16,}")
_READ_TAIL: Final = re.compile(r"\n\[read (\d+)-(\d+)( \(job ended, end of output\))?\]$")
JOB_BODY: Final = b'{"type":"job_ended","job_id":"j0000000000000000","status":"exited"}'


class SetupFailed(RuntimeError):
    """The scenario could not build the situation it grades (not a verdict on the product)."""


# -- raw HTTP/1.1 on a socket: client libraries would normalise the very bytes under test ----------


Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class Wire:
    """One HTTP message as read off a socket."""

    start_line: bytes
    headers: Headers
    body: bytes  # de-chunked
    raw_body: bytes  # as it came, chunk framing included

    def header(self, name: str) -> list[bytes]:
        wanted = name.lower().encode()
        return [v for n, v in self.headers if n.lower() == wanted]

    @property
    def status(self) -> int:
        return int(self.start_line.split(b" ", 2)[1])

    @property
    def target(self) -> str:
        return self.start_line.split(b" ", 2)[1].decode("latin-1")


async def read_wire(reader: asyncio.StreamReader, *, response: bool) -> Wire:
    head = await reader.readuntil(b"\r\n\r\n")
    start, *lines = head[:-4].split(b"\r\n")
    headers = [(n.strip(), v.strip(b" \t")) for n, _, v in (ln.partition(b":") for ln in lines)]
    wire = Wire(start, headers, b"", b"")
    encodings = wire.header("transfer-encoding")
    lengths = wire.header("content-length")
    if encodings and encodings[-1].lower().endswith(b"chunked"):
        raw, body = await _read_chunked(reader)
    elif lengths:
        body = raw = await reader.readexactly(int(lengths[0]))
    elif response:
        body = raw = await reader.read()  # delimited by the close
    else:
        body = raw = b""
    return Wire(start, headers, body, raw)


async def _read_chunked(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    raw, body = bytearray(), bytearray()
    for _ in range(100_000):
        line = await reader.readuntil(b"\r\n")
        raw += line
        size = int(line.split(b";")[0].strip(), 16)
        if size == 0:
            for _ in range(100):  # trailers, up to the blank line
                trailer = await reader.readuntil(b"\r\n")
                raw += trailer
                if trailer == b"\r\n":
                    return bytes(raw), bytes(body)
            raise ValueError("too many trailer lines")
        chunk = await reader.readexactly(size + 2)
        raw += chunk
        body += chunk[:-2]
    raise ValueError("too many chunks")


def request_bytes(method: str, target: str, headers: Headers, payload: bytes = b"") -> bytes:
    head = f"{method} {target} HTTP/1.1\r\n".encode() + b"".join(
        n + b": " + v + b"\r\n" for n, v in headers
    )
    return head + b"\r\n" + payload


def chunked(body: bytes, size: int = 7) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def callback_target(session_id: str, tenant: str | None = None) -> str:
    query = {"session_id": session_id} | ({"tenant": tenant} if tenant else {})
    return f"/_beyond/agent?{urlencode(query)}"


def callback_request(
    target: str,
    *authorization: bytes,
    body: bytes = JOB_BODY,
    extra: Headers | None = None,
) -> bytes:
    """A POST callback as the sandbox sends one (aiohttp's header set), one request per socket."""
    headers: Headers = [(b"Host", b"fleet.example")]
    headers += [(b"Authorization", a) for a in authorization]
    headers += [
        (b"Content-Type", b"application/json"),
        (b"Accept", b"*/*"),
        (b"User-Agent", b"fleet-sim-sandbox"),
        *(extra or []),
        (b"Content-Length", str(len(body)).encode()),
        (b"Connection", b"close"),
    ]
    return request_bytes("POST", target, headers, body)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    headers: Headers
    seconds: float

    def header(self, name: str) -> list[bytes]:
        wanted = name.lower().encode()
        return [v for n, v in self.headers if n.lower() == wanted]


async def send_raw(url: str, data: bytes, *, timeout_s: float = 40.0) -> Answer:
    parts = urlsplit(url)
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            wire = await read_wire(reader, response=True)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return Answer(wire.status, wire.body, wire.headers, time.monotonic() - started)


async def send_together(url: str, requests: Sequence[bytes]) -> tuple[list[Answer], float]:
    """Connect every request first, then write them all at once: returns the answers and how
    long the writes took, so a grader knows whether they all fell inside one second."""
    parts = urlsplit(url)
    connections = [await asyncio.open_connection(parts.hostname, parts.port) for _ in requests]
    try:
        began = time.monotonic()
        for (_, writer), data in zip(connections, requests, strict=True):
            writer.write(data)
        await asyncio.gather(*(writer.drain() for _, writer in connections))
        spread = time.monotonic() - began

        async def answer(reader: asyncio.StreamReader) -> Answer:
            async with asyncio.timeout(40):
                wire = await read_wire(reader, response=True)
            return Answer(wire.status, wire.body, wire.headers, time.monotonic() - began)

        answers = await asyncio.gather(*(answer(reader) for reader, _ in connections))
    finally:
        for _, writer in connections:
            writer.close()
    return list(answers), spread


# -- a stand-in replica, and a second edge in front of it ------------------------------------------


@dataclass(slots=True)
class Received:
    wire: Wire
    at: float
    cancelled_at: float | None = None  # the edge went away while the request was unanswered


Script = Callable[[Wire], "tuple[int, bytes] | None"]  # None: never answer


class Backend:
    """A replica stand-in on 127.0.0.1 that records each request's exact head and body and
    answers as ``script`` says. It runs its own event loop in a thread, so the scenario's
    blocking code and the edge process can both talk to it."""

    HANG_S: Final = 60.0

    def __init__(self, script: Script) -> None:
        self.script = script
        self._received: list[Received] = []
        self._mutex = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="backend", daemon=True)
        self._ready = threading.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self.url = ""

    @property
    def received(self) -> list[Received]:
        with self._mutex:
            return list(self._received)

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(10) or self._server is None:
            raise SetupFailed("the stand-in replica did not start")
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            for _ in range(10_000):  # the edge keeps connections alive across requests
                try:
                    wire = await read_wire(reader, response=False)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                seen = Received(wire, time.time())
                with self._mutex:
                    self._received.append(seen)
                answer = self.script(wire)
                if answer is None:
                    await self._hold(reader, seen)
                    return
                status, body = answer
                retry = b"Retry-After: 1\r\n" if status == 503 else b""
                writer.write(
                    b"HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n%s\r\n%s"
                    % (status, http.HTTPStatus(status).phrase.encode(), len(body), retry, body)
                )
                await writer.drain()
        except ConnectionError:
            return
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _hold(self, reader: asyncio.StreamReader, seen: Received) -> None:
        """Never answer; note when the edge gives up on the request (its end of the socket)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.HANG_S):
                with contextlib.suppress(ConnectionError):
                    await reader.read(1)
                seen.cancelled_at = time.time()


@contextlib.contextmanager
def edge_in_front_of(
    ctx: Context, backend: Backend, **options: float
) -> Iterator[tuple[str, str | None]]:
    """A second, real edge process whose slice a07 is just ``backend``: (url, metrics url)."""
    url = backend.start()
    lines = ["[edge]", *(f"{k} = {float(v)!r}" for k, v in options.items()), ""]
    lines += ["[[slice]]", 'name = "a07"', f'replicas = [{{ name = "rec", url = "{url}" }}]', ""]
    path = ctx.out_dir / "edge-rec.toml"
    path.write_text("\n".join(lines))
    edge = None
    try:
        edge = ctx.local.fleet.edge(
            path, name="edge-rec", metrics=f"127.0.0.1:{free_port()}", listen="127.0.0.1:0"
        )
        yield edge.url, edge.metrics_url
    finally:
        if edge is not None:
            edge.proc.signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                edge.proc.wait(10)
        backend.stop()


# -- fleet-side helpers -------------------------------------------------------------------------


def notify_key(ctx: Context) -> NotifyKey:
    return NotifyKey(read_key_file(ctx.fleet.keys_dir / "notify.key", what="notify key"))


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def scrape(url: str | None) -> str:
    if url is None:
        return ""
    try:
        return httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return ""


def replica_metric(
    ctx: Context, name: str, *, slice_name: str | None = None, **labels: str
) -> float:
    return sum(
        metric(scrape(r.metrics_url), name, **labels)
        for s, r in ctx.fleet.replicas.values()
        if slice_name is None or s == slice_name
    )


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


# == E1-E7: the edge and callbacks ================================================================


@scenario(
    "job-ended-classified-exactly", claims=("job-ended-classified-exactly",), substrates=ANYWHERE
)
def classified_exactly(ctx: Context) -> list[ClaimResult]:
    """E1 on the wire: exactly one 'Bearer bjn_v1.' header is a callback and is forwarded; two
    headers, a tab, no space or a non-UTF-8 value is refused 400 by the edge and forwarded
    nowhere; a token on GET events or a WebSocket upgrade is refused 403; a repeated session_id
    is refused 400."""
    session = ctx.sessions(1)[0]
    sid, tenant = session.session_id, session.tenant
    token = notify_key(ctx).mint(tenant, sid).encode()
    target = callback_target(sid, tenant)
    ws_headers: Headers = [
        (b"Host", b"fleet.example"),
        (b"Authorization", b"Bearer " + token),
        (b"Upgrade", b"websocket"),
        (b"Connection", b"Upgrade"),
        (b"Sec-WebSocket-Key", b"dGhlIHNhbXBsZSBub25jZQ=="),
        (b"Sec-WebSocket-Version", b"13"),
    ]
    get_headers: Headers = [
        (b"Host", b"fleet.example"),
        (b"Authorization", b"Bearer " + token),
        (b"Connection", b"close"),
    ]
    refused: dict[str, tuple[bytes, int]] = {
        "two Authorization headers": (
            callback_request(target, b"Bearer " + token, b"Bearer " + token),
            400,
        ),
        "Bearer and Basic": (
            callback_request(target, b"Bearer " + token, b"Basic dXNlcjpwdw=="),
            400,
        ),
        "a tab": (callback_request(target, b"Bearer\t" + token), 400),
        "a space then a tab": (callback_request(target, b"Bearer \t" + token), 400),
        "no space": (callback_request(target, b"Bearer" + token), 400),
        "not UTF-8": (callback_request(target, b"Bearer " + token + b"\xff\xfe"), 400),
        "on GET events": (
            request_bytes("GET", f"/_beyond/agent/events?session_id={sid}", get_headers),
            403,
        ),
        "on a WebSocket upgrade": (
            request_bytes("GET", f"/_beyond/agent?session_id={sid}", ws_headers),
            403,
        ),
        "session_id twice": (
            callback_request(
                f"/_beyond/agent?session_id={sid}&tenant={tenant}&session_id={sid}",
                b"Bearer " + token,
            ),
            400,
        ),
        "session_id twice, once encoded": (
            callback_request(
                f"/_beyond/agent?session_id={sid}&session%5Fid={sid}", b"Bearer " + token
            ),
            400,
        ),
    }
    edge_metrics = ctx.fleet.edge_metrics_url

    def replica_side() -> float:
        return replica_metric(ctx, "agent_refusals_total") + replica_metric(
            ctx, "agent_job_callbacks_total"
        )

    before_replicas = replica_side()
    before_rejected = metric(scrape(edge_metrics), "edge_requests_total", outcome="rejected")
    errors: list[str] = []
    answers: dict[str, int] = {}
    for name, (data, expected) in refused.items():
        got = ctx.run(send_raw(ctx.edge, data))
        answers[name] = got.status
        if got.status != expected:
            errors.append(f"{name}: the edge answered {got.status}, not {expected}")
        if token in got.body or token[7:] in got.body:
            errors.append(f"{name}: the answer quotes the token")
    rejected = metric(scrape(edge_metrics), "edge_requests_total", outcome="rejected")
    reached_replicas = replica_side() - before_replicas
    if reached_replicas:
        errors.append(f"{reached_replicas:g} refused requests reached a replica anyway")
    if edge_metrics and rejected - before_rejected != len(refused):
        errors.append(
            f"the edge counted {rejected - before_rejected:g} rejections for {len(refused)}"
        )
    # The one well-formed callback: forwarded, and since nobody holds the session, the replica
    # that gets it hands the report to the control plane.
    good = ctx.run(send_raw(ctx.edge, callback_request(target, b"bearer   " + token)))
    answers["exactly one Bearer header"] = good.status
    handed = lifecycle_events(ctx, "job_ended", sid)
    if good.status not in (200, 202):
        errors.append(f"a well-formed callback was answered {good.status}: {good.body[:200]!r}")
    elif good.status == 202 and len(handed) != 1:
        errors.append(f"handed off, but the control plane holds {len(handed)} reports")
    figures = {
        "answers": answers,
        "refused_cases": len(refused),
        "refused_requests_reaching_a_replica": reached_replicas,
        "edge_rejections_counted": rejected - before_rejected,
        "well_formed_answer": good.body.decode("utf-8", "replace")[:200],
        "control_plane_reports": len(handed),
    }
    return [verdict("job-ended-classified-exactly", errors, figures)]


@scenario(
    "job-ended-forwarded-unchanged",
    claims=("job-ended-forwarded-unchanged", "real-callbacks-verify-at-the-replica"),
    substrates=LOCAL,
)
def forwarded_unchanged(ctx: Context) -> list[ClaimResult]:
    """E2: what a replica receives is what the sandbox sent (target, every end-to-end header,
    Content-Length or Transfer-Encoding, the body bytes), recorded by a stand-in replica behind a
    second edge; and on the real fleet a real job's callback still verifies at the replica."""
    sid = f"a07-s1.{secrets.token_urlsafe(9)}"
    token = notify_key(ctx).mint("t-forward", sid).encode()
    target = callback_target(sid, "t-forward")
    body = json.dumps(
        {"type": "job_ended", "job_id": "j" + "0" * 16, "status": "exited", "exit_code": 0},
        separators=(", ", ": "),
    ).encode()
    sent: dict[str, tuple[str, Headers, bytes]] = {
        "content-length": (
            target,
            [
                (b"Host", b"sandbox-callbacks.example"),
                (b"Authorization", b"Bearer  " + token),
                (b"Content-Type", b"application/json"),
                (b"X-Sandbox-Id", b"sbx-7"),
                (b"x-beyond-grant", b"not-for-the-edge"),
                (b"Accept-Encoding", b"gzip, deflate"),
                (b"Content-Length", str(len(body)).encode()),
                (b"Connection", b"close"),
            ],
            body,
        ),
        "chunked": (
            target,
            [
                (b"Host", b"sandbox-callbacks.example"),
                (b"Authorization", b"BEARER " + token),
                (b"Content-Type", b"application/json"),
                (b"Transfer-Encoding", b"chunked"),
                (b"Connection", b"close"),
            ],
            body,
        ),
    }
    backend = Backend(lambda wire: (200, b"recorded"))
    errors: list[str] = []
    compared: dict[str, Any] = {}
    with edge_in_front_of(ctx, backend) as (edge_url, _):
        for name, (path, headers, payload) in sent.items():
            framed = chunked(payload) if name == "chunked" else payload
            got = ctx.run(send_raw(edge_url, request_bytes("POST", path, headers, framed)))
            if (got.status, got.body) != (200, b"recorded"):
                errors.append(f"{name}: the caller got {got.status} {got.body[:100]!r}")
        seen = backend.received
    if len(seen) != len(sent):
        errors.append(f"the stand-in replica saw {len(seen)} requests for {len(sent)} sent")
    for (name, (path, headers, payload)), got_wire in zip(sent.items(), seen, strict=False):
        wire = got_wire.wire
        want = [(n, v) for n, v in headers if n.lower() not in HOP_BY_HOP]
        have = [(n, v) for n, v in wire.headers if n.lower() not in HOP_BY_HOP]
        same_headers = [(n.lower(), v) for n, v in want] == [(n.lower(), v) for n, v in have]
        compared[name] = {
            "target_unchanged": wire.target == path,
            "headers_unchanged": same_headers,
            "body_unchanged": wire.body == payload,
            "content_length": [v.decode() for v in wire.header("content-length")],
            "transfer_encoding": [v.decode() for v in wire.header("transfer-encoding")],
        }
        if wire.target != path:
            errors.append(f"{name}: the target became {wire.target!r}")
        if not same_headers:
            missing = [n.decode() for n, v in want if (n, v) not in have]
            added = [n.decode() for n, v in have if (n, v) not in want]
            errors.append(f"{name}: headers changed (missing {missing}, added {added})")
        if wire.body != payload:
            errors.append(f"{name}: the body changed")
        if name == "chunked" and (
            wire.header("transfer-encoding") != [b"chunked"] or wire.header("content-length")
        ):
            errors.append("chunked: the framing changed on the way")
    claims = [
        verdict(
            "job-ended-forwarded-unchanged",
            errors,
            {"requests": len(sent), "compared": compared},
        )
    ]
    # On the real fleet, through the real edge: a job's real callback verifies at the replica
    # (a changed byte of the token or of the query would be a 401 or 403), and the edge checks
    # nothing itself: a forged token goes through and the replica refuses it.
    session = ctx.sessions(1)[0]
    job = start_job(ctx, session, "sleep 0.5; echo forwarded")
    telling = wait_told(ctx, session, job)
    forged = NotifyKey(bytes(32)).mint(session.tenant, session.session_id).encode()
    refused = ctx.run(
        send_raw(
            ctx.edge,
            callback_request(
                callback_target(session.session_id, session.tenant), b"Bearer " + forged
            ),
        )
    )
    real_errors = []
    if not telling.path or telling.path[-1] not in (200, 202):
        real_errors.append(f"the real callback's attempts were answered {list(telling.path)}")
    if refused.status != 401:
        real_errors.append(f"a forged token came back {refused.status}, not the replica's 401")
    claims.append(
        with_errors(
            told_exactly_once(
                "real-callbacks-verify-at-the-replica",
                [telling],
                {"forged_token_answer": refused.status},
            ),
            real_errors,
        )
    )
    return claims


@scenario(
    "job-ended-routed-as-any-request",
    claims=("job-ended-routed-as-any-request", *STANDARD),
    substrates=LOCAL,
)
def routed_as_any_request(ctx: Context) -> list[ClaimResult]:
    """E3: with the owner drained, two sessions open on the next replica of their walk. One job
    ends while the owner is down: its callback walks to the holder. The other ends once the
    owner is back: the owner does not hold the session, hands the report off, and the control
    plane's wake reaches the holder. Either way the model is told once."""
    first, second = sessions_with_one_owner(ctx, 2)
    owner = ctx.owner(first.session_id)
    ctx.faults.drain(owner)
    walked_job = start_job(ctx, first, held_job("end", "walked"))
    handed_job = start_job(ctx, second, held_job("end", "handed-off"))
    release(ctx, first)
    walked = wait_told(ctx, first, walked_job, settle_s=0)
    ctx.faults.restart(owner)
    ctx.faults.wait_ready(owner)
    release(ctx, second)
    handed = wait_told(ctx, second, handed_job)
    walked = recount(ctx, first, walked)
    holders = committed_holder(ctx, [first, second])
    claim = told_exactly_once(
        "job-ended-routed-as-any-request",
        [walked, handed],
        {
            "owner": owner,
            "holders": holders,
            "reports_handed_to_the_control_plane": len(
                lifecycle_events(ctx, "job_ended", second.session_id)
            ),
        },
    )
    premise = [f"{sid} is held by its owner" for sid, h in holders.items() if h == owner]
    return [with_errors(claim, premise), *ctx.standard_claims([first, second])]


def committed_holder(ctx: Context, sessions: Sequence[Session]) -> dict[str, str | None]:
    """Who owns the newest segment of each session."""
    found, _ = ctx.histories(sessions)
    return {sid: (h.segments[-1].owner if h.segments else None) for sid, h in found.items()}


@scenario(
    "job-ended-answers-within-25s", claims=("job-ended-answers-within-25s",), substrates=LOCAL
)
def answers_within_budget(ctx: Context) -> list[ClaimResult]:
    """E4: a replica that never answers a callback: the edge answers 503 within its callback
    budget (at most 25 s; a shorter one in --quick) and cancels the request upstream, so the
    replica sees it go away."""
    budget = 3.0 if ctx.quick else CALLBACK_BUDGET_S
    backend = Backend(lambda wire: None)
    sid = f"a07-s1.{secrets.token_urlsafe(9)}"
    token = notify_key(ctx).mint("t-hang", sid).encode()
    errors = []
    with edge_in_front_of(ctx, backend, callback_budget_s=budget) as (edge_url, _):
        got = ctx.run(
            send_raw(edge_url, callback_request(callback_target(sid), b"Bearer " + token))
        )
        answered_at = time.time()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(r.cancelled_at for r in backend.received):
            time.sleep(0.05)
        seen = backend.received
    if got.status != 503:
        errors.append(f"the edge answered {got.status}, not 503")
    if not got.header("retry-after"):
        errors.append("the 503 carries no Retry-After")
    if got.seconds > budget + 1.0:
        errors.append(f"the answer took {got.seconds:.2f} s for a {budget:g} s budget")
    if got.seconds < budget - 0.05:
        errors.append(f"the edge gave up after {got.seconds:.2f} s, before its {budget:g} s")
    cancelled = [r.cancelled_at for r in seen if r.cancelled_at is not None]
    if not seen:
        errors.append("the callback never reached the stand-in replica")
    elif not cancelled:
        errors.append("the stand-in replica still held the request 5 s after the edge's 503")
    # Nobody can configure the edge past 25 s, and 25 s is what it does when not told.
    default_budget = EdgeOptions().callback_budget_s
    try:
        parse_config_text(
            '[edge]\ncallback_budget_s = 26.0\n[[slice]]\nname = "a07"\n'
            'replicas = [{ name = "r", url = "http://127.0.0.1:9" }]\n'
        )
        errors.append("an edge config with callback_budget_s = 26 was accepted")
    except ConfigError:
        pass
    if default_budget > CALLBACK_BUDGET_S:
        errors.append(f"the default callback budget is {default_budget:g} s")
    figures = {
        "budget_s": budget,
        "default_budget_s": default_budget,
        "status": got.status,
        "answered_after_s": round(got.seconds, 3),
        "requests_seen_upstream": len(seen),
        "upstream_cancelled_after_answer_s": (
            round(max(0.0, cancelled[0] - answered_at), 3) if cancelled else None
        ),
    }
    return [verdict("job-ended-answers-within-25s", errors, figures)]


E5_STATUSES: Final = (200, 400, 401, 403, 404, 410, 411, 413, 503)


@scenario(
    "job-ended-status-passes-through",
    claims=("job-ended-status-passes-through", "real-replica-answers-pass-through"),
    substrates=LOCAL,
)
def status_passes_through(ctx: Context) -> list[ClaimResult]:
    """E5: each status a replica answers a callback with (200, 400, 401, 403, 404, 410, 411, 413,
    503) reaches the sandbox unchanged, with the replica's body; and the real replicas'
    refusals come back through the real edge exactly as the replica gives them directly."""
    by_session = {f"a07-s1.st{status}x{secrets.token_hex(4)}": status for status in E5_STATUSES}

    def script(wire: Wire) -> tuple[int, bytes]:
        sid = wire.target.partition("session_id=")[2].partition("&")[0]
        status = by_session.get(sid, 500)
        return status, f"replica says {status}".encode()

    backend = Backend(script)
    key = notify_key(ctx)
    errors = []
    answers: dict[int, dict[str, Any]] = {}
    # The 503 is retried and walked (E3) until the callback budget; keep that short here.
    with edge_in_front_of(ctx, backend, callback_budget_s=2.0) as (edge_url, _):
        for sid, status in by_session.items():
            token = key.mint("t-status", sid).encode()
            got = ctx.run(
                send_raw(edge_url, callback_request(callback_target(sid), b"Bearer " + token))
            )
            answers[status] = {"got": got.status, "seconds": round(got.seconds, 3)}
            if got.status != status:
                errors.append(f"the replica answered {status}; the sandbox got {got.status}")
            elif status != 503 and got.body != f"replica says {status}".encode():
                errors.append(f"{status}: the replica's body was not passed on")
            elif status == 503 and not got.header("retry-after"):
                errors.append("503 came back without Retry-After")
        seen = backend.received
    tries = {
        status: sum(1 for r in seen if sid in r.wire.target) for sid, status in by_session.items()
    }
    for status, count in tries.items():
        if status != 503 and count != 1:
            errors.append(f"{status}: the replica was asked {count} times")
    claims = [
        verdict(
            "job-ended-status-passes-through",
            errors,
            {"answers": answers, "upstream_attempts": tries},
        )
    ]
    # The real replicas: each refusal through the edge equals the refusal got directly.
    session = ctx.sessions(1)[0]
    sid, tenant = session.session_id, session.tenant
    good = key.mint(tenant, sid).encode()
    other = key.mint(tenant, f"{sid[:-1]}{'A' if sid[-1] != 'A' else 'B'}").encode()
    forged = NotifyKey(bytes(32)).mint(tenant, sid).encode()
    target = callback_target(sid, tenant)
    cases = {
        "forged token": callback_request(target, b"Bearer " + forged),
        "token for another session": callback_request(target, b"Bearer " + other),
        "body that is not a job_ended": callback_request(
            target, b"Bearer " + good, body=b'{"type":"prompt"}'
        ),
        "body over 64 KiB": callback_request(
            target, b"Bearer " + good, body=b'{"type":"job_ended","pad":"' + b"x" * 70_000 + b'"}'
        ),
    }
    owner_url = ctx.fleet.replicas[ctx.owner(sid)][1].url
    real: dict[str, dict[str, int]] = {}
    real_errors = []
    for name, data in cases.items():
        direct = ctx.run(send_raw(owner_url, data))
        through = ctx.run(send_raw(ctx.edge, data))
        real[name] = {"direct": direct.status, "through_the_edge": through.status}
        if (through.status, through.body) != (direct.status, direct.body):
            real_errors.append(
                f"{name}: the replica answers {direct.status}, the edge passed on {through.status}"
            )
        if direct.status < 400:
            real_errors.append(f"{name}: the replica accepted it ({direct.status})")
    claims.append(verdict("real-replica-answers-pass-through", real_errors, {"answers": real}))
    return claims


@scenario(
    "job-ended-rate-limited-per-session",
    claims=("job-ended-rate-limited-per-session",),
    substrates=ANYWHERE,
)
def rate_limited_per_session(ctx: Context) -> list[ClaimResult]:
    """E6: 30 callbacks for one session land on the real edge inside a second: 20 are forwarded
    to the holder and the excess is answered 429 by the edge; another session's callback in the
    same burst is not limited."""
    session, bystander = ctx.sessions(2)
    prompt(ctx, session, "open the session")  # held, so callbacks end in a reconcile
    key = notify_key(ctx)
    mine = callback_request(
        callback_target(session.session_id, session.tenant),
        b"Bearer " + key.mint(session.tenant, session.session_id).encode(),
    )
    theirs = callback_request(
        callback_target(bystander.session_id, bystander.tenant),
        b"Bearer " + key.mint(bystander.tenant, bystander.session_id).encode(),
    )
    edge_metrics = ctx.fleet.edge_metrics_url
    before = metric(scrape(edge_metrics), "edge_callbacks_rate_limited_total", scope="session")
    answers, spread = ctx.run(send_together(ctx.edge, [mine] * 30 + [theirs]))
    after = metric(scrape(edge_metrics), "edge_callbacks_rate_limited_total", scope="session")
    statuses = [a.status for a in answers[:30]]
    limited = [a for a in answers[:30] if a.status == 429]
    figures = {
        "sent": 30,
        "writes_took_s": round(spread, 3),
        "answered_429": len(limited),
        "forwarded_answers": sorted({s for s in statuses if s != 429}),
        "bystander_answer": answers[30].status,
        "edge_counted_session_limit": after - before,
    }
    errors = []
    if spread >= 0.5:
        # All of them must have arrived inside one second for the count to be exact.
        return [verdict("job-ended-rate-limited-per-session", [], figures, unknown=True)]
    if len(limited) != 10:
        errors.append(f"{len(limited)} of 30 callbacks were answered 429, not 10")
    if any(not a.header("retry-after") for a in limited):
        errors.append("a 429 carries no Retry-After")
    if any(s not in (200, 202, 429) for s in statuses):
        errors.append(f"forwarded callbacks were answered {sorted(set(statuses))}")
    if answers[30].status == 429:
        errors.append("another session's callback was limited too")
    if edge_metrics and after - before != len(limited):
        errors.append(f"the edge counted {after - before:g} session limits")
    return [verdict("job-ended-rate-limited-per-session", errors, figures)]


def tokens_in_memory(pid: int, limit_bytes: int = 2 << 30) -> tuple[set[bytes], str]:
    """Every notify-token-shaped string in a process's writable memory (Linux /proc)."""
    found: set[bytes] = set()
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError as exc:
        return found, f"cannot read the process's memory: {exc.strerror}"
    scanned = 0
    step, overlap = 8 << 20, 4096
    try:
        for line in maps:
            fields = line.split()
            span, perms = fields[0], fields[1]
            if "r" not in perms or "w" not in perms:
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            offset = start
            while offset < end and scanned < limit_bytes:
                size = min(step, end - offset)
                try:
                    data = os.pread(fd, size + min(overlap, end - offset - size), offset)
                except OSError:
                    break
                found.update(TOKEN_BYTES.findall(data))
                scanned += size
                offset += size
    finally:
        os.close(fd)
    return found, ""


@scenario(
    "job-ended-token-never-logged",
    claims=("job-ended-token-never-logged", "no-plaintext-on-the-shard"),
    substrates=LOCAL,
)
def token_never_logged(ctx: Context) -> list[ClaimResult]:
    """E7: after real jobs' callbacks, and a token of our own sent well-formed and malformed
    through the edge, no log, journal, state or shard file of the fleet holds any token the
    sandbox was given (read from the sandbox's memory), and the shard holds no plaintext."""
    sessions = ctx.sessions(2)
    canaries = {f"PLAINTEXT-{secrets.token_hex(6)}", f"JOBOUTPUT-{secrets.token_hex(6)}"}
    said, printed = sorted(canaries)[1], sorted(canaries)[0]
    jobs = []
    for s in sessions:
        job = start_job(ctx, s, f"echo {printed}; sleep 0.5")
        jobs.append((s, job))
        prompt(ctx, s, f"read: {job} 0\n{said}")
    tellings = [wait_told(ctx, s, j, settle_s=0) for s, j in jobs]
    session = sessions[0]
    mine = notify_key(ctx).mint(session.tenant, session.session_id).encode()
    target = callback_target(session.session_id, session.tenant)
    for data in (
        callback_request(target, b"Bearer " + mine),
        callback_request(target, b"Bearer\t" + mine),
        callback_request(target, b"Bearer " + mine, b"Bearer " + mine),
        callback_request(target, b"Bearer " + mine + b"\x01"),  # unparseable: quoted by aiohttp
        request_bytes(
            "GET",
            f"/_beyond/agent/events?session_id={session.session_id}",
            [(b"Host", b"x"), (b"Authorization", b"Bearer " + mine), (b"Connection", b"close")],
        ),
    ):
        with contextlib.suppress(OSError, ValueError, asyncio.IncompleteReadError):
            ctx.run(send_raw(ctx.edge, data, timeout_s=30))
    wanted = {s.session_id for s in sessions}
    key = notify_key(ctx)
    shaped, problem = tokens_in_memory(ctx.local.fleet.sandbox.proc.proc.pid)
    given: set[bytes] = set()
    for candidate in shaped:
        with contextlib.suppress(NotifyTokenError, UnicodeDecodeError):
            if key.verify(candidate.decode()).session_id in wanted:
                given.add(candidate)
    # Stop everything first, so whatever a process writes on its way out is scanned too.
    ctx.fleet.stop(drain_timeout_s=20)
    needles = {t: t for t in given | {mine}}
    needles |= {t[len(b"bjn_v1.") :]: t for t in list(needles)}
    shard_roots = [
        Path(ctx.substrate.backing(shard)) for shards in SLICES.values() for shard in shards
    ]
    leaks: list[str] = []
    plaintext: list[str] = []
    files = scanned_bytes = 0
    for path in sorted(ctx.out_dir.rglob("*")):
        if "mnt" in path.relative_to(ctx.out_dir).parts[:1] or not path.is_file():
            continue  # leasefs mounts show the backing directory a second time
        if path.is_symlink():
            continue
        data = path.read_bytes()
        files += 1
        scanned_bytes += len(data)
        for needle in needles:
            if needle in data:
                leaks.append(f"{path.relative_to(ctx.out_dir)} holds a notify token")
                break
        if any(root in path.parents for root in shard_roots):
            plaintext += [
                f"{path.relative_to(ctx.out_dir)} holds {c[:9]} in plaintext"
                for c in canaries
                if c.encode() in data
            ]
    figures: dict[str, Any] = {
        "files_scanned": files,
        "bytes_scanned": scanned_bytes,
        "tokens_from_the_sandbox": len(given),
        "tokens_minted_here": 1,
        "jobs": len(jobs),
        "jobs_told_once": sum(1 for t in tellings if t.told == 1),
    }
    if problem:
        figures["memory"] = problem
    token_claim = verdict(
        "job-ended-token-never-logged",
        leaks,
        figures,
        unknown=len(given) < len(jobs),  # not every real token was found to look for
    )
    return [
        token_claim,
        verdict("no-plaintext-on-the-shard", plaintext, {"canaries": len(canaries)}),
    ]


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
    "Backend",
    "Read",
    "Telling",
    "Wire",
    "callback_request",
    "job_notices",
    "job_reads",
    "read_wire",
    "send_raw",
    "told_exactly_once",
]
