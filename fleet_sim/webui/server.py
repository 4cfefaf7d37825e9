"""The page server: one static page, and a same-origin proxy to the edge that adds the grant.

A browser's ``EventSource`` cannot send headers, and the edge takes a session's grant only from
``x-beyond-grant``. Rather than teach the edge and the replicas to read grants from URLs (they end
up in logs and history) or from cookies (another port is another origin, so the cookie would have
to be cross-site), this server sits on the page's own origin and forwards the page's requests to
the edge, adding the header itself. The grant is minted here through the control plane, or pasted
once, and then stays here: the browser holds only an opaque ``HttpOnly`` client cookie.

The proxy is deliberately thin. The event stream passes through byte for byte, with the browser's
``Last-Event-ID`` forwarded unchanged, so a browser that lost its stream resumes after the last
committed message it saw. When the edge goes away mid-stream the response simply ends, which is
what makes ``EventSource`` reconnect; a reconnect that finds the edge still down waits for it a
bounded time (connection errors only, and only for the stream, which is safe to repeat), since an
HTTP error would make the browser give up for good. Commands are never retried.

Started with a running fleet's state file, it also serves the fleet view and its fault buttons
(:mod:`fleet_sim.webui.fleet`); the control endpoint's token stays here with the grants.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from fleet_sim.webui.errors import ConfigError
from fleet_sim.webui.fleet import FleetView
from fleet_sim.webui.guard import Allowed, refusal
from fleet_sim.webui.store import GrantStore, Held
from wire.errors import InvalidName
from wire.http import AGENT_PATH, EVENTS_PATH, GRANT_HEADER
from wire.names import parse_session_id, parse_tenant

log = logging.getLogger("fleet_sim.webui")

COOKIE: Final = "fleet_webui"
STATIC = Path(__file__).resolve().parent / "static"
MAX_BODY = 1024 * 1024
MAX_GRANT = 16 * 1024
MAX_CONNECT_ATTEMPTS = 400
_GRANT = re.compile(r"[A-Za-z0-9_\-=.]+")
_EVENT_ID = re.compile(r"[A-Za-z0-9_\-]{1,128}")
_PAGES: Final = {
    "/": ("index.html", "text/html"),
    "/app.js": ("app.js", "text/javascript"),
    "/fleet.js": ("fleet.js", "text/javascript"),
    "/style.css": ("style.css", "text/css"),
}
_PAGE_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class WebConfig:
    edge_url: str
    control_plane_url: str | None = None
    state_file: Path | None = None
    """A running ``fleet-sim up``'s state: the fleet view and its fault buttons work from it."""
    connect_retry_s: float = 15.0
    """How long a stream request waits for an edge that refuses connections."""
    connect_interval_s: float = 0.25
    reconnect_ms: int = 1000
    """The reconnection time told to browsers (their default is a few seconds)."""
    stream_read_timeout_s: float = 45.0
    """Three missed keepalives: the edge or replica is gone without closing the socket."""
    command_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for url in (self.edge_url, self.control_plane_url):
            if url is not None and (
                urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname
            ):
                raise ConfigError(f"not an http(s) URL: {url!r}")
        if self.connect_retry_s < 0 or self.connect_interval_s <= 0 or self.reconnect_ms < 0:
            raise ConfigError("retry times must not be negative")


def check_loopback(host: str) -> None:
    """The server holds grants and can mint sessions: it must not be reachable from elsewhere."""
    if host == "localhost":
        return
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ConfigError(f"listen on a loopback address, not {host!r}") from None
    if not address.is_loopback:
        raise ConfigError(f"listen on a loopback address, not {host!r}")


class WebUI:
    def __init__(self, config: WebConfig, store: GrantStore | None = None) -> None:
        self.config = config
        self.store = store or GrantStore()
        self.allowed = Allowed(frozenset())  # set once the port is known
        self._http: aiohttp.ClientSession | None = None
        self.fleet = FleetView(config.state_file) if config.state_file is not None else None
        self._pages = {path: (STATIC / name).read_bytes() for path, (name, _) in _PAGES.items()}

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "the app has not started"
        return self._http

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._guard])
        for path in _PAGES:
            app.router.add_get(path, self.page)
        app.router.add_get("/api/config", self.describe)
        app.router.add_get("/api/sessions", self.list_sessions)
        app.router.add_post("/api/sessions", self.mint)
        app.router.add_post("/api/sessions/attach", self.attach)
        app.router.add_delete("/api/sessions", self.forget)
        app.router.add_post("/api/agent", self.command)
        app.router.add_get("/api/events", self.events)
        app.router.add_get("/api/fleet", self.fleet_view)
        app.router.add_post("/api/fault", self.fault)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        # No total timeout on the session: streams are open-ended; each call sets its own.
        # No pooled connections either: a command is never retried, so it must not be sent on
        # a kept-alive connection to an edge that has since restarted.
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
        )
        if self.fleet is not None:
            await self.fleet.start()

    async def _stop(self, app: web.Application) -> None:
        if self.fleet is not None:
            await self.fleet.close()
        if self._http is not None:
            await self._http.close()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        reason = refusal(request.method, request.headers, self.allowed)
        if reason is not None:
            return _text(403, reason)
        response = await handler(request)
        if request.path.startswith("/api/"):
            response.headers.setdefault("Cache-Control", "no-store")
        return response

    # -- the page ---------------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.Response:
        _, content_type = _PAGES[request.path]
        return web.Response(
            body=self._pages[request.path],
            content_type=content_type,
            charset="utf-8",
            headers=_PAGE_HEADERS,
        )

    async def describe(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "edge_url": self.config.edge_url,
                "can_mint": self.config.control_plane_url is not None,
                "fleet": self.fleet is not None,
            }
        )

    # -- sessions held for this browser -----------------------------------------------------

    async def list_sessions(self, request: web.Request) -> web.Response:
        held = self.store.sessions(request.cookies.get(COOKIE))
        return web.json_response(
            {"sessions": [{"session_id": h.session_id, "tenant": h.tenant} for h in held]}
        )

    async def mint(self, request: web.Request) -> web.Response:
        if self.config.control_plane_url is None:
            return _text(503, "no control plane is configured: attach a session id and grant")
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        try:
            tenant = parse_tenant(body.get("tenant", "demo"))
        except InvalidName as exc:
            return _text(400, str(exc))
        try:
            async with self.http.post(
                f"{self.config.control_plane_url}/v1/sessions",
                json={"tenant": tenant},
                timeout=aiohttp.ClientTimeout(total=self.config.command_timeout_s),
            ) as answer:
                if answer.status != 201:
                    return _text(502, f"the control plane answered {answer.status}")
                made: dict[str, Any] = await answer.json()
                held = Held(str(made["session_id"]), str(made["grant"]), tenant)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            return _text(502, f"the control plane did not mint a session: {type(exc).__name__}")
        response = web.json_response(
            {key: made.get(key) for key in ("session_id", "tenant", "slice", "shard")}, status=201
        )
        self._keep(request, response, held)
        return response

    async def attach(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        grant = body.get("grant")
        try:
            session_id = str(parse_session_id(body.get("session_id")))
        except InvalidName as exc:
            return _text(400, str(exc))
        if not isinstance(grant, str) or len(grant) > MAX_GRANT or not _GRANT.fullmatch(grant):
            return _text(400, "the grant must be the token the control plane issued")
        response = web.json_response({"session_id": session_id, "tenant": None}, status=201)
        self._keep(request, response, Held(session_id, grant))
        return response

    async def forget(self, request: web.Request) -> web.Response:
        forgotten = self.store.forget(
            request.cookies.get(COOKIE), request.query.get("session_id", "")
        )
        return web.Response(status=204 if forgotten else 404)

    def _keep(self, request: web.Request, response: web.Response, held: Held) -> None:
        client = request.cookies.get(COOKIE)
        if client not in self.store:
            # Never adopt an id the store did not issue: a planted cookie must not become a
            # shared slot.
            client = self.store.new_client_id()
            response.set_cookie(COOKIE, client, path="/api", httponly=True, samesite="Strict")
        assert client is not None
        self.store.put(client, held)

    def _held(self, request: web.Request) -> Held | web.Response:
        try:
            session_id = str(parse_session_id(request.query.get("session_id")))
        except InvalidName as exc:
            return _text(400, str(exc))
        held = self.store.get(request.cookies.get(COOKIE), session_id)
        if held is None:
            return _text(401, "this browser holds no grant for that session: open or attach it")
        return held

    # -- the fleet ------------------------------------------------------------------------------

    async def fleet_view(self, request: web.Request) -> web.Response:
        if self.fleet is None:
            return _no_fleet()
        open_id = None
        if "session_id" in request.query:
            held = self._held(request)
            if isinstance(held, web.Response):
                return held
            open_id = held.session_id
        return web.json_response(await self.fleet.view(open_id))

    async def fault(self, request: web.Request) -> web.Response:
        if self.fleet is None:
            return _no_fleet()
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return web.json_response({"error": 'expected {"verb": ..., "target": ...}'}, status=400)
        status, answer = await self.fleet.fault(body.get("verb"), body.get("target"))
        return web.json_response(answer, status=status)

    # -- the proxy --------------------------------------------------------------------------

    async def command(self, request: web.Request) -> web.Response:
        held = self._held(request)
        if isinstance(held, web.Response):
            return held
        body = await request.read()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            return _text(400, "a command is a JSON object")
        try:
            upstream = await self._upstream(
                request,
                held,
                "POST",
                AGENT_PATH,
                {"Content-Type": "application/json"},
                body=body,
                limits=aiohttp.ClientTimeout(total=self.config.command_timeout_s),
                patient=False,
            )
            async with upstream:
                payload = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _text(502, f"the edge is unreachable: {type(exc).__name__}")
        return web.Response(
            status=upstream.status,
            body=payload,
            headers={"Content-Type": upstream.headers.get("Content-Type", "text/plain")},
        )

    async def events(self, request: web.Request) -> web.StreamResponse:
        held = self._held(request)
        if isinstance(held, web.Response):
            return held
        headers = {"Accept": "text/event-stream"}
        last = request.headers.get("Last-Event-ID", "")
        since = request.query.get("since", "")
        for value in (last, since):
            if value and not _EVENT_ID.fullmatch(value):
                return _text(400, "an event id is a message id")
        if last:
            headers["Last-Event-ID"] = last
        # Message ids are not secrets, and this line is how an operator sees a resume happen.
        log.info("stream opened: Last-Event-ID %s, since %s", last or "-", since or "-")
        try:
            upstream = await self._upstream(
                request,
                held,
                "GET",
                EVENTS_PATH,
                headers,
                extra={"since": since} if since else {},
                limits=aiohttp.ClientTimeout(
                    total=None, sock_connect=5, sock_read=self.config.stream_read_timeout_s
                ),
                patient=True,
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _text(502, f"the edge is unreachable: {type(exc).__name__}")
        async with upstream:
            if upstream.status != 200:
                return web.Response(
                    status=upstream.status,
                    body=await upstream.content.read(64 * 1024),
                    headers={"Content-Type": upstream.headers.get("Content-Type", "text/plain")},
                )
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-store",
                    "X-Accel-Buffering": "no",
                }
            )
            await response.prepare(request)
            try:
                await response.write(f"retry: {self.config.reconnect_ms}\n\n".encode())
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientError, TimeoutError):
                # The edge went away mid-stream. Ending the response is the signal that makes
                # the browser reconnect, carrying the last id it saw.
                log.info("stream from the edge broke off: ending it so the browser resumes")
            except ConnectionResetError:
                pass  # the browser left
            return response

    async def _upstream(
        self,
        request: web.Request,
        held: Held,
        method: str,
        path: str,
        headers: Mapping[str, str],
        *,
        extra: Mapping[str, str] | None = None,
        body: bytes | None = None,
        limits: aiohttp.ClientTimeout,
        patient: bool,
    ) -> aiohttp.ClientResponse:
        """Send to the edge with the grant. A grant minted here that has expired is refreshed
        through the control plane once, and the request sent again."""
        params = {"session_id": held.session_id, **(extra or {})}
        url = f"{self.config.edge_url}{path}"
        response = await self._connect(
            method, url, params, {**headers, GRANT_HEADER: held.grant}, body, limits, patient
        )
        if response.status != 401 or held.tenant is None:
            return response
        fresh = await self._refresh(request, held)
        if fresh is None:
            return response
        response.release()
        return await self._connect(
            method, url, params, {**headers, GRANT_HEADER: fresh.grant}, body, limits, patient
        )

    async def _connect(
        self,
        method: str,
        url: str,
        params: Mapping[str, str],
        headers: Mapping[str, str],
        body: bytes | None,
        limits: aiohttp.ClientTimeout,
        patient: bool,
    ) -> aiohttp.ClientResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.connect_retry_s if patient else 0.0)
        attempts = 0
        while True:
            attempts += 1
            try:
                return await self.http.request(
                    method, url, params=params, headers=headers, data=body, timeout=limits
                )
            except aiohttp.ClientConnectionError:
                # Refused or reset before any answer: the edge is restarting. Only the stream,
                # which changes nothing, is worth waiting for.
                late = loop.time() + self.config.connect_interval_s > deadline
                if late or attempts >= MAX_CONNECT_ATTEMPTS:
                    raise
            await asyncio.sleep(self.config.connect_interval_s)

    async def _refresh(self, request: web.Request, held: Held) -> Held | None:
        if self.config.control_plane_url is None:
            return None
        try:
            async with self.http.post(
                f"{self.config.control_plane_url}/v1/grants",
                json={"tenant": held.tenant, "session_id": held.session_id},
                timeout=aiohttp.ClientTimeout(total=self.config.command_timeout_s),
            ) as answer:
                if answer.status != 200:
                    return None
                grant = str((await answer.json())["grant"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return None
        fresh = Held(held.session_id, grant, held.tenant)
        client = request.cookies.get(COOKIE)
        if client is not None:
            self.store.put(client, fresh)
        return fresh


async def _json_object(request: web.Request) -> dict[str, Any] | web.Response:
    try:
        body = await request.json()
    except ValueError:
        return _text(400, "the body must be JSON")
    if not isinstance(body, dict):
        return _text(400, "the body must be a JSON object")
    return body


def _no_fleet() -> web.Response:
    return web.json_response(
        {
            "error": "this page server was started without --state, so it has no fleet to "
            "show (`fleet-sim up` starts it with one)"
        },
        status=404,
    )


def _text(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message + "\n")


async def start_webui(
    config: WebConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str, WebUI]:
    """Serve the page on ``host:port`` (loopback only); return the runner and the page's URL."""
    check_loopback(host)
    host = host.strip("[]")
    webui = WebUI(config)
    # Cancel a handler when its browser leaves, so an idle stream does not hold the edge open.
    runner = web.AppRunner(webui.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound_port = runner.addresses[0][1]
    webui.allowed = Allowed.for_port(bound_port, host)
    shown = f"[{host}]" if ":" in host else host
    return runner, f"http://{shown}:{bound_port}", webui
