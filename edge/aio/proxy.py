"""Plain HTTP through the edge on aiohttp's server: SSE event streams, and the commands and
anything else under ``/_beyond/agent`` that the fast lane (:mod:`edge.fast.fastpath`) hands over.

A request is placed before the client sees anything: its body is buffered (a retry must re-send
it whole), the hashed replica is asked, and refusals go through the retry-then-walk loop of
``edge.core.placement``. The first real answer is then passed on:

* an answer whose body has already arrived in full (the usual command response) goes out in one
  write, headers and body together;
* anything else is streamed: each piece is written to the client the moment it arrives, with
  no buffering and no response timeout, only an idle guard (``SSE_IDLE_S`` for event streams,
  longer than the replicas' 15 s keepalive comment; the header timeout otherwise). If the
  replica breaks off, the client connection is closed rather than ended cleanly, so a client
  never mistakes a truncated body for a whole one.

Nothing is retried once the first byte of an answer has gone to the client.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from aiohttp import web
from aiohttp.web_request import BaseRequest

from edge.core.accesslog import AccessRecord
from edge.core.answers import (
    PLACING_ERRORS,
    EdgeAnswer,
    body_broke_off,
    body_stalled,
    placing_failed,
)
from edge.core.classify import Kind
from edge.core.config import EdgeOptions, ReplicaConfig
from edge.core.errors import (
    BodyIncomplete,
    BodyTooLarge,
    LengthRequired,
    UpstreamError,
    UpstreamUnavailable,
)
from edge.core.exchange import Exchange
from edge.core.headers import (
    RETRY_AFTER_FIELD,
    RawHeaders,
    chunked_body,
    declared_length,
    is_chunked,
    request_head,
    response_headers,
)
from edge.core.metrics import EdgeMetrics, Outcome
from edge.core.placement import FailedAttempt
from edge.core.relay import relay_body
from edge.core.retry import parse_retry_after
from edge.upstream.pool import UpstreamPool, UpstreamResponse
from wire.http import MISDIRECTED, RETRY_LATER

log = logging.getLogger("edge.aio.proxy")

# Longer than the replicas' 15 s keepalive comment, so only a dead stream trips it.
SSE_IDLE_S: Final = 45.0
# A fixed-length answer up to this size is sent in one write with its headers: replicas often
# write headers and body separately, and waiting the moment for the rest saves the client a
# packet and the edge a loop turn. Event streams and longer bodies are streamed as they come.
COALESCE_LIMIT: Final = 64 * 1024
# The statuses by which a replica declines a session (busy, or not its owner): retried or walked
# past by the planner, never relayed while placement goes on.
REFUSALS: Final = frozenset({RETRY_LATER, MISDIRECTED})
# How much of a refusal's body is kept for the log, and how long the edge waits for it.
REFUSAL_NOTE_BYTES: Final = 512
REFUSAL_BODY_LIMIT: Final = 64 * 1024
REFUSAL_READ_S: Final = 2.0
_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


async def read_body(request: BaseRequest, headers: RawHeaders, max_bytes: int) -> bytes:
    """The whole request body, held for re-sending; raises a routing error for 411/413/400."""
    length = request.content_length
    chunked = length is None and is_chunked(headers)
    if length is None and not chunked:
        if request.method in _BODY_METHODS:
            raise LengthRequired(
                "send Content-Length or a chunked body: the edge holds the body to re-send it"
            )
        return b""
    if length is not None and length > max_bytes:
        raise BodyTooLarge(f"the request body is over the edge's limit of {max_bytes} bytes")
    if length == 0:
        return b""
    if request.headers.get("Expect", "").lower() == "100-continue" and request.version >= (1, 1):
        # The edge buffers the body before any replica is involved, so it answers this itself.
        await request.writer.write(_CONTINUE)
    content = request.content
    if length is not None:
        try:
            return await content.readexactly(length)
        except asyncio.IncompleteReadError:
            raise BodyIncomplete("the request body ended before its Content-Length") from None
    parts: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"the request body is over the edge's limit of {max_bytes} bytes")
        parts.append(chunk)
    return b"".join(parts)


def upstream_request(
    request: BaseRequest,
    target: str,
    headers: RawHeaders,
    body: bytes,
    host: bytes,
    *,
    callback: bool,
) -> bytes:
    """The exact bytes to send a replica: head plus framed body, built once per request."""
    head = request_head(
        request.method, target, headers, host=host, body_length=len(body), keep_framing=callback
    )
    if callback and request.content_length is None and is_chunked(headers):
        return head + chunked_body(body)
    return head + body if body else head


async def placement_answer(
    response: UpstreamResponse, replica: ReplicaConfig
) -> UpstreamResponse | FailedAttempt:
    """A replica's answer as the retry planner takes it: a refusal (``REFUSALS``) or the
    response itself."""
    if response.status in REFUSALS:
        return await _refusal(response, replica)
    return response


async def _refusal(response: UpstreamResponse, replica: ReplicaConfig) -> FailedAttempt:
    """Turn a 503/421 into a planner input, keeping the start of its reason for the log."""
    status = response.status
    retry_after = None
    for name, value in response.headers:
        if name.lower() == RETRY_AFTER_FIELD:
            retry_after = parse_retry_after(value.decode("latin-1"))
            break
    body = response.body_if_complete()
    if body is None:
        try:
            async with asyncio.timeout(REFUSAL_READ_S):
                body = await response.read_all(REFUSAL_BODY_LIMIT)
        except (TimeoutError, UpstreamError):
            response.abort()
            body = b""
    response.release()
    reason = body[:REFUSAL_NOTE_BYTES].decode("utf-8", "replace").strip().replace("\n", " ")
    return FailedAttempt.refused(status, retry_after, f"{status} {reason}".rstrip())


class HttpProxy:
    """Places and relays plain HTTP requests over one pool of replica connections."""

    def __init__(self, pool: UpstreamPool, metrics: EdgeMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    async def attempt(
        self, replica: ReplicaConfig, data: bytes, options: EdgeOptions, head_only: bool
    ) -> UpstreamResponse | FailedAttempt:
        try:
            response = await self.pool.request(
                replica.url,
                data,
                connect_timeout=options.connect_timeout_s,
                header_timeout=options.upstream_header_timeout_s,
                head_only=head_only,
            )
        except UpstreamUnavailable as exc:
            # The message names the replica's address: for the log, not for the client.
            log.debug("%s", exc)
            return FailedAttempt.unreached("unreachable")
        return await placement_answer(response, replica)

    async def place(
        self,
        exchange: Exchange,
        data: bytes,
        *,
        head_only: bool = False,
        first: UpstreamResponse | None = None,
    ) -> UpstreamResponse:
        """The first deliverable answer; raises what :data:`edge.core.answers.PLACING_ERRORS`
        names. ``first`` is the owner's answer when the caller already asked it."""
        options = exchange.options

        async def attempt(replica: ReplicaConfig) -> UpstreamResponse | FailedAttempt:
            return await self.attempt(replica, data, options, head_only)

        answer = None if first is None else await placement_answer(first, exchange.owner)
        return await exchange.place(attempt, first=answer)

    async def forward(
        self, request: BaseRequest, target: str, headers: RawHeaders, exchange: Exchange
    ) -> tuple[web.StreamResponse, Outcome]:
        """Place the request and relay the answer; returns the response and how it ended."""
        options = exchange.options
        body = await read_body(request, headers, options.max_request_body_bytes)
        host = self.pool.origin(exchange.owner.url).host_header
        data = upstream_request(request, target, headers, body, host, callback=False)
        placed = await self.placed(exchange, data, head_only=request.method == "HEAD")
        if isinstance(placed, EdgeAnswer):
            return placed.response(), placed.outcome
        return await relay_response(request, placed, exchange, self.metrics)

    async def placed(
        self,
        exchange: Exchange,
        data: bytes,
        *,
        head_only: bool = False,
        first: UpstreamResponse | None = None,
    ) -> UpstreamResponse | EdgeAnswer:
        """The replica's answer once placed, or the edge's own answer when placement failed.
        ``first`` is the owner's answer when the caller already asked it (edge.fast.express)."""
        try:
            response = await self.place(exchange, data, head_only=head_only, first=first)
        except PLACING_ERRORS as exc:
            return placing_failed(exc, exchange, self.metrics)
        elapsed = asyncio.get_running_loop().time() - exchange.started
        self.metrics.placement[exchange.kind].observe(elapsed)
        return response


async def whole_body(
    response: UpstreamResponse, options: EdgeOptions, *, streaming: bool = False
) -> bytes | EdgeAnswer | None:
    """The answer's whole body if it has arrived, or if it is a short fixed-length one (then
    read now, unless ``streaming``); None when it is to be streamed; the edge's own answer when
    the replica stalls or breaks off before the body is whole."""
    body = response.body_if_complete()
    if body is not None or streaming:
        return body
    length = declared_length(response.headers)
    if length is None or length > COALESCE_LIMIT:
        return None
    try:
        async with asyncio.timeout(options.upstream_header_timeout_s):
            return await response.read_all(length)
    except TimeoutError:
        return body_stalled()
    except UpstreamError as exc:
        return body_broke_off(exc)


async def relay_response(
    request: BaseRequest, response: UpstreamResponse, exchange: Exchange, metrics: EdgeMetrics
) -> tuple[web.StreamResponse, Outcome]:
    """Pass a replica's answer on: in one write when it is complete, else streamed."""
    kind, options = exchange.kind, exchange.options
    try:
        body = await whole_body(response, options, streaming=kind is Kind.SSE)
        if isinstance(body, EdgeAnswer):
            return body.response(), body.outcome
        if body is not None:
            keep_length = request.method == "HEAD"
            out = web.Response(
                status=response.status,
                body=body,
                headers=response_headers(response.headers, keep_length=keep_length),
            )
            return out, Outcome.DELIVERED
        return await _stream(request, response, kind, options, metrics, exchange.record)
    finally:
        response.release()


async def _stream(
    request: BaseRequest,
    response: UpstreamResponse,
    kind: Kind,
    options: EdgeOptions,
    metrics: EdgeMetrics,
    record: AccessRecord,
) -> tuple[web.StreamResponse, Outcome]:
    out = web.StreamResponse(
        status=response.status, headers=response_headers(response.headers, keep_length=True)
    )
    await out.prepare(request)
    record.answered(out.status)
    sink = _ResponseSink(request, out)
    if kind is Kind.SSE:
        gauge = metrics.streams[Kind.SSE]
        gauge.inc()
        try:
            return out, await relay_body(response, sink, SSE_IDLE_S, "an event stream")
        finally:
            gauge.dec()
    idle_s = options.upstream_header_timeout_s
    return out, await relay_body(response, sink, idle_s, f"a streamed {kind} answer")


class _ResponseSink:
    """An aiohttp response as a :class:`edge.core.relay.BodySink`."""

    __slots__ = ("out", "request")

    def __init__(self, request: BaseRequest, out: web.StreamResponse) -> None:
        self.request = request
        self.out = out

    async def write(self, chunk: bytes) -> None:
        await self.out.write(chunk)

    async def end(self) -> None:
        await self.out.write_eof()

    def abort(self) -> None:
        # Ending the response normally would tell the client the body is whole.
        transport = self.request.transport
        if transport is not None:
            transport.abort()
