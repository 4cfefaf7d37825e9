"""A lean streaming HTTP/1.1 client for one request shape: a POST whose answer is read as it
arrives. It is what ``replica.model.OpenAIModel`` streams chat completions through.

Why not httpx for this: a streamed token costs httpx a step through several nested async
generators and a task step per network read, and each request builds URL, header and request
objects and takes the pool's locks; at 100 tokens a second per session that was most of the
replica's CPU per token. Here a connection is an :class:`asyncio.Protocol` whose
``data_received`` feeds the bytes to a :class:`~replica.http1_wire.ResponseReader` and wakes the
one waiting reader, if any: no task per read, and a reader gets everything that has arrived
since it last asked (:meth:`Response.read`).

:meth:`Response.pace` reads a body at most once per window: after a read the socket is not
read again until the window has passed, so the tokens a server writes meanwhile arrive
together, as one read and one wake-up, instead of one each.

Rules it keeps:

* Keep-alive connections are pooled per (scheme, host, port), newest first, at most
  ``max_idle`` of them; one is reused only after a response read to its end that allows
  keep-alive, and only if it has been idle less than ``idle_ttl_s`` (below common servers'
  keep-alive timeouts: uvicorn's is 5 s). Anything else is closed when released.
* A pooled connection can have been closed by the server while idle. If such a reused
  connection ends before any byte of the answer, the request is sent once more on a new
  connection: the server closes idle connections only between requests, so nothing was
  answered.
* ``timeout`` bounds connecting (TLS included), sending, and each wait for more of the answer.
* ``https`` verifies the server's certificate and host name (SNI) against ``ssl_context``.
* Errors are the :class:`HTTPError` classes below, named as httpx names its own; their
  messages name no URL, header or body, so they cannot leak what a request carried.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, cast

from replica.http1_wire import Head, ResponseReader, WireError

DEFAULT_MAX_IDLE: Final = 64
DEFAULT_IDLE_TTL_S: Final = 4.0
# A timer may fire this much before its deadline (the loop's clock resolution).
_TIMER_SLACK_S: Final = 0.001


class HTTPError(Exception):
    """An exchange failed."""


class TransportError(HTTPError):
    """The connection failed or the server broke the protocol."""


class TimeoutException(TransportError):
    pass


class ConnectTimeout(TimeoutException):
    pass


class WriteTimeout(TimeoutException):
    pass


class ReadTimeout(TimeoutException):
    pass


class ConnectError(TransportError):
    """No connection could be made (refused, unresolvable, TLS handshake failed, client
    closed)."""


class ReadError(TransportError):
    pass


class WriteError(TransportError):
    pass


class RemoteProtocolError(TransportError):
    """The server closed the connection early or sent something that is not HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str  # "http" or "https"
    host: str  # a name, or an IP address (IPv6 without brackets)
    port: int

    def __post_init__(self) -> None:
        if self.scheme not in ("http", "https"):
            raise ValueError("the scheme must be http or https")


class _Connection(asyncio.Protocol):
    """One connection; at most one exchange at a time (no pipelining)."""

    __slots__ = (
        "_forget",
        "_loop",
        "_pace_s",
        "_resume_handle",
        "_timed_out",
        "_timeout_s",
        "_timer",
        "_wait_since",
        "_waiter",
        "_write_paused",
        "body",
        "busy",
        "closed",
        "error",
        "idle_since",
        "origin",
        "paused",
        "reader",
        "received",
        "transport",
    )

    def __init__(
        self, origin: Origin, timeout_s: float, forget: Callable[[_Connection], None]
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.origin = origin
        self._timeout_s = timeout_s
        self._forget = forget
        self.transport: asyncio.Transport | None = None
        self.reader = ResponseReader()
        self.body: list[bytes] = []  # body bytes not yet taken by the reader of the response
        self.received = False  # a byte of the current exchange's answer has arrived
        self.busy = False  # an exchange is under way (not idle in the pool)
        self.closed = False
        self.error: HTTPError | None = None
        self.idle_since = 0.0
        self.paused = False
        self._pace_s = 0.0
        self._resume_handle: asyncio.TimerHandle | None = None
        self._write_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._wait_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            # A server has nothing to say between exchanges: this connection is out of step.
            self.abort()
            return
        self.received = True
        try:
            body = self.reader.feed(data)
        except WireError as exc:
            self.error = RemoteProtocolError(str(exc))
            self.abort()
            self._wake()
            return
        if body:
            self.body.append(body)
            if self._pace_s and not self.paused:
                self._pause_for(self._pace_s)
        self._wake()

    def eof_received(self) -> bool | None:
        self._ended()
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timers()
        self._forget(self)
        if exc is not None and self.error is None and not self.reader.complete:
            self.error = ReadError(type(exc).__name__)
        self._ended()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake()

    # --- the exchange --------------------------------------------------------------------------

    def _ended(self) -> None:
        if self.error is None and self.received:
            try:
                self.reader.feed_eof()
            except WireError as exc:
                self.error = RemoteProtocolError(str(exc))
        self._wake()

    def start(self, data: bytes) -> None:
        assert self.transport is not None
        self.reader = ResponseReader()
        self.body = []
        self.received = False
        self.busy = True
        self._pace_s = 0.0
        self.transport.write(data)

    async def sent(self) -> None:
        """Wait until the request has left the write buffer (or an answer has begun)."""
        while self._write_paused and not self.closed and not self.received:
            await self.wait(WriteTimeout)

    async def head(self) -> Head:
        """Wait for the answer's head."""
        reader = self.reader
        while reader.head is None:
            if self.error is not None:
                raise self.error
            if self.closed:
                raise RemoteProtocolError("the server closed the connection without answering")
            await self.wait(ReadTimeout)
        return reader.head

    async def wait(self, expired: type[TimeoutException]) -> None:
        """Wait for the protocol to wake this reader; ``expired`` once ``timeout_s`` has passed
        without it. One timer per connection, re-armed only when it fires early, not one per
        wait."""
        loop = self._loop
        waiter = self._waiter = loop.create_future()
        self._wait_since = now = loop.time()
        if self._timer is None:
            self._timer = loop.call_at(now + self._timeout_s, self._check_timeout)
        await waiter
        if self._timed_out:
            self._timed_out = False
            raise expired(f"no progress in {self._timeout_s:g} s")

    def _check_timeout(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms it again
        due = self._wait_since + self._timeout_s
        if self._loop.time() < due - _TIMER_SLACK_S:
            self._timer = self._loop.call_at(due, self._check_timeout)
            return
        self._timed_out = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def pace(self, window_s: float) -> None:
        """Read at most once per ``window_s`` from now on (0: as data arrives). Body bytes
        already waiting were the last read: the window starts now."""
        self._pace_s = window_s
        if not window_s:
            self._resume()
        elif self.body and not self.paused and not self.closed:
            self._pause_for(window_s)

    def _pause_for(self, window_s: float) -> None:
        assert self.transport is not None
        self.paused = True
        self.transport.pause_reading()
        self._resume_handle = self._loop.call_later(window_s, self._resume)

    def _resume(self) -> None:
        handle = self._resume_handle
        if handle is not None:
            self._resume_handle = None
            handle.cancel()
        if self.paused:
            self.paused = False
            if not self.closed and self.transport is not None:
                self.transport.resume_reading()

    def _cancel_timers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._resume_handle is not None:
            self._resume_handle.cancel()
            self._resume_handle = None

    def abort(self) -> None:
        self._cancel_timers()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()


async def read_to_end(read: Callable[[], Awaitable[bytes]], limit: int) -> bool:
    """Read a body to its end and drop it, giving up past ``limit`` bytes; True if it ended."""
    size = 0
    while size <= limit:
        data = await read()
        if not data:
            return True
        size += len(data)
    return False


class Response:
    """An answer: its head at once, its body as it arrives. Release it with :meth:`aclose`
    (or :meth:`release`) as soon as it is no longer read: its connection goes back to the pool
    only if the body was read to its end."""

    __slots__ = ("_conn", "_pool", "_released", "head", "status")

    def __init__(self, pool: ConnectionPool, conn: _Connection, head: Head) -> None:
        self._pool = pool
        self._conn = conn
        self._released = False
        self.head = head
        self.status = head.status

    def header(self, name: str) -> str | None:
        return self.head.get(name)

    def pace(self, window_s: float) -> None:
        """Read the body at most once per ``window_s`` (see the module's docstring)."""
        if window_s < 0:
            raise ValueError("the window must not be negative")
        self._conn.pace(window_s)

    async def read(self) -> bytes:
        """Everything of the body that has arrived since the last read, waiting for some if
        nothing has; ``b""`` once the body has been read to its end."""
        conn = self._conn
        while True:
            body = conn.body
            if body:
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                return data
            if conn.error is not None:
                raise conn.error
            if conn.reader.complete:
                return b""
            if conn.closed:
                raise RemoteProtocolError("the server closed the connection mid-body")
            await conn.wait(ReadTimeout)

    async def drain(self, limit: int) -> bool:
        """Read what is left of the body (at most ``limit`` bytes, as it arrives: no pacing),
        so the connection can be reused; True if the body ended."""
        self._conn.pace(0.0)
        return await read_to_end(self.read, limit)

    def release(self) -> None:
        """Pool the connection if the body was read to its end and allows keep-alive; else
        close it at once. Idempotent."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        if conn.closed or conn.error is not None or conn.body or not conn.reader.reusable:
            conn.abort()
            return
        self._pool._put(conn)

    async def aclose(self) -> None:
        self.release()


class ConnectionPool:
    """Connections per origin, opened on demand and kept alive between exchanges."""

    def __init__(
        self,
        timeout_s: float,
        *,
        ssl_context: Callable[[], ssl.SSLContext] = ssl.create_default_context,
        max_idle: int = DEFAULT_MAX_IDLE,
        idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout must be positive")
        if max_idle < 0:
            raise ValueError("max_idle must not be negative")
        self._timeout_s = timeout_s
        self._make_ssl = ssl_context
        self._ssl: ssl.SSLContext | None = None
        self._max_idle = max_idle
        self._idle_ttl_s = idle_ttl_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._closed = False
        self.connects = 0  # connections opened, for tests and debugging

    def idle_count(self) -> int:
        return sum(1 for stack in self._idle.values() for c in stack if not c.closed)

    async def request(self, origin: Origin, data: bytes) -> Response:
        """Send ``data`` (a whole request, ``replica.http1_wire.encode_request``) and wait for
        the head of the answer. Cancelling closes the connection."""
        conn = self._take(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except (RemoteProtocolError, ReadError, WriteError):
                if conn.received:
                    raise
                # Closed by the server while idle, just as it was reused (see the module's
                # docstring): once more on a new connection.
        conn = await self._connect(origin)
        return await self._exchange(conn, data)

    async def _exchange(self, conn: _Connection, data: bytes) -> Response:
        try:
            conn.start(data)
            await conn.sent()
            head = await conn.head()
        except BaseException:
            conn.abort()
            raise
        return Response(self, conn, head)

    def _take(self, origin: Origin) -> _Connection | None:
        stack = self._idle.get(origin)
        if not stack:
            return None
        oldest = self._loop_time() - self._idle_ttl_s
        while stack:
            conn = stack.pop()
            if not conn.closed and conn.idle_since >= oldest:
                return conn
            conn.abort()
        return None

    def _put(self, conn: _Connection) -> None:
        if self._closed or self._max_idle == 0:
            conn.abort()
            return
        if sum(len(s) for s in self._idle.values()) >= self._max_idle:
            # Full: the oldest idle connection makes room (the newest are reused first).
            origin = min(
                (o for o, s in self._idle.items() if s), key=lambda o: self._idle[o][0].idle_since
            )
            self._idle[origin].pop(0).abort()
        conn.pace(0.0)
        conn.busy = False
        conn.idle_since = self._loop_time()
        self._idle.setdefault(conn.origin, []).append(conn)

    @staticmethod
    def _loop_time() -> float:
        return asyncio.get_running_loop().time()

    async def _connect(self, origin: Origin) -> _Connection:
        if self._closed:
            raise ConnectError("the client is closed")
        tls: ssl.SSLContext | None = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = self._make_ssl()
            tls = self._ssl
        loop = asyncio.get_running_loop()
        timeout_s = self._timeout_s
        failure: HTTPError | None = None
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(origin, timeout_s, self._open.discard),
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError:
            failure = ConnectTimeout(f"no connection within {timeout_s:g} s")
        except (OSError, ssl.SSLError) as exc:
            failure = ConnectError(type(exc).__name__)
        # Raised here, not in the except clauses, so it carries no predecessor.
        if failure is not None:
            raise failure
        self.connects += 1
        self._open.add(conn)
        return conn

    async def aclose(self) -> None:
        """Close every connection, idle or not; later requests fail with ConnectError."""
        self._closed = True
        self._idle.clear()
        for conn in list(self._open):
            conn.abort()
        # Let the transports' close callbacks run before the loop may go away.
        await asyncio.sleep(0)
