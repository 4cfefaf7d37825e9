"""WebSocket sessions through the edge: handshake with the replica first, then relay frames.

The client is upgraded only after a replica has upgraded the edge: the handshake goes to the
replica (the client's own fields, grant and subprotocols included) through the same
retry-then-walk placement as any request, and a refusal that is not retried (401, 403, 400, a
421 from every replica, a 503 past the budget...) reaches the client as that HTTP status with
its body, never as an upgraded socket that then closes.

Once both sides are open, two pumps copy messages (text, binary, ping, pong) each way. The
sockets' own flow control gives backpressure: a pump awaits each send, so a slow reader stalls
its writer's pump, and the edge stops reading from that writer. Close codes and reasons are
carried through; either side closing (or vanishing) closes the other, and the edge shutting
down closes both with 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Final, Literal

import aiohttp
from aiohttp import ClientWebSocketResponse, WSMsgType, web
from aiohttp.client_middlewares import ClientHandlerType
from aiohttp.client_reqrep import ClientRequest, ClientResponse
from aiohttp.web_request import BaseRequest
from yarl import URL

from edge.aio.proxy import REFUSALS
from edge.core.accesslog import AccessRecord
from edge.core.answers import PLACING_ERRORS, placing_failed
from edge.core.classify import Kind
from edge.core.config import EdgeOptions, ReplicaConfig
from edge.core.errors import UpstreamBadResponse, UpstreamTimeout
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

log = logging.getLogger("edge.aio.websocket")

# Replicas send whole transcripts as one catch-up frame; the client's commands are small.
UPSTREAM_MAX_MESSAGE: Final = 256 * 1024 * 1024
WS_CLOSE_TIMEOUT_S: Final = 5.0
REFUSAL_BODY_LIMIT: Final = 64 * 1024
# Codes an endpoint may put in a close frame (RFC 6455 7.4); others are mapped before sending.
_NO_STATUS: Final = 1005
_ABNORMAL: Final = 1006


class _HandshakeRefused(Exception):
    """A replica answered the upgrade with an HTTP status: carried out of ``ws_connect``."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.headers = headers
        self.body = body


async def _keep_refusal(request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
    # aiohttp's handshake error keeps the status and headers but drops the body, which the
    # client must get; read it here, while the response still exists.
    response = await handler(request)
    if response.status == 101:
        return response
    try:
        parts: list[bytes] = []
        size = 0
        while chunk := await response.content.readany():
            size += len(chunk)
            if size > REFUSAL_BODY_LIMIT:
                break
            parts.append(chunk)
    finally:
        response.close()
    raise _HandshakeRefused(response.status, list(response.raw_headers), b"".join(parts))


@dataclass(frozen=True, slots=True)
class HandshakeAnswer:
    """A refusal to pass to the client as plain HTTP."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def sendable_close_code(code: int | None, *, fallback: int) -> int:
    """A close code that may appear on the wire; ``fallback`` replaces the reserved ones."""
    if code is None or code == _NO_STATUS:
        return 1000
    if 1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999:
        return code
    return fallback


class End(enum.Enum):
    CLOSED = enum.auto()  # a close frame arrived: carry its code on
    GONE = enum.auto()  # the socket ended without a close frame, or failed


@dataclass(frozen=True, slots=True)
class PumpEnd:
    end: End
    code: int | None = None
    reason: bytes = b""


UpstreamSocket = ClientWebSocketResponse[Literal[False]]
ClientSocket = web.WebSocketResponse[Literal[False]]
Socket = ClientSocket | UpstreamSocket


async def pump(source: Socket, sink: Socket) -> PumpEnd:
    """Copy messages from ``source`` to ``sink`` until ``source`` closes or fails."""
    try:
        while True:
            msg = await source.receive()
            kind = msg.type
            if kind is WSMsgType.TEXT or kind is WSMsgType.BINARY:
                data = msg.data
                payload = data.encode("utf-8") if isinstance(data, str) else data
                await sink.send_frame(payload, kind)
            elif kind is WSMsgType.PING:
                await sink.ping(msg.data)
            elif kind is WSMsgType.PONG:
                await sink.pong(msg.data)
            elif kind is WSMsgType.CLOSE:
                reason = msg.extra.encode("utf-8") if isinstance(msg.extra, str) else b""
                return PumpEnd(End.CLOSED, msg.data, reason)
            else:
                # CLOSING (the other pump is closing this socket), CLOSED or ERROR. Never call
                # receive() again here: that would race the other pump's close.
                return PumpEnd(End.GONE, source.close_code)
    except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
        log.debug("websocket pump stopped: %s", type(exc).__name__)
        return PumpEnd(End.GONE)


async def _close(socket: Socket, code: int, reason: bytes = b"") -> None:
    with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError, TimeoutError):
        async with asyncio.timeout(WS_CLOSE_TIMEOUT_S):
            await socket.close(code=code, message=reason)


async def _close_both(first: Socket, second: Socket, code: int, reason: bytes = b"") -> None:
    await _close(first, code, reason)
    await _close(second, code, reason)


# Closing handshakes run to the end even if the relay is cancelled meanwhile (the client's
# connection closing fires aiohttp's handler cancellation in the middle of them).
_closers: set[asyncio.Task[None]] = set()


async def _shielded(closing: Awaitable[None]) -> None:
    task = asyncio.ensure_future(closing)
    _closers.add(task)
    task.add_done_callback(_closers.discard)
    await asyncio.shield(task)


async def relay_frames(client: ClientSocket, upstream: UpstreamSocket) -> None:
    """Run both pumps; the first to end decides how the other side is closed."""
    up = asyncio.create_task(pump(client, upstream), name="ws client->replica")
    down = asyncio.create_task(pump(upstream, client), name="ws replica->client")
    try:
        done, _ = await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
        if up in done:
            ended = up.result()
            if ended.end is End.CLOSED:
                code = sendable_close_code(ended.code, fallback=1000)
                await _shielded(_close_both(upstream, client, code, ended.reason))
            else:
                await _shielded(_close_both(upstream, client, 1001))
        else:
            ended = down.result()
            if ended.end is End.CLOSED:
                code = sendable_close_code(ended.code, fallback=1011)
                await _shielded(_close_both(client, upstream, code, ended.reason))
            else:
                # The replica vanished without a close frame.
                await _shielded(
                    _close_both(client, upstream, 1011, b"the replica connection was lost")
                )
        await asyncio.wait((up, down), timeout=WS_CLOSE_TIMEOUT_S)
    except asyncio.CancelledError:
        # The edge is shutting down, or the client's connection is gone: the replica is told
        # first, since the client may already be unreachable.
        await _shielded(_close_both(upstream, client, 1001, b"the edge is going away"))
        raise
    finally:
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)


class WebSocketProxy:
    """Owns the aiohttp client session used for replica handshakes."""

    def __init__(self, metrics: EdgeMetrics) -> None:
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                timeout=aiohttp.ClientTimeout(total=None),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
                middlewares=(_keep_refusal,),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _attempt(
        self,
        replica: ReplicaConfig,
        url_path: str,
        headers: list[tuple[str, str]],
        protocols: tuple[str, ...],
        options: EdgeOptions,
    ) -> UpstreamSocket | HandshakeAnswer | FailedAttempt:
        url = URL(replica.url + url_path, encoded=True)
        try:
            handshake_s = options.connect_timeout_s + options.upstream_header_timeout_s
            async with asyncio.timeout(handshake_s):
                return await self._client().ws_connect(
                    url,
                    headers=headers,
                    protocols=protocols,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=WS_CLOSE_TIMEOUT_S),
                    autoclose=False,
                    autoping=False,
                    max_msg_size=UPSTREAM_MAX_MESSAGE,
                    decode_text=False,
                )
        except _HandshakeRefused as refused:
            status = refused.status
            if status in REFUSALS:
                retry_after = None
                for name, value in refused.headers:
                    if name.lower() == RETRY_AFTER_FIELD:
                        retry_after = parse_retry_after(value.decode("latin-1"))
                note = refused.body[:512].decode("utf-8", "replace").strip().replace("\n", " ")
                return FailedAttempt.refused(status, retry_after, f"{status} {note}".rstrip())
            return HandshakeAnswer(status, refused.headers, refused.body)
        except aiohttp.WSServerHandshakeError as exc:
            raise UpstreamBadResponse(
                f"{replica.url} botched the WebSocket handshake: {exc.message}"
            ) from None
        except TimeoutError:
            raise UpstreamTimeout(
                f"{replica.url} did not complete the WebSocket handshake"
            ) from None
        except (aiohttp.ClientConnectionError, OSError) as exc:
            log.debug("%s is unreachable: %s", replica.url, type(exc).__name__)
            return FailedAttempt.unreached("unreachable")

    async def forward(
        self, request: BaseRequest, target: str, headers: RawHeaders, exchange: Exchange
    ) -> tuple[web.StreamResponse, Outcome]:
        options = exchange.options
        fields = websocket_headers(headers)
        offered = websocket_protocols(headers)

        async def attempt(
            replica: ReplicaConfig,
        ) -> UpstreamSocket | HandshakeAnswer | FailedAttempt:
            return await self._attempt(replica, target, fields, offered, options)

        try:
            upstream: UpstreamSocket | HandshakeAnswer = await exchange.place(attempt)
        except PLACING_ERRORS as exc:
            failed = placing_failed(exc, exchange, self.metrics)
            return failed.response(), failed.outcome
        elapsed = asyncio.get_running_loop().time() - exchange.started
        self.metrics.placement[Kind.WEBSOCKET].observe(elapsed)
        if isinstance(upstream, HandshakeAnswer):
            out = web.Response(
                status=upstream.status,
                body=upstream.body,
                headers=response_headers(upstream.headers, keep_length=False),
            )
            return out, Outcome.DELIVERED
        return await self._relay(request, upstream, options, exchange.record)

    async def _relay(
        self,
        request: BaseRequest,
        upstream: UpstreamSocket,
        options: EdgeOptions,
        record: AccessRecord,
    ) -> tuple[web.StreamResponse, Outcome]:
        chosen = upstream.protocol
        client: ClientSocket = web.WebSocketResponse(
            protocols=(chosen,) if chosen else (),
            autoclose=False,
            autoping=False,
            compress=False,
            max_msg_size=options.max_request_body_bytes,
            timeout=WS_CLOSE_TIMEOUT_S,
            decode_text=False,
        )
        gauge = self.metrics.streams[Kind.WEBSOCKET]
        try:
            await client.prepare(request)
        except BaseException:
            await upstream.close(code=1001)
            raise
        record.answered(101)
        gauge.inc()
        try:
            await relay_frames(client, upstream)
        finally:
            gauge.dec()
        return client, Outcome.DELIVERED
