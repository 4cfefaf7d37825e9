from __future__ import annotations

import asyncio
import base64
import os

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from edge.aio.websocket import sendable_close_code
from tests.edge.fakes import (
    FakeReplica,
    echo_websocket,
    fleet,
    refuse,
    sample,
    script,
    session_with_walk,
)
from tests.harness import eventually_async

PATH = "/_beyond/agent?session_id=a07-s1.x&tenant=t1"


@pytest.mark.anyio
async def test_frames_relay_both_ways_with_grant_and_subprotocol() -> None:
    r1 = FakeReplica("r1")
    r1.handler = echo_websocket(r1, protocols=("beyond.v1",))
    async with fleet(r1) as edge, aiohttp.ClientSession() as client:
        async with client.ws_connect(
            edge.url + PATH, headers={"x-beyond-grant": "g.r.ant"}, protocols=("beyond.v1", "x")
        ) as ws:
            assert ws.protocol == "beyond.v1"
            assert sample(edge, "edge_open_streams", kind="websocket") == 1
            await ws.send_str('{"type": "get_state"}')
            assert await ws.receive_str(timeout=2) == 'echo:{"type": "get_state"}'
            await ws.send_bytes(b"\x00\x01\x02")
            assert await ws.receive_bytes(timeout=2) == b"\x02\x01\x00"
        await eventually_async(
            lambda: sample(edge, "edge_open_streams", kind="websocket") == 0, timeout=3.0
        )
        assert sample(edge, "edge_requests_total", kind="websocket", outcome="delivered") == 1
    (seen,) = r1.seen
    assert seen.header("x-beyond-grant") == [b"g.r.ant"] and seen.raw_target == PATH
    assert r1.ws.protocol == "beyond.v1"


@pytest.mark.anyio
async def test_the_clients_close_code_reaches_the_replica() -> None:
    r1 = FakeReplica("r1")
    r1.handler = echo_websocket(r1)
    async with fleet(r1) as edge, aiohttp.ClientSession() as client:
        ws = await client.ws_connect(edge.url + PATH)
        await ws.send_str("hello")
        assert await ws.receive_str(timeout=2) == "echo:hello"
        await ws.close(code=4000, message=b"client done")
        assert ws.close_code == 4000
        await eventually_async(lambda: r1.ws.close_code is not None, timeout=3.0)
    assert r1.ws.close_code == 4000


@pytest.mark.anyio
async def test_the_replicas_close_code_reaches_the_client() -> None:
    r1 = FakeReplica("r1")
    r1.handler = echo_websocket(r1)
    async with fleet(r1) as edge, aiohttp.ClientSession() as client:
        ws = await client.ws_connect(edge.url + PATH)
        await ws.send_str("close:4001")
        msg = await ws.receive(timeout=2)
        assert msg.type is WSMsgType.CLOSE
        assert (msg.data, msg.extra) == (4001, "replica says bye")
        await ws.close()


@pytest.mark.anyio
async def test_pings_and_pongs_are_relayed() -> None:
    r1 = FakeReplica("r1")
    r1.handler = echo_websocket(r1)  # aiohttp answers pings itself (autoping)
    async with (
        fleet(r1) as edge,
        aiohttp.ClientSession() as client,
        client.ws_connect(edge.url + PATH, autoping=False) as ws,
    ):
        await ws.ping(b"are-you-there")
        msg = await ws.receive(timeout=2)
        assert (msg.type, msg.data) == (WSMsgType.PONG, b"are-you-there")


@pytest.mark.anyio
async def test_a_vanished_replica_closes_the_client_with_1011() -> None:
    gone = asyncio.Event()

    async def vanish(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()
        assert request.transport is not None
        request.transport.abort()
        gone.set()
        return ws

    r1 = FakeReplica("r1", vanish)
    async with fleet(r1) as edge, aiohttp.ClientSession() as client:
        ws = await client.ws_connect(edge.url + PATH)
        await ws.send_str("anything")
        msg = await ws.receive(timeout=3)
        assert (msg.type, msg.data) == (WSMsgType.CLOSE, 1011)
        await ws.close()


async def raw_upgrade(url: str) -> tuple[int, bytes]:
    """A hand-made upgrade request, so the refusal body can be read."""
    key = base64.b64encode(os.urandom(16)).decode()
    headers = {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": key,
        "Sec-WebSocket-Version": "13",
        "x-beyond-grant": "expired",
    }
    async with aiohttp.ClientSession() as client, client.get(url, headers=headers) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize("status", [400, 401, 403])
@pytest.mark.anyio
async def test_a_refused_upgrade_is_that_status_with_its_body(status: int) -> None:
    r1, r2 = FakeReplica("r1", refuse(status, "grant did not verify")), FakeReplica("r2")
    sid = session_with_walk(("r1", "r2"), ("r1",))
    async with fleet(r1, r2) as edge:
        got = await raw_upgrade(f"{edge.url}/_beyond/agent?session_id={sid}")
        assert sample(edge, "edge_open_streams", kind="websocket") == 0
    assert got == (status, b"grant did not verify")
    assert len(r1.seen) == 1 and not r2.seen


@pytest.mark.anyio
async def test_a_busy_owner_is_walked_past_before_upgrading() -> None:
    r1 = FakeReplica("r1", refuse(503, "held elsewhere"))
    r2 = FakeReplica("r2")
    r2.handler = script(echo_websocket(r2))
    sid = session_with_walk(("r1", "r2"), ("r1", "r2"))
    async with (
        fleet(r1, r2) as edge,
        aiohttp.ClientSession() as client,
        client.ws_connect(f"{edge.url}/_beyond/agent?session_id={sid}") as ws,
    ):
        await ws.send_str("hi")
        assert await ws.receive_str(timeout=2) == "echo:hi"
    assert len(r1.seen) == 3 and len(r2.seen) == 1


@pytest.mark.anyio
async def test_budget_exhaustion_refuses_the_upgrade() -> None:
    r1 = FakeReplica("r1", refuse(503, "held elsewhere"))
    async with fleet(r1, retry_budget_s=0.2) as edge:
        status, body = await raw_upgrade(edge.url + PATH)
    assert status == 503 and b"held elsewhere" in body


@pytest.mark.anyio
async def test_edge_shutdown_closes_relayed_sockets_with_1001() -> None:
    r1 = FakeReplica("r1")
    r1.handler = echo_websocket(r1)
    async with fleet(r1) as edge, aiohttp.ClientSession() as client:
        ws = await client.ws_connect(edge.url + PATH)
        await ws.send_str("x")
        assert await ws.receive_str(timeout=2) == "echo:x"
        await edge.drain(0.1)
        msg = await ws.receive(timeout=3)
        assert (msg.type, msg.data) == (WSMsgType.CLOSE, 1001)
        await ws.close()
        await eventually_async(lambda: r1.ws.close_code is not None, timeout=3.0)
    assert r1.ws.close_code == 1001


def test_close_codes_that_may_not_be_sent_are_mapped() -> None:
    assert sendable_close_code(4000, fallback=1011) == 4000
    assert sendable_close_code(1000, fallback=1011) == 1000
    assert sendable_close_code(None, fallback=1011) == 1000
    assert sendable_close_code(1005, fallback=1011) == 1000
    assert sendable_close_code(1006, fallback=1011) == 1011
    assert sendable_close_code(1015, fallback=1001) == 1001
    assert sendable_close_code(2500, fallback=1011) == 1011
