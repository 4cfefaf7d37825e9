"""The edge's fast lane: small POST commands served straight off the socket.

Commands (``POST /_beyond/agent?session_id=...`` with a JSON body) are most of what an edge
carries, and each is small. aiohttp's server spends more per request than the proxying itself
(request and response objects, a task, header re-encoding), so every client connection starts
on :class:`FastConnection`, which reads requests itself and serves the ones it can prove are
plain commands:

- ``POST <path> HTTP/1.1`` with a printable-ASCII request-target, classified (by the same
  :func:`edge.core.classify.classify` as everything else) as a command;
- every header line in canonical form (a token, a colon, optional spaces, a printable-ASCII
  value with no trailing space): the form on which every HTTP parser agrees byte for byte, so
  the edge cannot read a request differently from the replica;
- exactly one ``Content-Length`` within the body limit, and no ``Transfer-Encoding``,
  ``Expect`` or ``Upgrade``.

Anything else (a WebSocket upgrade, an event stream, a callback, a refused or odd request, a
head over the limit) hands the connection, with every byte read so far, to aiohttp's request
handler for the rest of its life, where the full rules apply. A hand-over happens only between
requests, so nothing is ever answered twice or out of order.

Each distinct head is read once: the lane remembers what ``read_command`` made of it
(``edge.core.memo``), since a client sends the same head request after request.

A served command is placed exactly as the aiohttp path places it (``HttpProxy.placed``); the
answer goes out in one write when it is complete (the usual case), else it is streamed with
backpressure. Keep-alive, ``Connection: close``, pipelining (one request at a time, in order),
client disconnects (they cancel the request, placement included) and draining all behave as on
the aiohttp path.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from typing import Any, Final, NamedTuple, Protocol, cast

from edge.aio.proxy import whole_body
from edge.core.accesslog import AccessRecord
from edge.core.answers import EdgeAnswer
from edge.core.classify import Classified, Kind, Routed, classify
from edge.core.config import EdgeOptions
from edge.core.headers import (
    CANONICAL_FIELD,
    REFRAMED,
    RawHeaders,
    declared_length,
    response_fields,
)
from edge.core.memo import Memo
from edge.core.metrics import Outcome
from edge.core.relay import relay_body
from edge.upstream.pool import UpstreamResponse
from wire.http import RETRY_AFTER_HEADER, RETRY_AFTER_S

log = logging.getLogger("edge.fast.fastpath")

# Same as aiohttp's keep-alive timeout, so both lanes treat idle clients alike.
KEEPALIVE_S: Final = 75.0

_METHOD: Final = b"POST "
# The whole head in one match: the request line, then header lines each in the canonical form
# (edge.core.headers.CANONICAL_FIELD).
# Every line must begin with its CRLF and no field can hold a CR or LF, so the match is linear
# and splitting the block on CRLF gives back exactly the lines it matched.
_HEAD: Final = re.compile(rb"POST (/[\x21-\x7e]*) HTTP/1\.1((?:\r\n" + CANONICAL_FIELD + rb")*)")
# Requests carrying these take the full path (body framing and handshakes are its business).
_NOT_FAST: Final = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_CONNECTION_OPTIONS: Final = frozenset({b"close", b"keep-alive"})
_RETRY_AFTER: Final = (RETRY_AFTER_HEADER.encode("ascii"), str(RETRY_AFTER_S).encode("ascii"))
# Fields parse_head looks at (the rest are passed on as they are).
_NOTED: Final = REFRAMED | _NOT_FAST | {b"host", b"authorization"}
_NO_BODY_STATUS: Final = frozenset({204, 304})
_HEADS: Final = 1024  # request heads remembered per lane (see edge.core.memo)
_HEAD_KEY_MAX: Final = 4096  # longer heads are read every time
_STATUS_LINES: Final = {
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode("ascii")) for s in HTTPStatus
}


class FastRequest(NamedTuple):
    """A command the fast lane may serve: its raw target, header pairs and body length, and
    the header lines to send on (built once, while parsing). A named tuple: one is made per
    request, and a frozen dataclass costs several times as much to build."""

    target: str
    raw_target: bytes  # the same, as received
    path: str  # the target without query or fragment, for the access log
    headers: tuple[tuple[bytes, bytes], ...]
    length: int
    close: bool  # the client sent Connection: close
    forward: bytes  # the fields a replica gets, as header lines (what request_head keeps)
    has_host: bool
    authorization: tuple[bytes, ...] = ()  # the Authorization values, in order

    def upstream(self, body: bytes, host: bytes | None) -> bytes:
        """The request for a replica, byte for byte what ``edge.core.headers.request_head`` makes
        of it plus the body; ``host`` is used only when the client sent no ``Host``."""
        host_line = b"" if self.has_host or host is None else b"Host: " + host + b"\r\n"
        return b"POST %b HTTP/1.1\r\n%b%bContent-Length: %d\r\n\r\n%b" % (
            self.raw_target,
            self.forward,
            host_line,
            len(body),
            body,
        )


def parse_head(head: bytes) -> FastRequest | None:
    """The request line and header block (without the blank line) of a plain command, or None
    when anything about it is not in the canonical form the fast lane serves."""
    matched = _HEAD.fullmatch(head)
    if matched is None:
        return None
    headers: list[tuple[bytes, bytes]] = []
    forward: list[bytes] = []
    length: int | None = None
    close = has_host = False
    authorization: list[bytes] = []
    block = matched.group(2)
    for raw in block.split(b"\r\n")[1:] if block else ():
        name, _, value = raw.partition(b":")
        value = value.lstrip(b" \t")
        lower = name.lower()
        headers.append((name, value))
        if lower not in _NOTED:
            forward.append(name + b": " + value)
            continue
        if lower == b"content-length":
            if length is not None or not value.isdigit() or len(value) > 15:
                return None
            length = int(value)
        elif lower in _NOT_FAST:
            return None
        elif lower == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")} - {b""}
            if not tokens <= _CONNECTION_OPTIONS:
                return None  # an upgrade, or fields named hop-by-hop: the full path's business
            close = close or b"close" in tokens
        elif lower == b"host":
            has_host = True
        elif lower == b"authorization":
            authorization.append(value)
        if lower not in REFRAMED:  # what request_head drops: hop-by-hop and old framing
            forward.append(name + b": " + value)
    if length is None:
        return None
    raw_target = matched.group(1)
    target = raw_target.decode("ascii")
    path = target.partition("?")[0].partition("#")[0]
    lines = b"\r\n".join(forward) + b"\r\n" if forward else b""
    return FastRequest(
        target,
        raw_target,
        path,
        tuple(headers),
        length,
        close,
        lines,
        has_host,
        tuple(authorization),
    )


def read_command(head: bytes) -> tuple[FastRequest, Classified] | None:
    """A head the fast lane might serve, with what ``classify`` makes of it (it reads only the
    target and the Authorization values, all in the head); None if ``parse_head`` declines it.
    A pure function of the bytes, so a lane remembers its answers (``FastLane.commands``)."""
    request = parse_head(head)
    if request is None:
        return None
    return request, classify("POST", request.target, request.headers)


def response_head(
    status: int,
    headers: RawHeaders,
    *,
    length: int | None,
    chunked: bool = False,
    close: bool = False,
) -> bytes:
    """A status line and header block for the client: the replica's fields minus hop-by-hop
    ones and its framing, then the edge's own framing."""
    line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status
    parts = [line, response_fields(headers)]
    if length is not None:
        parts.append(b"Content-Length: %d\r\n" % length)
    elif chunked:
        parts.append(b"Transfer-Encoding: chunked\r\n")
    if close:
        parts.append(b"Connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def edge_answer(status: int, text: str, *, retry_after: bool = False, close: bool = False) -> bytes:
    """A whole response made by the edge itself (plain text, never quoting the request)."""
    body = (text + "\n").encode("utf-8")
    fields = [(b"Content-Type", b"text/plain; charset=utf-8")]
    if retry_after:
        fields.append(_RETRY_AFTER)
    return response_head(status, fields, length=len(body), close=close) + body


Serve = Callable[[FastRequest, Routed, bytes, "FastConnection"], Coroutine[Any, Any, None]]
# Takes a command without a task when it can (see edge.fast.express): True if it did.
TryExpress = Callable[[FastRequest, Routed, bytes, "FastConnection"], bool]


class Job(Protocol):
    """The request a connection is busy with: a task, or an express exchange."""

    def cancel(self) -> Any: ...


class FastLane:
    """What every fast connection shares: how to serve a command, where to hand a connection
    over, the current limits, and the set of open connections (for draining)."""

    def __init__(
        self,
        serve: Serve,
        fallback: Callable[[], asyncio.Protocol],
        options: Callable[[], EdgeOptions],
        express: TryExpress,
    ) -> None:
        self.serve = serve
        self.express = express
        self.fallback = fallback
        self.options = options
        self.connections: set[FastConnection] = set()
        self.closing = False
        self.handed_over = 0  # connections given to aiohttp, for tests and debugging
        self.accepted = 0  # client connections, read at scrape time
        self._sweeper: asyncio.TimerHandle | None = None
        # Clients repeat their heads request after request: each is read once.
        self.commands = Memo(read_command, size=_HEADS, key_max=_HEAD_KEY_MAX)

    def connection(self) -> FastConnection:
        return FastConnection(self)

    def add(self, conn: FastConnection, loop: asyncio.AbstractEventLoop) -> None:
        self.connections.add(conn)
        self.accepted += 1
        if self._sweeper is None:
            self._sweeper = loop.call_later(_sweep_every(), self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close connections idle past the keep-alive time. One timer for the whole lane,
        rather than one re-armed per request on every connection."""
        self._sweeper = None
        limit = loop.time() - KEEPALIVE_S
        for conn in list(self.connections):
            if conn.job is None and conn.active_at < limit:
                conn.close()
        if self.connections:
            self._sweeper = loop.call_later(_sweep_every(), self._sweep, loop)

    def close_idle(self) -> None:
        """Draining: idle connections close now, busy ones after their current answer."""
        self.closing = True
        for conn in list(self.connections):
            if conn.job is None:
                conn.close()

    def abort_all(self) -> None:
        for conn in list(self.connections):
            conn.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


def _sweep_every() -> float:
    return min(5.0, KEEPALIVE_S / 4)


class FastConnection(asyncio.Protocol):
    """One client connection while it is on the fast lane."""

    def __init__(self, lane: FastLane) -> None:
        self.lane = lane
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.job: Job | None = None
        self.closing = False  # close once the current answer is out
        self.active_at = 0.0  # the loop's time of the last byte read or answer written
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = True
        self._writable: asyncio.Event | None = None  # set while writes may go on

    # --- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods. Both
        # loops set TCP_NODELAY on TCP transports themselves.
        self.transport = cast(asyncio.Transport, transport)
        loop = self._loop = asyncio.get_running_loop()
        self.active_at = loop.time()
        self.lane.add(self, loop)
        if self.lane.closing:
            self.close()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        assert self._loop is not None
        self.active_at = self._loop.time()
        if self.job is None:
            self._next()
        elif len(self.buffer) > self.lane.options().max_header_bytes and self._reading:
            # A pipelining client is far ahead of its answers: stop reading until we catch up.
            assert self.transport is not None
            self.transport.pause_reading()
            self._reading = False

    def eof_received(self) -> bool:
        # As aiohttp does: a client that half-closes has gone away, and its request with it.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lane.connections.discard(self)
        if self.job is not None:
            self.job.cancel()
        if self._writable is not None:
            self._writable.set()
        self.transport = None

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.Event()
        self._writable.clear()

    def resume_writing(self) -> None:
        if self._writable is not None:
            self._writable.set()

    # --- writing, for the serving code --------------------------------------------------------

    @property
    def must_close(self) -> bool:
        return self.closing or self.lane.closing

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        writable = self._writable
        if writable is not None and not writable.is_set():
            await writable.wait()
        if self.transport is None:
            raise ConnectionResetError("the client went away")

    def answer(self, answer: EdgeAnswer) -> None:
        """The edge's own answer, whichever path on this lane made it."""
        self.write(
            edge_answer(
                answer.status, answer.text, retry_after=answer.retry_after, close=self.must_close
            )
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # --- reading requests ----------------------------------------------------------------

    def _next(self) -> None:
        """Serve the next complete request in the buffer, hand the connection over, or wait."""
        buffer = self.buffer
        if not buffer:
            return
        # Waiting for the rest of a request counts as idle (see FastLane._sweep): a client that
        # stops sending mid-request is closed after the keep-alive time, as between requests.
        if not buffer.startswith(_METHOD):
            if len(buffer) >= len(_METHOD) or not _METHOD.startswith(buffer):
                self._hand_over()
            return
        options = self.lane.options()
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > options.max_header_bytes or b"\n\n" in buffer:
                self._hand_over()
            return
        command = self.lane.commands.get(bytes(buffer[:end]))
        if command is None:
            self._hand_over()
            return
        request, decision = command
        if (
            request.length > options.max_request_body_bytes
            or not isinstance(decision, Routed)
            or decision.kind is not Kind.COMMAND
        ):
            self._hand_over()
            return
        need = end + 4 + request.length
        if len(buffer) < need:
            return
        body = bytes(buffer[end + 4 : need])
        del buffer[:need]
        if request.close:
            self.closing = True
        if not self.lane.express(request, decision, body, self):
            self.adopt(self.lane.serve(request, decision, body, self))

    def adopt(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` as this connection's current request (it writes the answer)."""
        assert self._loop is not None
        task = self._loop.create_task(self._run(work))
        self.job = task
        return task

    def job_done(self) -> None:
        """An express exchange has answered: go on with the connection."""
        self.job = None
        self._after()

    async def _run(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except (asyncio.CancelledError, ConnectionError):
            # The client went away, or a drain ran out of grace: either way, no answer follows.
            self.abort()
            return
        except Exception:
            log.exception("a command on the fast lane failed")
            self.abort()
            return
        finally:
            self.job = None
        self._after()

    def _after(self) -> None:
        if self.transport is None:
            return
        if self.must_close:
            self.close()
            return
        if not self._reading:
            self.transport.resume_reading()
            self._reading = True
        assert self._loop is not None
        self.active_at = self._loop.time()
        if self.buffer:
            self._next()

    def _hand_over(self) -> None:
        """Give this connection, and every byte read so far, to aiohttp for good."""
        transport = self.transport
        if transport is None:
            return
        self.lane.connections.discard(self)
        self.lane.handed_over += 1
        protocol = self.lane.fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if not self._reading:
            transport.resume_reading()
        data = bytes(self.buffer)
        self.buffer.clear()
        self.transport = None
        if data:
            protocol.data_received(data)


async def relay_to_connection(
    conn: FastConnection,
    response: UpstreamResponse,
    options: EdgeOptions,
    record: AccessRecord,
) -> tuple[int, Outcome]:
    """Pass a placed answer on: in one write when it is (or soon is) complete, else streamed
    (``record`` learns the status as soon as the client has it). Returns the status the client
    saw and how the answer ended."""
    try:
        body = await whole_body(response, options)
        if isinstance(body, EdgeAnswer):
            conn.answer(body)
            return body.status, body.outcome
        status = response.status
        if body is not None:
            head = response_head(status, response.headers, length=len(body), close=conn.must_close)
            conn.write(head + body)
            return status, Outcome.DELIVERED
        return status, await _stream(conn, response, options.upstream_header_timeout_s, record)
    finally:
        response.release()


async def _stream(
    conn: FastConnection, response: UpstreamResponse, idle_s: float, record: AccessRecord
) -> Outcome:
    status = response.status
    length = declared_length(response.headers)
    bodiless = status in _NO_BODY_STATUS
    chunked = length is None and not bodiless
    conn.write(
        response_head(
            status,
            response.headers,
            length=length,
            chunked=chunked,
            close=conn.must_close,
        )
    )
    record.answered(status)
    return await relay_body(response, _ConnectionSink(conn, chunked), idle_s, "a command's answer")


class _ConnectionSink:
    """A fast connection as a :class:`edge.core.relay.BodySink`, framing chunks when the answer
    has no length."""

    __slots__ = ("chunked", "conn")

    def __init__(self, conn: FastConnection, chunked: bool) -> None:
        self.conn = conn
        self.chunked = chunked

    async def write(self, chunk: bytes) -> None:
        self.conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.chunked else chunk)
        await self.conn.drain()

    async def end(self) -> None:
        if self.chunked:
            self.conn.write(b"0\r\n\r\n")

    def abort(self) -> None:
        self.conn.abort()  # ending it normally would tell the client the body is whole
