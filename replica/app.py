"""The replica's HTTP surface: ``/_beyond/agent`` (WebSocket and POST), the SSE event stream,
and the probes.

Every request for a session passes the same gate, in this order: the grant (401), a session id
(400), the grant covering that id and tenant (403), a well-formed id (400), a mounted shard (421),
and only then placement, which may answer 503 + ``Retry-After: 1`` (lock held elsewhere, at the
live-session cap, draining, previous task exiting). Each refusal is a real HTTP status with a
readable body, sent before any WebSocket upgrade.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.datastructures import Headers, QueryParams
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from replica import protocol
from replica.callbacks import CallbackHandler, auth_class
from replica.commands import CommandDeps, handle
from replica.corking import HTTP_SEND_NOW
from replica.errors import (
    BadRequest,
    CorruptHistory,
    Forbidden,
    GrantError,
    LockHeld,
    LockLost,
    Misdirected,
    ReplicaError,
    StorageUnavailable,
    Unavailable,
)
from replica.grants import Grant, GrantVerifier, verify_grant
from replica.live import LiveSession, Outgoing
from replica.probes import Readiness
from replica.transcript import UnknownMessage
from replica.websocket_protocol import WS_SEND_NOW
from wire.auth import AuthClass, classify_authorization
from wire.errors import InvalidName, WireError
from wire.http import (
    AGENT_PATH,
    EVENTS_PATH,
    GRANT_HEADER,
    GRANT_REFUSED,
    LAST_EVENT_ID_HEADER,
    LIVEZ_PATH,
    MALFORMED,
    MISDIRECTED,
    NOT_PERMITTED,
    READYZ_PATH,
    RETRY_LATER,
    SESSION_ID_HEADER,
    SESSION_ID_PARAM,
    SINCE_PARAM,
    TENANT_PARAM,
    UNKNOWN_EVENT_ID,
    retry_after_headers,
)
from wire.names import parse_session_id, parse_tenant

log = logging.getLogger("replica.app")

# The WebSocket accept sends its header in lower case, as it always has.
_WS_SESSION_ID_HEADER = SESSION_ID_HEADER.lower().encode("ascii")
WS_CLOSE_LAGGED = 1013
WS_CLOSE_GOING_AWAY = 1001


class Refusal(Exception):
    """A request answered with an HTTP status instead of being served."""

    def __init__(
        self, status: int, reason: str, metric: str, session_id: str | None = None
    ) -> None:
        super().__init__(reason)
        self.status, self.reason, self.metric, self.session_id = status, reason, metric, session_id

    def response(self) -> Response:
        headers = retry_after_headers() if self.status == RETRY_LATER else {}
        if self.session_id:
            headers[SESSION_ID_HEADER] = self.session_id
        return PlainTextResponse(self.reason + "\n", self.status, headers=headers)


def refusal_for(exc: ReplicaError | WireError, session_id: str | None = None) -> Refusal:
    """The one mapping from the replica's errors (and the contract's, a bad name) to HTTP
    statuses."""
    if isinstance(exc, GrantError):
        return Refusal(GRANT_REFUSED, f"grant refused: {exc}", "auth", session_id)
    if isinstance(exc, BadRequest | InvalidName):
        return Refusal(MALFORMED, str(exc), "bad_request", session_id)
    if isinstance(exc, Forbidden):
        return Refusal(NOT_PERMITTED, str(exc), "forbidden", session_id)
    if isinstance(exc, Misdirected):
        return Refusal(MISDIRECTED, str(exc), "misdirected", session_id)
    if isinstance(exc, LockHeld):
        return Refusal(
            RETRY_LATER, "that session is open on another replica; retry", "unavailable", session_id
        )
    if isinstance(exc, Unavailable):
        return Refusal(RETRY_LATER, str(exc), exc.reason, session_id)
    if isinstance(exc, StorageUnavailable | LockLost):
        return Refusal(
            RETRY_LATER,
            f"session storage is unavailable here; retry ({exc})",
            "storage",
            session_id,
        )
    if isinstance(exc, CorruptHistory):
        return Refusal(
            500, f"the session's history failed verification: {exc}", "corrupt", session_id
        )
    return Refusal(500, "internal error", "corrupt", session_id)


class ReplicaApp:
    def __init__(
        self,
        *,
        verifier: GrantVerifier,
        deps: CommandDeps,
        readiness: Readiness,
        callbacks: CallbackHandler,
        keepalive_s: float = 15.0,
    ) -> None:
        self.verifier = verifier
        self.deps = deps
        self.registry = deps.registry
        self.metrics = deps.metrics
        self.readiness = readiness
        self.callbacks = callbacks
        self.keepalive_s = keepalive_s
        self.app = Starlette(
            middleware=[
                Middleware(HeaderBound, on_refuse=lambda: self.metrics.refuse("too_large"))
            ],
            routes=[
                Route(AGENT_PATH, self.post_agent, methods=["POST"]),
                WebSocketRoute(AGENT_PATH, self.ws_agent),
                Route(EVENTS_PATH, self.sse_events, methods=["GET"]),
                Route(LIVEZ_PATH, self.livez, methods=["GET"]),
                Route(READYZ_PATH, self.readyz, methods=["GET"]),
            ],
        )

    # -- the gate ---------------------------------------------------------------------------

    def authorize(self, headers: Headers, query: QueryParams) -> Grant:
        # A job-end token belongs on POST /_beyond/agent only, and a look-alike nowhere (N21).
        auth = classify_authorization(headers.raw)
        if auth is AuthClass.LOOKALIKE:
            raise Refusal(MALFORMED, "malformed job-end callback authorization", "bad_request")
        if auth is AuthClass.CALLBACK:
            raise Refusal(
                NOT_PERMITTED, f"a job-end token is accepted only on POST {AGENT_PATH}", "forbidden"
            )
        token = headers.get(GRANT_HEADER)
        if token is None:
            raise Refusal(GRANT_REFUSED, f"no grant: send the {GRANT_HEADER} header", "auth")
        try:
            grant = verify_grant(self.verifier, token)
        except GrantError as exc:
            raise refusal_for(exc) from None
        ids = query.getlist(SESSION_ID_PARAM)
        if not ids:
            raise Refusal(MALFORMED, "no session_id in the query", "bad_request")
        if len(ids) > 1:
            raise Refusal(MALFORMED, "session_id is given more than once", "bad_request")
        sid = ids[0]
        if sid != str(grant.session):
            raise Refusal(NOT_PERMITTED, "the grant is for another session", "forbidden")
        tenants = query.getlist(TENANT_PARAM)
        if len(tenants) > 1 or (tenants and tenants[0] != grant.tenant):
            raise Refusal(NOT_PERMITTED, "the grant is for another tenant", "forbidden", sid)
        try:
            parse_session_id(sid)
            parse_tenant(grant.tenant)
            self.registry.store_for(grant.session.shard)
        except (ReplicaError, WireError) as exc:
            raise refusal_for(exc, sid) from None
        return grant

    async def place(self, grant: Grant) -> LiveSession:
        try:
            return await self.registry.place(grant)
        except (ReplicaError, WireError) as exc:
            raise refusal_for(exc, str(grant.session)) from None

    def refused(self, refusal: Refusal) -> Response:
        self.metrics.refuse(refusal.metric)
        if refusal.status >= 500:
            log.info("refused %d: %s", refusal.status, refusal.reason)
        return refusal.response()

    # -- POST -------------------------------------------------------------------------------

    async def post_agent(self, request: Request) -> Response:
        if auth_class(request) is AuthClass.CALLBACK:
            return await self.callbacks.handle(request)
        length = request.headers.get("content-length")
        if length is None:
            return self.refused(Refusal(411, "a command needs a Content-Length", "length_required"))
        if not length.isdigit() or int(length) > protocol.MAX_COMMAND_BYTES:
            return self.refused(Refusal(413, "the command is too large", "too_large"))
        try:
            grant = self.authorize(request.headers, request.query_params)
            sid = str(grant.session)
            try:
                command = protocol.parse_command(await request.body())
            except BadRequest as exc:
                raise refusal_for(exc, sid) from None
            if command.type == "job_ended":
                raise Refusal(
                    MALFORMED,
                    "job_ended is sent by sandboxes with a notify token",
                    "bad_request",
                    sid,
                )
            live = await self.place(grant)
        except Refusal as refusal:
            return self.refused(refusal)
        live.hold()
        try:
            frames = await handle(live, command, self.deps)
        finally:
            live.unhold()
        frame = frames[0]
        status = 200
        if command.type == "prompt":
            status = 202 if frame["type"] == "ack" else 409
        return JSONResponse(frame, status, headers={SESSION_ID_HEADER: sid})

    # -- WebSocket --------------------------------------------------------------------------

    async def ws_agent(self, websocket: WebSocket) -> None:
        try:
            grant = self.authorize(websocket.headers, websocket.query_params)
            live = await self.place(grant)
            try:
                catchup = live.catchup(websocket.query_params.get(SINCE_PARAM))
            except UnknownMessage:
                raise Refusal(
                    UNKNOWN_EVENT_ID,
                    "unknown message id in 'since'",
                    "bad_request",
                    live.session_id,
                ) from None
        except Refusal as refusal:
            await websocket.send_denial_response(self.refused(refusal))
            return
        # Attached in the same step as the catch-up is taken: a frame published while the
        # handshake is written must reach this reader, after the catch-up and not in it.
        subscriber = live.attach("ws")
        subscriber.offer(Outgoing(protocol.dumps(catchup)))
        self.metrics.streams_open.labels("ws").inc()
        try:
            await websocket.accept(headers=[(_WS_SESSION_ID_HEADER, live.session_id.encode())])
            extensions = websocket.scope.get("extensions") or {}
            send_now = extensions.get(WS_SEND_NOW, {}).get("send")
            if send_now is not None:
                subscriber.direct = lambda item: bool(send_now(item.text))
            await _first_done(
                self._ws_reader(websocket, live, subscriber), self._ws_writer(websocket, subscriber)
            )
        finally:
            live.detach(subscriber)
            self.metrics.streams_open.labels("ws").dec()
            code = WS_CLOSE_LAGGED if subscriber.lagged else WS_CLOSE_GOING_AWAY
            with contextlib.suppress(Exception):
                await websocket.close(code)

    async def _ws_reader(self, websocket: WebSocket, live: LiveSession, subscriber: Any) -> None:
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                raw = message.get("text")
                if raw is None:
                    raw = message.get("bytes") or b""
                try:
                    command = protocol.parse_command(raw)
                except BadRequest as exc:
                    subscriber.offer(Outgoing(protocol.dumps(protocol.error(str(exc)))))
                    continue
                if command.type == "job_ended":
                    frames = [protocol.failure(command, "job_ended is sent by sandboxes")]
                else:
                    frames = await handle(live, command, self.deps)
                # An answer on the session's stream comes after the text streamed before it.
                live.flush_text()
                for frame in frames:
                    subscriber.offer(Outgoing(protocol.dumps(frame)))
        except WebSocketDisconnect:
            return

    async def _ws_writer(self, websocket: WebSocket, subscriber: Any) -> None:
        while True:
            item = await subscriber.next()
            if item is None:
                if subscriber.lagged:
                    self.metrics.streams_lagged.labels("ws").inc()
                    with contextlib.suppress(Exception):
                        await websocket.send_text(protocol.dumps({"type": "reconnect"}))
                return
            await websocket.send_text(item.text)

    # -- SSE --------------------------------------------------------------------------------

    async def sse_events(self, request: Request) -> Response:
        try:
            grant = self.authorize(request.headers, request.query_params)
            live = await self.place(grant)
            since = request.headers.get(LAST_EVENT_ID_HEADER) or request.query_params.get(
                SINCE_PARAM
            )
            try:
                catchup = live.catchup(since or None)
            except UnknownMessage:
                raise Refusal(
                    UNKNOWN_EVENT_ID,
                    "unknown event id: the session has no such message",
                    "bad_request",
                    live.session_id,
                ) from None
        except Refusal as refusal:
            return self.refused(refusal)
        subscriber = live.attach("sse")
        extensions = request.scope.get("extensions") or {}
        chunk_now = extensions.get(HTTP_SEND_NOW, {}).get("send")
        if chunk_now is not None:
            subscriber.direct = lambda item: _sse_now(chunk_now, item)
        self.metrics.streams_open.labels("sse").inc()

        async def stream() -> AsyncIterator[ServerSentEvent]:
            try:
                yield ServerSentEvent(data=protocol.dumps(catchup), id=catchup["leaf_id"])
                while True:
                    item = await subscriber.next()
                    if item is None:
                        if subscriber.lagged:
                            self.metrics.streams_lagged.labels("sse").inc()
                            yield ServerSentEvent(event="reconnect", data="fell too far behind")
                        return
                    yield ServerSentEvent(data=item.text, id=item.event_id)
            finally:
                live.detach(subscriber)
                self.metrics.streams_open.labels("sse").dec()

        return EventSourceResponse(
            stream(),
            ping=self.keepalive_s,
            ping_message_factory=lambda: ServerSentEvent(comment="keepalive"),
            headers={
                SESSION_ID_HEADER: live.session_id,
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
            },
        )

    # -- probes -----------------------------------------------------------------------------

    async def livez(self, request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def readyz(self, request: Request) -> Response:
        ok, reason = await self.readiness.check()
        return PlainTextResponse(reason + "\n", 200 if ok else 503)


MAX_HEADER_BYTES = 16 * 1024


class HeaderBound:
    """Refuses a request whose headers add up to more than 16 KiB with 431, before routing (and
    before any WebSocket upgrade). The HTTP parser bounds what it buffers; this bounds what any
    handler ever sees."""

    def __init__(self, app: ASGIApp, on_refuse: Callable[[], None]) -> None:
        self.app = app
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            size = sum(len(name) + len(value) for name, value in scope["headers"])
            if size > MAX_HEADER_BYTES:
                self.on_refuse()
                response = PlainTextResponse("request headers are larger than 16 KiB\n", 431)
                if scope["type"] == "websocket":
                    await WebSocket(scope, receive, send).send_denial_response(response)
                else:
                    await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def sse_event(item: Outgoing) -> bytes | None:
    """The bytes ``ServerSentEvent(data=item.text, id=item.event_id).encode()`` makes, put
    together directly; None for a frame whose text or id holds a line break (never, for frames
    this replica makes), which is left to the library."""
    text, event_id = item.text, item.event_id
    if "\n" in text or "\r" in text:
        return None
    if event_id is None:
        return f"data: {text}\r\n\r\n".encode()
    if "\n" in event_id or "\r" in event_id:
        return None
    return f"id: {event_id}\r\ndata: {text}\r\n\r\n".encode()


def _sse_now(chunk_now: Callable[[bytes], bool], item: Outgoing) -> bool:
    event = sse_event(item)
    return event is not None and chunk_now(event)


async def _first_done(*coroutines: Any) -> None:
    """Run side by side; the first to finish cancels the rest (a supervised pair)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
