"""The fast lane's express exchanges (edge.fast.express): a command asked of its owner over a pooled
connection and answered from callbacks, and every way such an exchange leaves the usual path."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from edge.server import Edge
from tests.edge.fakes import (
    FakeReplica,
    echo,
    fleet,
    hang,
    ok,
    refuse,
    requests,
    sample,
    script,
    session_with_walk,
)
from tests.edge.wire_client import connected, read_response
from tests.harness import eventually_async

pytestmark = pytest.mark.anyio


def command(sid: str, body: bytes = b"{}") -> bytes:
    return (
        b"POST /_beyond/agent?session_id=%b HTTP/1.1\r\nHost: edge\r\nContent-Length: %d\r\n\r\n%b"
        % (sid.encode(), len(body), body)
    )


SID = "a07-s1.express"
OK_ANSWER = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
)

# How a raw replica treats one request: given the writer, it answers (or not) by itself.
Behaviour = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def answer_ok(writer: asyncio.StreamWriter) -> None:
    writer.write(OK_ANSWER)


@dataclass
class RawReplica:
    """A replica speaking raw HTTP/1.1, so answers can be cut, split or withheld at will:
    ``behaviours[n]`` serves the n-th request it reads (the last repeats)."""

    behaviours: list[Behaviour]
    name: str = "r1"
    served: int = 0
    connections: int = 0
    closed_by_edge: int = 0  # connections the edge closed while a request was open
    server: asyncio.Server | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> RawReplica:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                behaviour = self.behaviours[min(self.served, len(self.behaviours) - 1)]
                self.served += 1
                await behaviour(writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@contextlib.asynccontextmanager
async def raw_fleet(
    *behaviours: Behaviour, **options: Any
) -> AsyncIterator[tuple[Edge, RawReplica]]:
    replica = await RawReplica(list(behaviours)).start()
    try:
        async with fleet(extra=[("r1", replica.url)], **options) as edge:
            yield edge, replica
    finally:
        await replica.close()


async def second_answer(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> tuple[int, dict[bytes, bytes], bytes]:
    """Send a command (it opens the pooled connection), then one more (the express one); the
    second's answer."""
    writer.write(command(SID))
    await read_response(reader)
    writer.write(command(SID))
    return await read_response(reader)


def hold_open(seen: asyncio.Event) -> Behaviour:
    """Never answer; note when the edge drops the connection."""

    async def behaviour(writer: asyncio.StreamWriter) -> None:
        seen.set()
        await asyncio.sleep(3600)

    return behaviour


# --- the usual case ---------------------------------------------------------------------------


async def test_after_the_first_command_the_owner_is_asked_without_a_task() -> None:
    async with fleet(FakeReplica("r1", ok(b"hello"))) as edge, connected(edge.url) as (r, w):
        for _ in range(3):
            w.write(command(SID))
            status, _, body = await read_response(r)
            assert (status, body) == (200, b"hello")
        assert edge.expressed == 2  # the first one had to open the pooled connection
        assert requests(edge, "command", "delivered") == 3
        assert sample(edge, "edge_placement_seconds_count", kind="command") == 3
        assert edge.in_flight == 0


async def test_a_repeated_head_is_read_once_and_each_body_goes_on_as_sent() -> None:
    bodies = [b'{"n":1}', b'{"n":2}', b'{"n":10}', b'{"n":3}']
    async with fleet(FakeReplica("r1", echo())) as edge, connected(edge.url) as (r, w):
        for body in bodies:
            w.write(command(SID, body))
            status, _, answer = await read_response(r)
            assert (status, answer) == (200, body)
        # Two heads: Content-Length 7 (three times) and 8.
        assert edge.fast_lane_heads == (2, 2)
        assert requests(edge, "command", "delivered") == 4


async def test_an_answer_in_two_writes_is_still_delivered_whole() -> None:
    async def split(writer: asyncio.StreamWriter) -> None:
        writer.write(OK_ANSWER[:-11])
        await writer.drain()
        await asyncio.sleep(0.05)  # the replica's two writes reach the edge apart
        writer.write(OK_ANSWER[-11:])

    async with raw_fleet(answer_ok, split) as (edge, _), connected(edge.url) as (r, w):
        for _ in range(2):
            w.write(command(SID))
            assert (await read_response(r))[::2] == (200, b'{"ok":true}')
        assert edge.expressed == 1


# --- leaving the usual path -------------------------------------------------------------------


async def test_a_503_from_the_owner_goes_on_to_retries_in_place() -> None:
    replica = FakeReplica("r1", script(ok(), refuse(503), ok(b"second")))
    async with fleet(replica) as edge, connected(edge.url) as (r, w):
        w.write(command(SID))
        assert (await read_response(r))[0] == 200
        w.write(command(SID))
        assert (await read_response(r))[::2] == (200, b"second")
        assert edge.expressed >= 1
        assert sample(edge, "edge_retries_total", kind="command") == 1
        assert requests(edge, "command", "delivered") == 2


async def test_a_421_from_the_owner_walks_on() -> None:
    sid = session_with_walk(["r1", "r2"], ["r1", "r2"])
    r1 = FakeReplica("r1", script(ok(b"r1"), refuse(421)))
    r2 = FakeReplica("r2", ok(b"r2"))
    async with fleet(r1, r2) as edge, connected(edge.url) as (r, w):
        w.write(command(sid))
        assert (await read_response(r))[2] == b"r1"
        w.write(command(sid))
        assert (await read_response(r))[::2] == (200, b"r2")
        assert sample(edge, "edge_misdirected_total", kind="command") == 1


async def test_a_pooled_connection_closed_unanswered_is_replaced_by_a_new_one() -> None:
    async def hang_up(writer: asyncio.StreamWriter) -> None:
        writer.close()  # the request was read, nothing was answered

    async with raw_fleet(answer_ok, hang_up, answer_ok) as (edge, replica):
        async with connected(edge.url) as (r, w):
            for _ in range(2):
                w.write(command(SID))
                assert (await read_response(r))[::2] == (200, b'{"ok":true}')
        assert replica.connections == 2 and replica.served == 3
        assert requests(edge, "command", "delivered") == 2


async def test_headers_that_never_come_are_a_504() -> None:
    seen = asyncio.Event()
    async with raw_fleet(answer_ok, hold_open(seen), upstream_header_timeout_s=0.3) as (edge, _):
        async with connected(edge.url) as (r, w):
            status, _, body = await second_answer(r, w)
        assert status == 504 and b"did not answer in time" in body
        assert requests(edge, "command", "timed_out") == 1


async def test_a_body_that_stalls_is_a_504_and_the_replica_connection_is_dropped() -> None:
    async def stall(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
        await asyncio.sleep(3600)

    behaviours = (answer_ok, stall, answer_ok)
    async with raw_fleet(*behaviours, upstream_header_timeout_s=0.3) as (edge, replica):
        async with connected(edge.url) as (r, w):
            status, _, body = await second_answer(r, w)
            assert status == 504 and b"stalled" in body
            w.write(command(SID))  # the client's connection carries on
            assert (await read_response(r))[0] == 200
        assert requests(edge, "command", "timed_out") == 1
        assert replica.connections == 2  # the stalled connection was dropped, not reused


async def test_bytes_that_are_not_http_are_a_502() -> None:
    async def garbage(writer: asyncio.StreamWriter) -> None:
        writer.write(b"SPDY/9 nonsense\r\n\r\n")

    async with raw_fleet(answer_ok, garbage) as (edge, _), connected(edge.url) as (r, w):
        status, _, body = await second_answer(r, w)
        assert status == 502 and b"unusable" in body
        assert requests(edge, "command", "upstream_error") == 1


async def test_a_long_chunked_answer_is_handed_to_the_streaming_relay() -> None:
    async def chunked(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the second chunk comes later, as from a streaming replica
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")

    async with raw_fleet(answer_ok, chunked) as (edge, _), connected(edge.url) as (r, w):
        status, fields, body = await second_answer(r, w)
        assert (status, body) == (200, b"firstsecond")
        assert fields[b"transfer-encoding"] == b"chunked"
        assert edge.expressed == 1 and requests(edge, "command", "delivered") == 2


# --- the client, and draining ------------------------------------------------------------------


async def test_a_client_that_leaves_cancels_the_exchange_and_the_replica_sees_it() -> None:
    seen = asyncio.Event()
    async with raw_fleet(answer_ok, hold_open(seen)) as (edge, replica):
        async with connected(edge.url) as (r, w):
            w.write(command(SID))
            await read_response(r)
            w.write(command(SID))
            await asyncio.wait_for(seen.wait(), 5)
            assert edge.in_flight == 1
        await eventually_async(
            lambda: edge.in_flight == 0 and requests(edge, "command", "client_gone") == 1,
            timeout=2.0,
        )
        assert edge.in_flight == 0 and requests(edge, "command", "client_gone") == 1
        assert edge.pool.idle_count(replica.url) == 0  # aborted, not pooled


async def test_a_drain_lets_an_exchange_finish_and_cancels_one_past_its_grace() -> None:
    async def slow(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.3)
        writer.write(OK_ANSWER)

    async with raw_fleet(answer_ok, slow) as (edge, replica), connected(edge.url) as (r, w):
        w.write(command(SID))
        await read_response(r)
        w.write(command(SID))
        # The replica has the second command: the edge sent it as an express exchange, which a
        # drain must wait for (a fixed 50 ms let a loaded runner's drain find the edge idle).
        await eventually_async(lambda: replica.served == 2, timeout=5.0)
        assert edge.expressed == 1 and edge.in_flight == 1
        drained = asyncio.create_task(edge.drain(2.0))
        assert (await read_response(r))[0] == 200
        await drained
        assert await r.read() == b""  # closed once answered

    seen = asyncio.Event()
    async with raw_fleet(answer_ok, hold_open(seen)) as (edge, _):
        async with connected(edge.url) as (r, w):
            w.write(command(SID))
            await read_response(r)
            w.write(command(SID))
            await asyncio.wait_for(seen.wait(), 5)
            await edge.drain(0.2)
            assert await r.read() == b""  # no answer: cut off
        assert edge.in_flight == 0 and requests(edge, "command", "client_gone") == 1


async def test_a_plain_answer_is_passed_on_as_it_came_and_hop_by_hop_fields_are_not() -> None:
    answer = b"HTTP/1.1 200 Fine Thanks\r\nX-Order: 1\r\ncontent-length: 2\r\nX-Z: z\r\n\r\nok"
    with_hop = answer.replace(b"X-Z: z", b"Keep-Alive: timeout=5")

    async def plain(writer: asyncio.StreamWriter) -> None:
        writer.write(answer)

    async def hop(writer: asyncio.StreamWriter) -> None:
        writer.write(with_hop)

    async with raw_fleet(answer_ok, plain, hop, plain) as (edge, _):
        async with connected(edge.url) as (r, w):
            w.write(command(SID))
            await read_response(r)
            w.write(command(SID))
            assert await r.readexactly(len(answer)) == answer  # byte for byte
            w.write(command(SID))
            status, fields, body = await read_response(r)
            assert (status, body) == (200, b"ok") and b"keep-alive" not in fields
            # Connection: close from the client: the edge says so itself, then closes.
            w.write(command(SID)[:-4] + b"Connection: close\r\n\r\n" + b"{}")
            status, fields, body = await read_response(r)
            assert (status, body, fields[b"connection"]) == (200, b"ok", b"close")
            assert await r.read() == b""
        assert edge.expressed == 3


async def one_express_exchange_held(
    edge: Edge, replica: FakeReplica, r: asyncio.StreamReader, w: asyncio.StreamWriter
) -> None:
    """A command answered (so the pool has an idle connection), then an express exchange on it
    that the replica never answers: one request in flight, and it is an express exchange."""
    w.write(command(SID))
    await read_response(r)
    w.write(command(SID))
    await eventually_async(lambda: len(replica.seen) == 2, timeout=2.0)
    assert edge.expressed == 1 and edge.in_flight == 1


async def test_the_concurrency_limit_counts_express_exchanges() -> None:
    replica = FakeReplica("r1", script(ok(), hang()))
    async with fleet(replica, max_concurrent_requests=1) as edge:
        async with connected(edge.url) as (r, w), connected(edge.url) as (r2, w2):
            await one_express_exchange_held(edge, replica, r, w)
            w2.write(command(SID))
            status, _, body = await asyncio.wait_for(read_response(r2), 5)
        assert status == 503 and b"concurrent request limit" in body
        assert requests(edge, "command", "shed") == 1


async def test_the_aiohttp_lane_counts_express_exchanges_too() -> None:
    replica = FakeReplica("r1", script(ok(), hang()))
    async with fleet(replica, max_concurrent_requests=1) as edge:
        async with connected(edge.url) as (r, w), connected(edge.url) as (r2, w2):
            await one_express_exchange_held(edge, replica, r, w)
            # A chunked body is not the fast lane's: aiohttp's lane admits this one.
            w2.write(
                b"POST /_beyond/agent?session_id=" + SID.encode() + b" HTTP/1.1\r\n"
                b"Host: edge\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
            )
            status, _, body = await asyncio.wait_for(read_response(r2), 5)
        assert status == 503 and b"concurrent request limit" in body
        assert requests(edge, "command", "shed") == 1
