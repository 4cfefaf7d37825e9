"""WebSocket sessions through the edge: handshake with the replica first, then relay bytes.

The client is upgraded only after a replica has upgraded the edge: the handshake goes to the
replica (the client's own fields, grant and subprotocols included) through the same
retry-then-walk placement as any request, and a refusal that is not retried (401, 403, 400, a
421 from every replica, a 503 past the budget...) reaches the client as that HTTP status with
its body, never as an upgraded socket that then closes. A client whose own upgrade request is
malformed is answered 400 before any replica is asked.

The replica's handshake is the edge's own, on a connection of its own
(:mod:`edge.upstream.wsconnect`); the client's 101 is written by aiohttp's server, which read
the request. Then both transports are handed to :class:`edge.aio.wsrelay.Relay`, which copies
bytes between them by protocol callbacks (no task per direction, no message decoded) with the
transports' own flow control for backpressure, carries close codes and reasons through, closes
either side when the other closes or vanishes, and closes both with 1001 when the edge shuts
down. Bytes either side sent past its handshake before the relay had its transport are relayed
first, in order: the replica's first frame (its catch-up) often comes in the same packet as its
101, kept by the handshake's reader; a client's first frame may have reached aiohttp's reader
before the take-over, and is kept by :class:`_Tail`, which stands in for aiohttp's WebSocket
parser on that connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Final, cast

from aiohttp import web
from aiohttp.http_websocket import WebSocketReader
from aiohttp.web_request import BaseRequest

from edge.aio.proxy import REFUSALS
from edge.aio.wsrelay import CLIENT_GONE, CLOSE_TIMEOUT_S, Relay
from edge.core.accesslog import AccessRecord
from edge.core.answers import PLACING_ERRORS, placing_failed
from edge.core.classify import Kind
from edge.core.config import EdgeOptions, ReplicaConfig
from edge.core.errors import UpstreamBadResponse, UpstreamTimeout, UpstreamUnavailable
from edge.core.exchange import Exchange
from edge.core.headers import (
    RETRY_AFTER_FIELD,
    RawHeaders,
    response_headers,
    websocket_headers,
    websocket_protocols,
)
from edge.core.metrics import EdgeMetrics, Outcome
from edge.core.placement import FailedAttempt
from edge.core.retry import parse_retry_after
from edge.core.wsframes import close_frame, sendable_close_code
from edge.core.wshandshake import (
    Upgrade,
    check_upgrade,
    client_handshake,
    new_key,
    upgrade_request,
)
from edge.upstream.pool import Origin
from edge.upstream.wsconnect import Refusal, Upgraded, open_upgrade

__all__ = ["HandshakeAnswer", "WebSocketProxy", "sendable_close_code"]

log = logging.getLogger("edge.aio.websocket")

REFUSAL_BODY_LIMIT: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class HandshakeAnswer:
    """A refusal to pass to the client as plain HTTP."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class Placed:
    """A replica connection upgraded for the session."""

    __slots__ = ("protocol", "upgraded")

    def __init__(self, upgraded: Upgraded, protocol: str | None) -> None:
        self.upgraded = upgraded
        self.protocol = protocol

    def close(self, close: tuple[int, bytes]) -> None:
        """Close it from the edge's side, before any relay (the client was never upgraded)."""
        transport = self.upgraded.transport
        if not transport.is_closing():
            transport.write(close_frame(close[0], close[1], os.urandom(4)))
            transport.close()


class _Tail:
    """Stands in for aiohttp's WebSocket parser on a client connection between the client's
    handshake and the relay's take-over (``RequestHandler.set_parser``): aiohttp gives it the
    bytes it read past the request, and any that arrive meanwhile, instead of parsing them."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.eof = False

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.data += data
        return False, b""

    def feed_eof(self) -> None:
        self.eof = True


class WebSocketProxy:
    """Places WebSocket handshakes on replicas and relays the sessions; counts them."""

    def __init__(self, metrics: EdgeMetrics) -> None:
        self.metrics = metrics
        self.relays: set[Relay] = set()  # sessions being relayed, for tests and debugging
        self.close_timeout_s = CLOSE_TIMEOUT_S  # how long a closing session may take
        self._origins: dict[str, Origin] = {}
        self._tls: ssl.SSLContext | None = None

    def _origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin.parse(url)
        return origin

    async def _attempt(
        self,
        replica: ReplicaConfig,
        target: str,
        fields: RawHeaders,
        offered: tuple[str, ...],
        options: EdgeOptions,
    ) -> Placed | HandshakeAnswer | FailedAttempt:
        origin = self._origin(replica.url)
        tls: ssl.SSLContext | None = None
        if origin.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        key = new_key()
        request = upgrade_request(
            target, fields, host=origin.host_header, key=key, protocols=offered
        )
        try:
            handshake_s = options.connect_timeout_s + options.upstream_header_timeout_s
            async with asyncio.timeout(handshake_s):
                answer = await open_upgrade(origin, request, tls=tls, body_limit=REFUSAL_BODY_LIMIT)
        except TimeoutError:
            raise UpstreamTimeout(
                f"{replica.url} did not complete the WebSocket handshake"
            ) from None
        except UpstreamUnavailable as exc:
            log.debug("%s", exc)
            return FailedAttempt.unreached("unreachable")
        if isinstance(answer, Refusal):
            status = answer.status
            if status in REFUSALS:
                retry_after = None
                for name, value in answer.headers:
                    if name.lower() == RETRY_AFTER_FIELD:
                        retry_after = parse_retry_after(value.decode("latin-1"))
                note = answer.body[:512].decode("utf-8", "replace").strip().replace("\n", " ")
                return FailedAttempt.refused(status, retry_after, f"{status} {note}".rstrip())
            return HandshakeAnswer(status, answer.headers, answer.body)
        checked = check_upgrade(answer.headers, key, offered)
        if not isinstance(checked, Upgrade):
            answer.abort()
            raise UpstreamBadResponse(f"{replica.url} botched the WebSocket handshake: {checked}")
        return Placed(answer, checked.protocol)

    async def forward(
        self, request: BaseRequest, target: str, headers: RawHeaders, exchange: Exchange
    ) -> tuple[web.StreamResponse, Outcome]:
        accept = client_handshake(headers)
        if isinstance(accept, str):
            return web.Response(status=400, text=accept), Outcome.REJECTED
        options = exchange.options
        fields = websocket_headers(headers)
        offered = websocket_protocols(headers)

        async def attempt(replica: ReplicaConfig) -> Placed | HandshakeAnswer | FailedAttempt:
            return await self._attempt(replica, target, fields, offered, options)

        try:
            placed: Placed | HandshakeAnswer = await exchange.place(attempt)
        except PLACING_ERRORS as exc:
            failed = placing_failed(exc, exchange, self.metrics)
            return failed.response(), failed.outcome
        elapsed = asyncio.get_running_loop().time() - exchange.started
        self.metrics.placement[Kind.WEBSOCKET].observe(elapsed)
        if isinstance(placed, HandshakeAnswer):
            out = web.Response(
                status=placed.status,
                body=placed.body,
                headers=response_headers(placed.headers, keep_length=False),
            )
            return out, Outcome.DELIVERED
        return await self._relay(request, placed, accept, options, exchange.record)

    async def _relay(
        self,
        request: BaseRequest,
        placed: Placed,
        accept: bytes,
        options: EdgeOptions,
        record: AccessRecord,
    ) -> tuple[web.StreamResponse, Outcome]:
        headers = {
            "Upgrade": "websocket",
            "Connection": "upgrade",
            "Sec-WebSocket-Accept": accept.decode("ascii"),
        }
        if placed.protocol:
            headers["Sec-WebSocket-Protocol"] = placed.protocol
        response = web.StreamResponse(status=101, reason="Switching Protocols", headers=headers)
        response.force_close()
        handler = request.protocol
        tail = _Tail()
        try:
            # From here aiohttp hands what it reads on this connection to ``tail``.
            handler.set_parser(cast(WebSocketReader, tail))
            handler.keep_alive(False)
            await response.prepare(request)
            await response.write_eof()
            transport = request.transport
            if transport is None or transport.is_closing() or tail.eof:
                raise ConnectionResetError("the client went away")
        except BaseException:
            placed.close(CLIENT_GONE)
            raise
        record.answered(101)
        relay = Relay(
            transport,
            placed.upgraded.transport,
            message_limit=options.max_request_body_bytes,
            close_timeout_s=self.close_timeout_s,
        )
        relay.start(
            client_tail=bytes(tail.data),
            replica_tail=placed.upgraded.tail,
            replica_lost=placed.upgraded.lost,
        )
        # aiohttp's handler no longer hears from the connection: it is told the connection is
        # over once it has finished with the request, as it would have been by the transport.
        request.task.add_done_callback(lambda _: handler.connection_lost(None))
        gauge = self.metrics.streams[Kind.WEBSOCKET]
        gauge.inc()
        self.relays.add(relay)
        try:
            await asyncio.shield(relay.finished)
        except asyncio.CancelledError:
            # The edge is shutting down: both sides are closed with 1001, and given their close
            # time, even if this task is cancelled again meanwhile.
            relay.shut_down()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(relay.finished)
            raise
        finally:
            self.relays.discard(relay)
            gauge.dec()
        return response, Outcome.DELIVERED
