"""A WebSocket handshake with a replica on a connection of its own, read by llhttp.

The edge writes the upgrade request (:func:`edge.core.wshandshake.upgrade_request`) on a new
connection and reads the answer with ``httptools``. A 101 leaves the connection to the relay
(:mod:`edge.aio.wsrelay`) with its reading paused, together with every byte the replica sent
past its head: a replica sends its first frame (a session's catch-up) at once, often in the same
packet as the 101, and those bytes belong to the session. Any other status is a refusal: its
status, raw headers and body (at most ``body_limit`` bytes kept), and the connection is closed.

Refused or reset before any byte is :class:`UpstreamUnavailable`; bytes that are not HTTP, or a
connection that breaks off mid-head, :class:`UpstreamBadResponse`. The caller bounds the whole
exchange in time; cancelling it aborts the connection.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import cast

import httptools

from edge.core.errors import UpstreamBadResponse, UpstreamError, UpstreamUnavailable
from edge.upstream.pool import Origin


@dataclass(slots=True)
class Upgraded:
    """A connection a replica has switched to WebSocket, not yet read past its 101."""

    transport: asyncio.Transport
    headers: list[tuple[bytes, bytes]]
    handshake: Handshake

    @property
    def tail(self) -> bytes:
        """The bytes the replica sent after its 101 so far, in order."""
        return bytes(self.handshake.tail)

    @property
    def lost(self) -> bool:
        """The connection ended before the relay took it."""
        return self.handshake.lost

    def abort(self) -> None:
        self.transport.abort()


@dataclass(frozen=True, slots=True)
class Refusal:
    """A replica's answer to an upgrade request that is not a 101."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class Handshake(asyncio.Protocol):
    """The upgrade exchange on one replica connection (``httptools`` callbacks included)."""

    def __init__(self, origin: Origin, body_limit: int) -> None:
        loop = asyncio.get_running_loop()
        self.origin = origin
        self.done: asyncio.Future[Upgraded | Refusal] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.tail = bytearray()
        self.lost = False
        self._parser = httptools.HttpResponseParser(self)
        self._body_limit = body_limit
        self._headers: list[tuple[bytes, bytes]] = []
        self._body = bytearray()
        self._status = 0
        self._received = False
        self._upgraded = False

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._upgraded:
            self.tail += data  # only until the relay takes the connection over
            return
        if self.done.done():
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # Raised only for a 101 that switches protocols: the rest is the session's.
            self._switched(data[upgrade.args[0] :])
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBadResponse(f"{self.origin.url} sent invalid HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.done.done():
            return
        if self._status and self._status != 101:
            # A body delimited by the end of the connection, or one that broke off: what
            # arrived is the refusal's body either way.
            self._refused()
        elif self._received:
            self._fail(UpstreamBadResponse(f"{self.origin.url} closed the connection mid-answer"))
        else:
            self._fail(UpstreamUnavailable(f"{self.origin.url} closed the connection unanswered"))

    # --- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._headers = []  # 100 Continue and the like: the answer follows
            return
        self._status = status

    def on_body(self, body: bytes) -> None:
        room = self._body_limit - len(self._body)
        if room > 0:
            self._body += body[:room]

    def on_message_complete(self) -> None:
        if self._status and self._status != 101:
            self._refused()

    # --- outcomes ------------------------------------------------------------------------------

    def _switched(self, tail: bytes) -> None:
        assert self.transport is not None
        self._upgraded = True
        self.tail += tail
        # Nothing more is read until the relay takes over: what arrives meanwhile waits in the
        # socket, not here.
        self.transport.pause_reading()
        self.done.set_result(Upgraded(self.transport, self._headers, self))

    def _refused(self) -> None:
        if not self.done.done():
            self.done.set_result(Refusal(self._status, self._headers, bytes(self._body)))
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: UpstreamError) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        if self.transport is not None:
            self.transport.abort()


async def open_upgrade(
    origin: Origin, request: bytes, *, tls: ssl.SSLContext | None, body_limit: int
) -> Upgraded | Refusal:
    """Send the upgrade ``request`` to ``origin`` on a new connection; the replica's answer."""
    loop = asyncio.get_running_loop()
    try:
        transport, handshake = await loop.create_connection(
            lambda: Handshake(origin, body_limit),
            origin.host,
            origin.port,
            ssl=tls,
            server_hostname=origin.host if tls is not None else None,
        )
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UpstreamUnavailable(f"{origin.url} is unreachable: {reason}") from None
    transport.write(request)
    try:
        return await handshake.done
    except BaseException:
        transport.abort()
        raise
