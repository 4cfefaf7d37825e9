"""The edge's own WebSocket handshake with a replica (edge.upstream.wsconnect), against servers
on 127.0.0.1 that answer with exactly the bytes a test gives them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from edge.core.errors import UpstreamBadResponse, UpstreamUnavailable
from edge.upstream.pool import Origin
from edge.upstream.wsconnect import Refusal, Upgraded, open_upgrade
from fleet_sim.ports import free_port
from tests.harness import eventually_async

REQUEST = b"GET / HTTP/1.1\r\nHost: r\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"


@asynccontextmanager
async def answering(
    *writes: bytes | asyncio.Event, then_close: bool = False
) -> AsyncIterator[Origin]:
    """A server that reads a request head, then writes each of ``writes`` (one write each;
    an event is waited for instead)."""
    done: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for data in writes:
            if isinstance(data, asyncio.Event):
                await data.wait()
                continue
            writer.write(data)
            await writer.drain()
        if then_close:
            writer.close()
        done.append(writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Origin.parse(f"http://127.0.0.1:{port}")
    finally:
        server.close()
        for writer in done:
            writer.close()


async def upgrade(origin: Origin) -> Upgraded | Refusal:
    return await asyncio.wait_for(open_upgrade(origin, REQUEST, tls=None, body_limit=10), 5)


SWITCH = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"


@pytest.mark.anyio
async def test_a_101_keeps_what_follows_it_for_the_relay() -> None:
    later = asyncio.Event()
    async with answering(SWITCH + b"\x81\x02hi", later, b"\x81\x03yes") as origin:
        answer = await upgrade(origin)
        assert isinstance(answer, Upgraded)
        assert answer.headers[0] == (b"Upgrade", b"websocket")
        assert answer.tail == b"\x81\x02hi"  # the head and a first frame came in one write
        # Reading stops at the 101: what the replica sends next waits for the relay.
        assert not answer.transport.is_reading()
        later.set()
        answer.transport.resume_reading()
        await eventually_async(lambda: answer.tail == b"\x81\x02hi\x81\x03yes")
        assert not answer.lost
        answer.abort()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 403 Forbidden\r\nContent-Length: 12\r\nX-Why: grant\r\n\r\ngrant failed",
        b"HTTP/1.1 403 Forbidden\r\nTransfer-Encoding: chunked\r\nX-Why: grant\r\n\r\n"
        b"5\r\ngrant\r\n7\r\n failed\r\n0\r\n\r\n",
    ],
    ids=["length", "chunked"],
)
@pytest.mark.anyio
async def test_any_other_status_is_a_refusal_with_its_body_cut_at_the_limit(answer: bytes) -> None:
    async with answering(answer[:40], answer[40:]) as origin:
        refusal = await upgrade(origin)
    assert isinstance(refusal, Refusal)
    assert refusal.status == 403 and (b"X-Why", b"grant") in refusal.headers
    assert refusal.body == b"grant fail"  # body_limit=10


@pytest.mark.anyio
async def test_a_body_that_ends_with_the_connection_is_read_to_its_end() -> None:
    async with answering(b"HTTP/1.1 503 Busy\r\n\r\nheld", then_close=True) as origin:
        refusal = await upgrade(origin)
    assert refusal == Refusal(503, [], b"held")


@pytest.mark.parametrize(
    ("writes", "error"),
    [
        ((b"",), UpstreamUnavailable),  # closed without a byte
        ((b"HTTP/1.1 101 Swi",), UpstreamBadResponse),  # closed mid-head
        ((b"SSH-2.0-OpenSSH\r\n\r\n",), UpstreamBadResponse),  # not HTTP
        (
            (b"HTTP/1.1 101 Switching Protocols\r\nConnection: keep-alive\r\n\r\n",),
            UpstreamBadResponse,
        ),
    ],
    ids=["nothing", "mid-head", "not-http", "101-without-upgrade"],
)
@pytest.mark.anyio
async def test_no_usable_answer_is_an_upstream_error(
    writes: tuple[bytes, ...], error: type[Exception]
) -> None:
    async with answering(*writes, then_close=True) as origin:
        with pytest.raises(error):
            await upgrade(origin)


@pytest.mark.anyio
async def test_a_closed_port_is_unavailable() -> None:
    with pytest.raises(UpstreamUnavailable):
        await upgrade(Origin.parse(f"http://127.0.0.1:{free_port()}"))
