"""Pooled keep-alive HTTP/1.1 connections to replicas: the edge's upstream transport for plain
requests (commands, callbacks, SSE). A WebSocket handshake takes a connection of its own, which
becomes the session's (``edge.upstream.wsconnect``).

Why not ``aiohttp.ClientSession`` here: on the reference 2-core box a pooled aiohttp client
request costs about 0.3 ms of CPU (URL objects, request/response objects, timers, tracing
hooks), twice the latency the edge is allowed to add in total. The edge already holds the exact
request bytes it wants to send, and needs from the answer only a status, the raw header pairs and
the body as it arrives, so this module does just that: one ``transport.write`` per request, the
response parsed by llhttp (``httptools``) in C, body chunks handed over as they arrive. An
answer that arrives whole in one read and in the plainest form (``plain_response``: canonical
header lines, one ``Content-Length``) is read without llhttp's per-field callbacks, exactly as
llhttp would read it (a fuzz harness checks that); a head seen before is not read again (the
pool remembers them, ``edge.core.memo``: a replica's heads repeat until its ``date`` turns over).

Rules it keeps:

* A connection is reused only after a complete response that allows keep-alive; anything left
  half-read is closed, never pooled.
* A pooled connection can have been closed by the replica while idle. If such a reused
  connection fails before any response byte, the request is sent once more on a fresh
  connection: nothing was answered, and the replica closes idle connections only between
  requests. Idle connections older than ``idle_ttl_s`` are not reused at all (keep it below the
  replicas' keep-alive timeout; uvicorn's default is 5 s).
* Refused, reset or closed before any response byte is :class:`UpstreamUnavailable` (the planner
  treats it as a 503); no headers within the header timeout is :class:`UpstreamTimeout`; bytes
  that are not HTTP, or a body that breaks off, are :class:`UpstreamBadResponse`.
* Cancelling a request or a read aborts the connection, so the replica sees the client go.
* A reader that falls behind pauses the socket (bounded buffering per response).
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, NamedTuple, cast
from urllib.parse import urlsplit

import httptools

from edge.core.errors import (
    UpstreamBadResponse,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from edge.core.headers import CANONICAL_FIELD, HOP_BY_HOP, RawHeaders
from edge.core.memo import Memo

_HIGH_WATER: Final = 256 * 1024
_LOW_WATER: Final = 64 * 1024
DEFAULT_IDLE_TTL_S: Final = 3.0
DEFAULT_MAX_IDLE: Final = 64

# A whole response in canonical form: status line, header lines, blank line (the body follows).
_CANONICAL_HEAD: Final = re.compile(
    rb"HTTP/1\.1 ([2-5][0-9][0-9]) [\x20-\x7e]*((?:\r\n" + CANONICAL_FIELD + rb")*)\r\n\r\n"
)
# Fields after which llhttp's reading of a response depends on more than Content-Length.
_NOT_PLAIN: Final = frozenset({b"transfer-encoding", b"connection", b"upgrade"})
_QUICK_BODY_LIMIT: Final = 64 * 1024
_HEADS: Final = 256  # plain response heads remembered per pool (see edge.core.memo)
_HEAD_KEY_MAX: Final = 4096  # longer heads are read every time


class PlainHead(NamedTuple):
    """The head of a plain response, as ``plain_head`` reads it."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    length: int  # the one Content-Length
    hop_free: bool  # no hop-by-hop field at all: the bytes can be passed on as they came


class Plain(NamedTuple):
    """A whole response read by ``plain_response``."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    hop_free: bool


def plain_head(head: bytes) -> PlainHead | None:
    """``head`` (through its blank line) read as llhttp reads it when it is in the plainest
    form (a 2xx-5xx status other than 204 and 304, canonical header lines, one
    ``Content-Length`` of at most ``_QUICK_BODY_LIMIT``, no ``Connection``,
    ``Transfer-Encoding`` or ``Upgrade``); None for anything else."""
    matched = _CANONICAL_HEAD.fullmatch(head)
    if matched is None:
        return None
    status = int(matched.group(1))
    if status == 204 or status == 304:
        return None
    headers: list[tuple[bytes, bytes]] = []
    length = -1
    hop_free = True
    block = matched.group(2)
    for raw in block.split(b"\r\n")[1:] if block else ():
        name, _, value = raw.partition(b":")
        value = value.lstrip(b" \t")
        lower = name.lower()
        if lower == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > 15:
                return None
            length = int(value)
        elif lower in HOP_BY_HOP:
            if lower in _NOT_PLAIN:
                return None
            hop_free = False
        headers.append((name, value))
    if length < 0 or length > _QUICK_BODY_LIMIT:
        return None
    return PlainHead(status, tuple(headers), length, hop_free)


def plain_response(
    data: bytes, read_head: Callable[[bytes], PlainHead | None] = plain_head
) -> Plain | None:
    """``data`` read as llhttp reads it when it is exactly one whole HTTP/1.1 response whose
    head ``read_head`` (``plain_head``, or a memo of it) finds plain, with the body its
    ``Content-Length`` announces and nothing after it, leaving the connection reusable; None
    for anything else, which llhttp then parses."""
    # A plain head holds no CR or LF but in its line ends, so its end is the first blank line.
    cut = data.find(b"\r\n\r\n") + 4
    if cut < 4:
        return None
    head = read_head(data[:cut])
    if head is None or len(data) - cut != head.length:
        return None
    return Plain(head.status, head.headers, data[cut:], head.hop_free)


@dataclass(frozen=True, slots=True)
class Origin:
    url: str
    host: str
    port: int
    tls: bool
    host_header: bytes

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"not an http(s)://host:port origin: {url!r}")
        host = parts.hostname
        netloc = f"[{host}]" if ":" in host else host
        return cls(
            url, host, parts.port, parts.scheme == "https", f"{netloc}:{parts.port}".encode()
        )


class UpstreamResponse:
    """One replica response: status and raw headers at once, the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_waiter",
        "headers",
        "keep_alive",
        "raw",
        "status",
    )

    def __init__(self, conn: UpstreamConnection, status: int, headers: RawHeaders) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        self.keep_alive = False
        # The whole message as received, when it may be passed on byte for byte (plain, whole,
        # no hop-by-hop field): the client gets what the replica sent.
        self.raw: bytes | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def complete(self) -> bool:
        """The whole body has arrived (it may still be unread)."""
        return self._done and self._error is None

    @property
    def failed(self) -> bool:
        """The body broke off (reading it would raise)."""
        return self._error is not None

    def body_if_complete(self) -> bytes | None:
        """The whole body, if it has all arrived; else ``None`` (nothing is consumed then)."""
        if not self.complete:
            return None
        chunks = self._chunks
        body = b"".join(chunks) if len(chunks) != 1 else chunks[0]
        chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return body

    async def read(self) -> bytes:
        """The next piece of the body as it arrived; ``b""`` once it is all read."""
        while True:
            chunks = self._chunks
            if chunks:
                chunk = chunks.popleft()
                self._buffered -= len(chunk)
                if self._buffered < _LOW_WATER:
                    self._conn.resume()
                return chunk
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            waiter = self._waiter = self._conn._loop.create_future()
            try:
                await waiter
            except BaseException:
                self._conn.abort()
                raise
            finally:
                self._waiter = None

    async def read_all(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes (more is :class:`UpstreamBadResponse`)."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.read():
            size += len(chunk)
            if size > limit:
                self.abort()
                raise UpstreamBadResponse(f"{self._conn.origin.url} sent a body over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with this response: pool the connection if it is clean, else close it."""
        self._conn.finish(self)

    def abort(self) -> None:
        self._conn.abort()

    # --- fed by the connection ---------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self._done = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if not self._done:
            self._error = error
            self._done = True
        self._wake()


class UpstreamConnection(asyncio.Protocol):
    """One TCP connection to a replica; at most one exchange at a time (no pipelining)."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.received = False
        self._busy = False
        self._head_only = False
        self._paused = False
        self._informational = False
        self._close_delimited = False
        self._header_list: list[tuple[bytes, bytes]] = []
        self._headers_waiter: asyncio.Future[UpstreamResponse] | None = None
        # Why the exchange ended before any answer (for a caller following it by ``listener``).
        self.failure: UpstreamError | None = None
        self._response: UpstreamResponse | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Called after every batch of bytes and when the connection is lost, for a caller that
        # follows the exchange with callbacks instead of awaiting it (edge.fast.express).
        self.listener: Callable[[], None] | None = None

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            # A replica has nothing to say between exchanges: this connection is unusable.
            self.abort()
            return
        if not self.received and not self._head_only:
            # The usual answer arrives whole in one read: take it without llhttp's callbacks,
            # leaving the parser where it was, between messages.
            whole = plain_response(data, self._pool.plain_heads.get)
            if whole is not None:
                self.received = True
                self._whole(whole, data)
                if self.listener is not None:
                    self.listener()
                return
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._error(UpstreamBadResponse(f"{self.origin.url} switched protocols unasked"))
        except httptools.HttpParserError as exc:
            self._error(UpstreamBadResponse(f"{self.origin.url} sent invalid HTTP: {exc}"))
        if self.listener is not None:
            self.listener()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self._busy and self._response is None and self.failure is None:
            self.failure = (
                UpstreamBadResponse(f"{self.origin.url} closed the connection mid-response")
                if self.received
                else UpstreamUnavailable(
                    f"{self.origin.url} closed the connection before answering"
                )
            )
        waiter = self._headers_waiter
        if waiter is not None and not waiter.done() and self.failure is not None:
            waiter.set_exception(self.failure)
        response = self._response
        if response is not None and not response._done:
            if self._close_delimited:
                response._finish(keep_alive=False)
            else:
                response._fail(UpstreamBadResponse(f"{self.origin.url} broke off the response"))
        if self.listener is not None:
            self.listener()

    def _whole(self, plain: Plain, data: bytes) -> None:
        """What llhttp's callbacks make of a plain response (see ``plain_response``)."""
        self._cancel_timer()
        response = UpstreamResponse(self, plain.status, plain.headers)
        if plain.hop_free:
            response.raw = data
        self._response = response
        self._close_delimited = False
        body = plain.body
        if body:
            response._chunks.append(body)
            response._buffered = len(body)
        response.keep_alive = True
        response._done = True
        waiter = self._headers_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    # --- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._response is not None:
            # A second answer to one request: the stream is out of step, so the connection is
            # unusable (raising here makes feed_data fail and the connection abort).
            raise UpstreamBadResponse(f"{self.origin.url} sent more than one response")
        self._header_list = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # 100 Continue, 103 Early Hints...: not the answer; llhttp goes on to the next one.
            self._informational = True
            return
        self._informational = False
        self._cancel_timer()
        response = UpstreamResponse(self, status, self._header_list)
        self._response = response
        self._close_delimited = self._is_close_delimited(status)
        waiter = self._headers_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(response)
        if self._head_only:
            # llhttp cannot be told a body is absent (HEAD): finish here, never reuse.
            response._finish(keep_alive=False)

    def on_body(self, body: bytes) -> None:
        response = self._response
        if response is not None and not self._head_only:
            response._feed(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        response = self._response
        if response is not None and not self._head_only:
            response._finish(keep_alive=self._parser.should_keep_alive())

    # --- used by the pool and the response -----------------------------------------------------

    def _is_close_delimited(self, status: int) -> bool:
        if status in (204, 304) or self._head_only:
            return False
        for name, value in self._header_list:
            lower = name.lower()
            if lower == b"content-length" or (
                lower == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                return False
        return True

    def send(
        self, data: bytes, header_timeout: float | None, head_only: bool
    ) -> asyncio.Future[UpstreamResponse]:
        """Start an exchange; the future has the response once its head is in."""
        waiter = self._headers_waiter = self._loop.create_future()
        self.start(data, header_timeout, head_only)
        return waiter

    def start(self, data: bytes, header_timeout: float | None, head_only: bool = False) -> None:
        """Start an exchange followed through ``listener``: ``response`` once its head is in,
        or ``failure``."""
        assert self.transport is not None
        self._busy = True
        self.received = False
        self._head_only = head_only
        self._response = None
        self.failure = None
        # The request first, the timer after: nothing can answer before this returns to the
        # loop, and the replica starts on it sooner.
        self.transport.write(data)
        if header_timeout is not None:
            self._timer = self._loop.call_later(header_timeout, self._timed_out, header_timeout)

    @property
    def response(self) -> UpstreamResponse | None:
        """The current exchange's response, once its head has arrived."""
        return self._response

    def _timed_out(self, after: float) -> None:
        self._timer = None
        self._error(UpstreamTimeout(f"{self.origin.url} sent no response headers in {after:g} s"))
        if self.listener is not None:
            self.listener()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _error(self, error: UpstreamError) -> None:
        if self._response is None and self.failure is None:
            self.failure = error
        waiter = self._headers_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        if self._response is not None:
            self._response._fail(error)
        self.abort()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self._cancel_timer()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()

    def finish(self, response: UpstreamResponse) -> None:
        if response is not self._response:
            return
        self._response = None
        self._headers_waiter = None
        self._busy = False
        self.listener = None
        if self.closed or not response.complete or not response.keep_alive:
            self.abort()
            return
        self.resume()
        self._pool._put(self)


class UpstreamPool:
    """Idle keep-alive connections per replica origin (newest first), created on demand."""

    def __init__(
        self, *, idle_ttl_s: float = DEFAULT_IDLE_TTL_S, max_idle: int = DEFAULT_MAX_IDLE
    ) -> None:
        self._idle_ttl_s = idle_ttl_s
        self._max_idle = max_idle
        self._idle: dict[str, list[UpstreamConnection]] = {}
        self._origins: dict[str, Origin] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        self.connects = 0  # connections opened, for tests and debugging
        # A replica's answers share their head until its date turns over: each is read once.
        self.plain_heads = Memo(plain_head, size=_HEADS, key_max=_HEAD_KEY_MAX)

    def origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin.parse(url)
        return origin

    async def request(
        self,
        url: str,
        data: bytes,
        *,
        connect_timeout: float,
        header_timeout: float | None,
        head_only: bool = False,
    ) -> UpstreamResponse:
        """Send ``data`` (a complete request: head and framed body) and await the response head.

        Raises :class:`UpstreamUnavailable`, :class:`UpstreamTimeout` or
        :class:`UpstreamBadResponse`; cancellation aborts the connection.
        """
        origin = self.origin(url)
        conn = self.idle_connection(url)
        if conn is not None:
            try:
                return await self._exchange(conn, data, header_timeout, head_only)
            except UpstreamUnavailable:
                # The replica closed this idle connection just as it was reused; nothing was
                # answered, so one more try on a new connection is not a retry of the request.
                pass
        conn = await self._connect(origin, connect_timeout)
        return await self._exchange(conn, data, header_timeout, head_only)

    async def _exchange(
        self, conn: UpstreamConnection, data: bytes, header_timeout: float | None, head_only: bool
    ) -> UpstreamResponse:
        waiter = conn.send(data, header_timeout, head_only)
        try:
            return await waiter
        except BaseException:
            conn.abort()
            raise

    def idle_connection(self, url: str) -> UpstreamConnection | None:
        """A pooled connection to ``url`` ready for an exchange, if there is one (the caller
        starts the exchange with ``send`` or ``start``; the response's ``release``, or
        ``abort``, ends it)."""
        stack = self._idle.get(url)
        while stack:
            conn = stack.pop()
            if not conn.closed and conn.idle_since >= conn._loop.time() - self._idle_ttl_s:
                return conn
            conn.abort()
        return None

    def _put(self, conn: UpstreamConnection) -> None:
        if self._closed:
            conn.abort()
            return
        stack = self._idle.setdefault(conn.origin.url, [])
        if len(stack) >= self._max_idle:
            conn.abort()
            return
        conn.idle_since = conn._loop.time()
        stack.append(conn)

    async def _connect(self, origin: Origin, connect_s: float) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError:
            raise UpstreamUnavailable(
                f"{origin.url} did not accept a connection within {connect_s:g} s"
            ) from None
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise UpstreamUnavailable(f"{origin.url} is unreachable: {reason}") from None
        self.connects += 1
        return conn

    def retain(self, urls: set[str]) -> None:
        """Close idle connections to every origin not in ``urls`` (replicas a reload dropped)."""
        for url in [u for u in self._idle if u not in urls]:
            for conn in self._idle.pop(url):
                conn.abort()
            self._origins.pop(url, None)

    def idle_count(self, url: str) -> int:
        return sum(1 for c in self._idle.get(url, ()) if not c.closed)

    async def close(self) -> None:
        """Close every idle connection; busy ones close as their exchanges end."""
        self._closed = True
        for stack in self._idle.values():
            for conn in stack:
                conn.abort()
        self._idle.clear()
        # Let the transports' close callbacks run before the loop goes away.
        await asyncio.sleep(0)
