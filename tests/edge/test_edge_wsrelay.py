"""The edge's WebSocket byte relay (edge.aio.wsrelay) against real servers on 127.0.0.1, on
asyncio's loop and on uvloop's (the edge's own): ends written by hand (tests/edge/wsraw.py) see
the exact bytes on the wire, aiohttp ends see what a library makes of them."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import WSMsgType, web

from edge.aio.wsrelay import Relay, State
from edge.server import Edge
from tests.edge.fakes import FakeReplica, echo_websocket, fleet, sample
from tests.edge.wsraw import (
    BINARY,
    CLOSE,
    CONTINUATION,
    PING,
    PONG,
    TEXT,
    Clients,
    Peer,
    RawReplica,
    accept,
    close_payload,
    frame,
)
from tests.harness import eventually_async

PATH = "/_beyond/agent?session_id=a07-s1.x&tenant=t1"


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"loop_factory": uvloop.new_event_loop}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    param: tuple[str, dict[str, Any]] = request.param
    return param


@asynccontextmanager
async def clients() -> AsyncIterator[Clients]:
    opened = Clients()
    try:
        yield opened
    finally:
        opened.close()


@asynccontextmanager
async def raw_fleet(raw: RawReplica, **options: Any) -> AsyncIterator[tuple[Edge, Clients]]:
    """An edge over ``raw``, and the hand-made clients of the test. Ends written by hand do
    not answer close frames unless a test says so: the edge's close time is cut to a second,
    so that the sessions a test leaves open end quickly when the edge drains."""
    await raw.start()
    try:
        async with fleet(extra=[(raw.name, raw.url)], **options) as edge, clients() as opened:
            edge.dispatch.websockets.close_timeout_s = 1.0
            yield edge, opened
    finally:
        await raw.close()


def the_relay(edge: Edge) -> Relay:
    (relay,) = edge.dispatch.websockets.relays
    return relay


async def closed_after(peer: Peer) -> bytes:
    """What ``peer`` reads until its connection ends (b"" if it ends cleanly at once)."""
    try:
        return await asyncio.wait_for(peer.reader.read(), 5)
    except ConnectionResetError:
        return b"<reset>"


@pytest.mark.anyio
async def test_frames_of_every_size_pass_unchanged_both_ways() -> None:
    raw = RawReplica()
    async with raw_fleet(raw) as (edge, ends):
        client, status = await ends.connect(edge.url, PATH)
        assert status.startswith(b"HTTP/1.1 101")
        replica = await raw.peers.get()
        for size in (0, 1, 125, 126, 65535, 65536, 3 * 1024 * 1024 + 7):
            payload = os.urandom(size)
            up = frame(BINARY, payload, masked=True)
            client.send(up)
            assert await replica.reader.readexactly(len(up)) == up  # mask and all
            down = frame(BINARY, payload)
            replica.send(down)
            assert await client.reader.readexactly(len(down)) == down
        assert sample(edge, "edge_open_streams", kind="websocket") == 1


@pytest.mark.anyio
async def test_fragments_and_control_frames_pass_as_sent() -> None:
    raw = RawReplica()
    async with (
        raw_fleet(raw) as (edge, _),
        aiohttp.ClientSession() as session,
        session.ws_connect(edge.url + PATH, autoping=True) as ws,
    ):
        replica = await raw.peers.get()
        # A fragmented text message with a ping between its fragments, sent in pieces
        # that cut through headers and payloads alike.
        wire = (
            frame(TEXT, b"hel", fin=False)
            + frame(PING, b"are-you-there")
            + frame(CONTINUATION, b"lo ", fin=False)
            + frame(CONTINUATION, b"w" * 300)
        )
        for cut in range(0, len(wire), 7):
            replica.send(wire[cut : cut + 7])
            await replica.writer.drain()
        assert await ws.receive_str(timeout=5) == "hello " + "w" * 300
        # The client's pong (aiohttp answers pings itself) reaches the replica masked.
        pong = await replica.frame()
        assert (pong.opcode, pong.payload, pong.masked) == (PONG, b"are-you-there", True)
        # Pings the other way, and their pongs.
        await ws.ping(b"and-you")
        ping = await replica.frame()
        assert (ping.opcode, ping.payload, ping.masked) == (PING, b"and-you", True)
        replica.send(frame(PONG, b"and-you"))
        # A fragmented binary message from the client arrives as the same fragments.
        await ws.send_frame(b"ab", WSMsgType.BINARY)
        got = await replica.frame()
        assert (got.fin, got.opcode, got.payload) == (True, BINARY, b"ab")


@pytest.mark.anyio
async def test_pongs_reach_a_client_that_reads_them() -> None:
    r1 = FakeReplica("r1")
    r1.handler = echo_websocket(r1)  # aiohttp answers pings itself
    async with (
        fleet(r1) as edge,
        aiohttp.ClientSession() as session,
        session.ws_connect(edge.url + PATH, autoping=False) as ws,
    ):
        for n in range(3):
            await ws.ping(b"ping %d" % n)
            msg = await ws.receive(timeout=5)
            assert (msg.type, msg.data) == (WSMsgType.PONG, b"ping %d" % n)


@pytest.mark.anyio
async def test_bytes_sent_with_either_handshake_are_relayed_in_order() -> None:
    # The replica's first frame in the same write (one packet) as its 101; the client's first
    # frame in the same write as its upgrade request, read by aiohttp before the relay starts.
    raw = RawReplica(first=lambda _: frame(TEXT, b"catch-up") + frame(TEXT, b"then this"))
    async with raw_fleet(raw) as (edge, ends):
        early = frame(TEXT, b"early", masked=True)
        client, status = await ends.connect(edge.url, PATH, pipelined=early)
        assert status.startswith(b"HTTP/1.1 101")
        assert await client.frame() == (True, TEXT, b"catch-up", False)
        assert await client.frame() == (True, TEXT, b"then this", False)
        replica = await raw.peers.get()
        client.send(frame(TEXT, b"later", masked=True))
        assert (await replica.frame()).payload == b"early"
        assert (await replica.frame()).payload == b"later"


@pytest.mark.anyio
async def test_a_first_frame_with_the_101_reaches_an_aiohttp_client() -> None:
    raw = RawReplica(first=lambda _: frame(TEXT, b'{"type": "catch_up"}'))
    async with (
        raw_fleet(raw) as (edge, _),
        aiohttp.ClientSession() as session,
        session.ws_connect(edge.url + PATH) as ws,
    ):
        assert await ws.receive_str(timeout=5) == '{"type": "catch_up"}'


@pytest.mark.anyio
async def test_a_slow_reader_stops_the_edge_reading_the_replica() -> None:
    total = 64 * 1024 * 1024
    chunk = b"z" * (64 * 1024)
    sent = 0
    replica_transport: list[asyncio.Transport] = []

    async def flood(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        assert request.transport is not None
        replica_transport.append(request.transport)
        while sent < total:
            await ws.send_bytes(chunk)  # waits while its transport cannot write
            sent += len(chunk)
        await ws.receive()
        return ws

    r1 = FakeReplica("r1", flood)
    async with fleet(r1) as edge, clients() as ends:
        client, _ = await ends.connect(edge.url, PATH)  # and read nothing for now
        relay = await eventually_async(lambda: edge.dispatch.websockets.relays)
        relay = the_relay(edge)

        def backed_up() -> bool:
            # The edge has stopped reading the replica, and the replica cannot write.
            return (
                relay.replica.paused
                and not relay.replica.transport.is_reading()
                and bool(replica_transport)
                and replica_transport[0].get_write_buffer_size() > 0
            )

        await eventually_async(backed_up, timeout=20)
        assert sent < total
        # What the edge holds for the client is bounded by its transport's high-water mark and
        # one read, however much the replica has to send.
        assert relay.client.transport.get_write_buffer_size() <= 1024 * 1024
        head = frame(BINARY, chunk)[: -len(chunk)]
        for _ in range(total // len(chunk)):
            assert await client.reader.readexactly(len(head)) == head
            assert await client.reader.readexactly(len(chunk)) == chunk
        assert sent == total
        assert not relay.replica.paused


@pytest.mark.anyio
async def test_the_clients_close_reaches_the_replica_and_is_answered() -> None:
    raw = RawReplica()
    async with raw_fleet(raw) as (edge, _), aiohttp.ClientSession() as session:
        ws = await session.ws_connect(edge.url + PATH)
        replica = await raw.peers.get()
        closing = asyncio.ensure_future(ws.close(code=4000, message=b"client done"))
        got = await replica.frame()
        assert (got.opcode, got.payload, got.masked) == (
            CLOSE,
            close_payload(4000, b"client done"),
            True,
        )
        assert not closing.done()  # the client's close is answered once the replica's is in
        replica.send(frame(CLOSE, close_payload(1000)))
        await closing
        assert ws.close_code == 4000  # the edge answers with the code the client sent
        assert await closed_after(replica) == b""
        await eventually_async(lambda: not edge.dispatch.websockets.relays)
        assert sample(edge, "edge_open_streams", kind="websocket") == 0


@pytest.mark.anyio
async def test_the_replicas_close_reaches_the_client_and_is_answered() -> None:
    raw = RawReplica()
    async with raw_fleet(raw) as (edge, _), aiohttp.ClientSession() as session:
        ws = await session.ws_connect(edge.url + PATH, autoclose=False)
        replica = await raw.peers.get()
        replica.send(frame(CLOSE, close_payload(4001, "bye ✓".encode())))
        msg = await ws.receive(timeout=5)
        assert (msg.type, msg.data, msg.extra) == (WSMsgType.CLOSE, 4001, "bye ✓")
        await ws.close(code=1000)
        got = await replica.frame()
        assert (got.opcode, got.payload) == (CLOSE, close_payload(4001, "bye ✓".encode()))
        assert await closed_after(replica) == b""


@pytest.mark.parametrize(
    ("sent", "received"),
    [
        (b"", close_payload(1000)),  # no status: 1005 is never sent
        (close_payload(1006), close_payload(1011)),  # 1006 may not be sent
        (close_payload(2999, b"odd"), close_payload(1011, b"odd")),
        (close_payload(4999, b"ok"), close_payload(4999, b"ok")),
    ],
)
@pytest.mark.anyio
async def test_close_codes_that_may_not_be_sent_are_mapped_on_the_way(
    sent: bytes, received: bytes
) -> None:
    raw = RawReplica()
    async with raw_fleet(raw) as (edge, ends):
        client, _ = await ends.connect(edge.url, PATH)
        replica = await raw.peers.get()
        replica.send(frame(CLOSE, sent))
        assert await client.frame() == (True, CLOSE, received, False)
        # From the client, an empty close reaches the replica as 1000 (1006 would be 1000 too).
        client2, _ = await ends.connect(edge.url, PATH)
        replica2 = await raw.peers.get()
        client2.send(frame(CLOSE, b"", masked=True))
        got = await replica2.frame()
        assert (got.opcode, got.payload) == (CLOSE, close_payload(1000))


@pytest.mark.anyio
async def test_a_replica_lost_between_frames_closes_the_client_with_1011() -> None:
    raw = RawReplica()
    async with raw_fleet(raw) as (edge, _), aiohttp.ClientSession() as session:
        ws = await session.ws_connect(edge.url + PATH, autoclose=False)
        replica = await raw.peers.get()
        replica.send(frame(TEXT, b"last words"))
        assert await ws.receive_str(timeout=5) == "last words"
        replica.abort()
        msg = await ws.receive(timeout=5)
        assert (msg.type, msg.data, msg.extra) == (
            WSMsgType.CLOSE,
            1011,
            "the replica connection was lost",
        )
        await ws.close()
        await eventually_async(lambda: not edge.dispatch.websockets.relays)


@pytest.mark.anyio
async def test_a_replica_lost_mid_frame_aborts_the_client() -> None:
    raw = RawReplica()
    async with raw_fleet(raw) as (edge, ends):
        client, _ = await ends.connect(edge.url, PATH)
        replica = await raw.peers.get()
        partial = frame(BINARY, b"x" * 1000)[:500]
        replica.send(partial)
        assert await client.reader.readexactly(len(partial)) == partial
        replica.abort()
        # No close frame can follow half a frame: the connection just ends.
        assert await closed_after(client) in (b"", b"<reset>")
        await eventually_async(lambda: not edge.dispatch.websockets.relays)
        assert sample(edge, "edge_requests_total", kind="websocket", outcome="delivered") == 1


@pytest.mark.anyio
async def test_a_client_lost_closes_the_replica_with_1001_or_aborts_it_mid_frame() -> None:
    raw = RawReplica()
    async with raw_fleet(raw) as (edge, ends):
        client, _ = await ends.connect(edge.url, PATH)
        replica = await raw.peers.get()
        client.send(frame(TEXT, b"bye", masked=True))
        assert (await replica.frame()).payload == b"bye"
        client.abort()
        got = await replica.frame()
        assert (got.opcode, got.payload) == (CLOSE, close_payload(1001))
        replica.send(frame(CLOSE, close_payload(1001)))
        assert await closed_after(replica) == b""

        client, _ = await ends.connect(edge.url, PATH)
        replica = await raw.peers.get()
        partial = frame(BINARY, b"y" * 1000, masked=True)[:300]
        client.send(partial)
        assert await replica.reader.readexactly(len(partial)) == partial
        client.abort()
        assert await closed_after(replica) in (b"", b"<reset>")


REPLICA_PROCESS = textwrap.dedent(
    """
    import asyncio, sys
    from aiohttp import web

    async def stream(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        n = 0
        while True:
            await ws.send_str(f"token {n}")
            n += 1
            await asyncio.sleep(0.001)

    async def main():
        app = web.Application()
        app.router.add_get("/{tail:.*}", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


@pytest.mark.anyio
async def test_a_replica_process_killed_mid_stream_closes_the_client_with_1011() -> None:
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before any awaiting
        [sys.executable, "-c", REPLICA_PROCESS], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(await asyncio.to_thread(proc.stdout.readline))
        async with (
            fleet(extra=[("r1", f"http://127.0.0.1:{port}")]) as edge,
            aiohttp.ClientSession() as session,
        ):
            ws = await session.ws_connect(edge.url + PATH, autoclose=False)
            for n in range(20):
                assert await ws.receive_str(timeout=5) == f"token {n}"
            proc.send_signal(signal.SIGKILL)
            while (msg := await ws.receive(timeout=5)).type is WSMsgType.TEXT:
                assert msg.data.startswith("token ")  # whole frames only
            assert (msg.type, msg.data, msg.extra) == (
                WSMsgType.CLOSE,
                1011,
                "the replica connection was lost",
            )
            await ws.close()
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.anyio
async def test_a_message_over_the_limit_closes_the_client_with_1009() -> None:
    raw = RawReplica()
    async with raw_fleet(raw, max_request_body_bytes=1000) as (edge, ends):
        client, _ = await ends.connect(edge.url, PATH)
        replica = await raw.peers.get()
        first = frame(TEXT, b"a" * 600, fin=False, masked=True)
        client.send(first)
        assert await replica.reader.readexactly(len(first)) == first
        client.send(frame(CONTINUATION, b"b" * 401, masked=True))  # 1,001 bytes in all
        got = await replica.frame()
        assert (got.opcode, got.payload) == (CLOSE, close_payload(1001))
        assert await client.frame() == (True, CLOSE, close_payload(1009, b"message too big"), False)
        # Exactly the limit passes.
        client, _ = await ends.connect(edge.url, PATH)
        replica = await raw.peers.get()
        whole = frame(BINARY, b"c" * 1000, masked=True)
        client.send(whole)
        assert await replica.reader.readexactly(len(whole)) == whole


@pytest.mark.anyio
async def test_draining_ends_the_frame_in_flight_then_closes_both_with_1001(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = RawReplica()
    async with raw_fleet(raw) as (edge, ends):
        client, _ = await ends.connect(edge.url, PATH)
        replica = await raw.peers.get()
        whole = frame(BINARY, b"w" * 5000)
        replica.send(whole[:2000])
        assert await client.reader.readexactly(2000) == whole[:2000]
        relay = the_relay(edge)
        with caplog.at_level(logging.INFO, "edge.access"):
            draining = asyncio.ensure_future(edge.drain(0.05))
            await eventually_async(lambda: relay.down.state is State.ENDING)
            got = await replica.frame()  # nothing was in flight towards the replica
            assert (got.opcode, got.payload) == (
                CLOSE,
                close_payload(1001, b"the edge is going away"),
            )
            assert not draining.done()
            replica.send(whole[2000:])
            assert await client.reader.readexactly(len(whole) - 2000) == whole[2000:]
            assert await client.frame() == (
                True,
                CLOSE,
                close_payload(1001, b"the edge is going away"),
                False,
            )
            client.send(frame(CLOSE, close_payload(1001), masked=True))
            replica.send(frame(CLOSE, close_payload(1001)))
            await asyncio.wait_for(draining, 10)
        assert not edge.dispatch.websockets.relays
        assert await closed_after(client) == b""
        assert sample(edge, "edge_open_streams", kind="websocket") == 0
    (line,) = [m for m in caplog.messages if "kind=websocket" in m]
    assert line.startswith("GET /_beyond/agent 101 kind=websocket lane=aiohttp outcome=delivered")


@pytest.mark.anyio
async def test_a_session_leaves_nothing_behind() -> None:
    r1 = FakeReplica("r1")
    r1.handler = echo_websocket(r1)
    async with fleet(r1) as edge, aiohttp.ClientSession() as session:
        for n in range(3):
            async with session.ws_connect(edge.url + PATH) as ws:
                await ws.send_str(f"hi {n}")
                assert await ws.receive_str(timeout=5) == f"echo:hi {n}"
        runner = edge._runner
        assert runner is not None and runner.server is not None
        server = runner.server
        # aiohttp's server forgets each connection the relay took, once it is over.
        await eventually_async(lambda: not server.connections and not edge.dispatch.in_flight)
        assert not edge.dispatch.websockets.relays
        assert sample(edge, "edge_requests_total", kind="websocket", outcome="delivered") == 3


@pytest.mark.anyio
async def test_a_malformed_client_handshake_is_400_before_any_replica_is_asked() -> None:
    r1 = FakeReplica("r1")
    headers = {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "c2hvcnQ=",  # 5 bytes, not 16
    }
    async with (
        fleet(r1) as edge,
        aiohttp.ClientSession() as session,
        session.get(edge.url + PATH, headers=headers) as response,
    ):
        status, body = response.status, await response.text()
    assert (status, body) == (400, "Handshake error: 'c2hvcnQ='")
    assert not r1.seen


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: bm9wZQ==\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: {accept}\r\nSec-WebSocket-Extensions: permessage-deflate\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: keep-alive\r\n\r\n",
    ],
    ids=["wrong-accept", "unoffered-extension", "no-upgrade"],
)
@pytest.mark.anyio
async def test_a_botched_replica_handshake_is_502(head: bytes) -> None:
    def answer(fields: dict[bytes, bytes]) -> bytes:
        return head.replace(b"{accept}", accept(fields[b"sec-websocket-key"]))

    raw = RawReplica(head=answer)
    async with raw_fleet(raw) as (edge, ends):
        _, status = await ends.connect(edge.url, PATH)
    assert status.startswith(b"HTTP/1.1 502 ")


@pytest.mark.anyio
async def test_a_close_the_other_side_never_answers_is_answered_when_the_time_is_up() -> None:
    raw = RawReplica()
    async with raw_fleet(raw) as (edge, ends):
        edge.dispatch.websockets.close_timeout_s = 0.3
        client, _ = await ends.connect(edge.url, PATH)
        replica = await raw.peers.get()
        client.send(frame(CLOSE, close_payload(4000, b"done"), masked=True))
        got = await replica.frame()
        assert (got.opcode, got.payload) == (CLOSE, close_payload(4000, b"done"))
        # The replica never answers; once the close time is up the client has its answer
        # anyway, and both connections end.
        assert await client.frame() == (True, CLOSE, close_payload(4000, b"done"), False)
        assert await closed_after(client) == b""
        assert await closed_after(replica) == b""
        await eventually_async(lambda: not edge.dispatch.websockets.relays)


@pytest.mark.anyio
async def test_a_frame_in_flight_that_never_ends_is_aborted_when_the_time_is_up() -> None:
    raw = RawReplica()
    async with raw_fleet(raw) as (edge, ends):
        edge.dispatch.websockets.close_timeout_s = 0.3
        client, _ = await ends.connect(edge.url, PATH)
        replica = await raw.peers.get()
        partial = frame(BINARY, b"s" * 1000)[:100]
        replica.send(partial)
        assert await client.reader.readexactly(len(partial)) == partial
        await asyncio.wait_for(edge.drain(0.01), 10)
        got = await replica.frame()
        assert (got.opcode, got.payload) == (CLOSE, close_payload(1001, b"the edge is going away"))
        # The rest of the frame never came: no close frame could follow it.
        assert await closed_after(client) in (b"", b"<reset>")
        assert not edge.dispatch.websockets.relays
