"""The page server against a fake edge and control plane, over real loopback sockets."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

from fleet_sim.ports import free_port
from fleet_sim.webui.errors import ConfigError
from fleet_sim.webui.server import COOKIE, WebConfig, WebUI, check_loopback, start_webui

SID = "a07-s1.abcDEF"


@dataclass
class FakeEdge:
    """Edge and control plane in one app; accepts only the grants in ``valid``."""

    valid: set[str] = field(default_factory=lambda: {"good"})
    seen: list[dict[str, Any]] = field(default_factory=list)
    cut: asyncio.Event = field(default_factory=asyncio.Event)
    minted: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/_beyond/agent/events", self.events)
        app.router.add_post("/_beyond/agent", self.command)
        app.router.add_post("/v1/sessions", self.mint)
        app.router.add_post("/v1/grants", self.refresh)
        return app

    def record(self, request: web.Request, body: bytes = b"") -> web.Response | None:
        self.seen.append(
            {"path": request.path, "query": dict(request.query), "headers": request.headers}
        )
        self.seen[-1]["body"] = body
        if request.headers.get("x-beyond-grant") not in self.valid:
            return web.Response(status=401, text="grant did not verify\n")
        return None

    async def events(self, request: web.Request) -> web.StreamResponse:
        refused = self.record(request)
        if refused is not None:
            return refused
        if request.headers.get("Last-Event-ID") == "mUnknown":
            return web.Response(status=409, text="unknown event id\n")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'id: m1\ndata: {"type":"catchup"}\n\n')
        await self.cut.wait()
        assert request.transport is not None
        request.transport.abort()  # the edge dies mid-stream
        return response

    async def command(self, request: web.Request) -> web.Response:
        body = await request.read()
        return self.record(request, body) or web.json_response(
            {"type": "ack", "echo": body.decode()}, status=202
        )

    async def mint(self, request: web.Request) -> web.Response:
        self.minted += 1
        body = await request.json()
        return web.json_response(
            {
                "session_id": SID,
                "tenant": body["tenant"],
                "slice": "a07",
                "shard": "a07-s1",
                "grant": "expired",
            },
            status=201,
        )

    async def refresh(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert body == {"tenant": "demo", "session_id": SID}
        return web.json_response({"grant": "good"})


async def serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@dataclass
class Rig:
    edge: FakeEdge
    url: str
    webui: WebUI
    client: httpx.AsyncClient


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    edge = FakeEdge()
    edge_runner, edge_url = await serve(edge.app())
    config = WebConfig(edge_url, edge_url, connect_retry_s=1.0, connect_interval_s=0.05)
    runner, url, webui = await start_webui(config)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            yield Rig(edge, url, webui, client)
    finally:
        edge.cut.set()
        await runner.cleanup()
        await edge_runner.cleanup()


async def attach(client: httpx.AsyncClient, grant: str = "good") -> httpx.Response:
    return await client.post("/api/sessions/attach", json={"session_id": SID, "grant": grant})


@pytest.mark.anyio
async def test_the_page_is_served_with_a_strict_policy(rig: Rig) -> None:
    page = await rig.client.get("/")
    assert page.status_code == 200 and '<script src="/app.js"' in page.text
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    script = await rig.client.get("/app.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert "EventSource" in script.text
    assert (await rig.client.get("/", headers={"Host": "evil.example"})).status_code == 403
    cross = await rig.client.get("/api/sessions", headers={"Sec-Fetch-Site": "cross-site"})
    assert cross.status_code == 403


@pytest.mark.anyio
async def test_a_minted_grant_stays_on_the_server(rig: Rig) -> None:
    made = await rig.client.post("/api/sessions", json={"tenant": "demo"})
    assert made.status_code == 201
    assert made.json() == {"session_id": SID, "tenant": "demo", "slice": "a07", "shard": "a07-s1"}
    cookie = made.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    for attribute in ("HttpOnly", "SameSite=Strict", "Path=/api"):
        assert attribute in cookie
    listed = await rig.client.get("/api/sessions")
    assert listed.json() == {"sessions": [{"session_id": SID, "tenant": "demo"}]}
    assert "expired" not in listed.text and "good" not in listed.text

    # The minted grant has expired: refreshed through the control plane once, then sent again.
    sent = await rig.client.post(
        "/api/agent", params={"session_id": SID}, json={"type": "prompt", "message": "hi"}
    )
    assert sent.status_code == 202
    assert json.loads(sent.json()["echo"]) == {"type": "prompt", "message": "hi"}
    grants = [s["headers"]["x-beyond-grant"] for s in rig.edge.seen]
    assert grants == ["expired", "good"]
    assert rig.edge.seen[-1]["query"] == {"session_id": SID}

    other = httpx.AsyncClient(base_url=rig.url, timeout=10)
    async with other:
        stranger = await other.post(
            "/api/agent", params={"session_id": SID}, json={"type": "abort"}
        )
    assert stranger.status_code == 401 and len(rig.edge.seen) == 2
    assert (await rig.client.delete("/api/sessions", params={"session_id": SID})).status_code == 204
    assert (await rig.client.get("/api/sessions")).json() == {"sessions": []}


@pytest.mark.anyio
async def test_attach_checks_what_it_keeps(rig: Rig) -> None:
    bad_id = await rig.client.post(
        "/api/sessions/attach", json={"session_id": "../etc", "grant": "good"}
    )
    assert bad_id.status_code == 400
    assert (await attach(rig.client, "has spaces")).status_code == 400
    assert (await attach(rig.client, "x" * 20_000)).status_code == 400
    rig.client.cookies.set(COOKIE, "planted", path="/api")
    first = await attach(rig.client)
    assert first.status_code == 201
    issued = first.cookies[COOKIE]
    assert issued != "planted" and issued in rig.webui.store
    again = await attach(rig.client)
    assert "set-cookie" not in again.headers  # the same browser keeps its id
    # An attached grant is not refreshed: a 401 goes straight back.
    await attach(rig.client, "stale")
    refused = await rig.client.post("/api/agent", params={"session_id": SID}, json={})
    assert refused.status_code == 401 and rig.edge.minted == 0
    not_json = await rig.client.post(
        "/api/agent",
        params={"session_id": SID},
        content=b"[1]",
        headers={"Content-Type": "application/json"},
    )
    assert not_json.status_code == 400


@pytest.mark.anyio
async def test_the_stream_passes_through_and_ends_when_the_edge_breaks(rig: Rig) -> None:
    await attach(rig.client)
    async with rig.client.stream(
        "GET", "/api/events", params={"session_id": SID}, headers={"Last-Event-ID": "m7"}
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"] == "text/event-stream"
        received = b""
        async with asyncio.timeout(10):
            async for chunk in stream.aiter_bytes():
                received += chunk
                if b'"catchup"' in received:
                    rig.edge.cut.set()
    # The browser is told to come back soon; the edge's bytes follow unchanged; then a clean end.
    assert received == b'retry: 1000\n\nid: m1\ndata: {"type":"catchup"}\n\n'
    upstream = rig.edge.seen[-1]
    assert upstream["headers"]["Last-Event-ID"] == "m7"
    assert upstream["headers"]["x-beyond-grant"] == "good"
    assert upstream["query"] == {"session_id": SID}

    unknown = await rig.client.get(
        "/api/events", params={"session_id": SID}, headers={"Last-Event-ID": "mUnknown"}
    )
    assert unknown.status_code == 409
    bad = await rig.client.get(
        "/api/events", params={"session_id": SID}, headers={"Last-Event-ID": "a\\b"}
    )
    assert bad.status_code == 400


@pytest.mark.anyio
async def test_a_stream_waits_a_bounded_time_for_the_edge_and_a_command_does_not() -> None:
    port = free_port()
    edge = FakeEdge()
    config = WebConfig(f"http://127.0.0.1:{port}", connect_retry_s=3.0, connect_interval_s=0.05)
    runner, url, _ = await start_webui(config)
    edge_runner = None
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            await attach(client)
            started = time.monotonic()
            command = await client.post("/api/agent", params={"session_id": SID}, json={})
            assert command.status_code == 502 and time.monotonic() - started < 1.0

            async def edge_comes_back() -> None:
                nonlocal edge_runner
                await asyncio.sleep(0.5)  # an edge down for 0.5 s, which the stream waits out
                edge_runner, _ = await serve(edge.app(), port)

            late = asyncio.ensure_future(edge_comes_back())
            async with client.stream("GET", "/api/events", params={"session_id": SID}) as stream:
                assert stream.status_code == 200
                assert time.monotonic() - started >= 0.5
            await late
    finally:
        edge.cut.set()
        await runner.cleanup()
        if edge_runner is not None:
            await edge_runner.cleanup()

    quick = WebConfig(f"http://127.0.0.1:{free_port()}", connect_retry_s=0.3)
    runner, url, _ = await start_webui(quick)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            await attach(client)
            gone = await client.get("/api/events", params={"session_id": SID})
            assert gone.status_code == 502 and "unreachable" in gone.text
    finally:
        await runner.cleanup()


@pytest.mark.anyio
async def test_minting_needs_a_control_plane() -> None:
    runner, url, _ = await start_webui(WebConfig("http://127.0.0.1:9"))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/api/config")).json()["can_mint"] is False
            assert (await client.post("/api/sessions", json={})).status_code == 503
    finally:
        await runner.cleanup()


def test_loopback_only_and_http_urls() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        check_loopback(host)
    for host in ("0.0.0.0", "::", "10.0.0.1", "192.168.1.1", "example.com", ""):
        with pytest.raises(ConfigError):
            check_loopback(host)
    for url in ("ftp://127.0.0.1", "127.0.0.1:80", "http://"):
        with pytest.raises(ConfigError):
            WebConfig(url)
