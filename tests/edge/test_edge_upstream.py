from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.core.errors import UpstreamBadResponse, UpstreamTimeout, UpstreamUnavailable
from edge.upstream.pool import Origin, UpstreamPool, plain_response
from fleet_sim.ports import free_port
from fuzz.fuzz_plainresponse import check as check_against_llhttp
from tests.harness import eventually_async

Conn = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
GET = b"GET /x HTTP/1.1\r\nHost: r\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"


class Raw:
    """A raw TCP server: each connection runs ``serve``; counts connections and EOFs."""

    def __init__(self, serve: Conn) -> None:
        self.serve = serve
        self.connections = 0
        self.eofs = 0
        self.port = 0

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def raw(serve: Conn) -> AsyncIterator[Raw]:
    server = Raw(serve)
    listener = await asyncio.start_server(server._conn, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listener.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    for _ in range(10):
        await read_request(reader)
        writer.write(OK)
        await writer.drain()


async def request(pool: UpstreamPool, url: str, **kw: float | None) -> tuple[int, bytes]:
    response = await pool.request(
        url,
        GET,
        connect_timeout=float(kw.get("connect_timeout") or 1.0),
        header_timeout=kw.get("header_timeout", 2.0),
    )
    try:
        return response.status, await response.read_all(1 << 20)
    finally:
        response.release()


@pytest.mark.anyio
async def test_connections_are_reused() -> None:
    pool = UpstreamPool()
    async with raw(answer_each) as server:
        for _ in range(3):
            assert await request(pool, server.url) == (200, b"hi")
        assert server.connections == 1 and pool.connects == 1
        assert pool.idle_count(server.url) == 1
    await pool.close()


@pytest.mark.anyio
async def test_a_remembered_head_still_delivers_each_body_as_sent() -> None:
    # The same head with other bodies of its length, then a head that differs only in its
    # length: each answer is the one the replica sent; heads seen before are not read again.
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nho",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nhey",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nha",
    ]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()

    pool = UpstreamPool()
    async with raw(serve) as server:
        assert [await request(pool, server.url) for _ in answers] == [
            (200, b"hi"),
            (200, b"ho"),
            (200, b"hey"),
            (200, b"ha"),
        ]
        assert server.connections == 1
    assert (pool.plain_heads.misses, pool.plain_heads.hits) == (2, 2)
    await pool.close()


@pytest.mark.anyio
async def test_retain_closes_idle_connections_to_dropped_replicas() -> None:
    pool = UpstreamPool()
    async with raw(answer_each) as one, raw(answer_each) as two:
        await request(pool, one.url)
        await request(pool, two.url)
        pool.retain({two.url})
        assert (pool.idle_count(one.url), pool.idle_count(two.url)) == (0, 1)
    await pool.close()


@pytest.mark.anyio
async def test_a_body_is_handed_over_as_it_arrives() -> None:
    second = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await second.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        await read_request(reader)

    pool = UpstreamPool()
    async with raw(serve) as server:
        response = await pool.request(server.url, GET, connect_timeout=1, header_timeout=1)
        assert response.status == 200 and not response.complete
        assert await response.read() == b"first"
        second.set()
        assert await response.read() == b"second"
        assert await response.read() == b""
        assert response.keep_alive
        response.release()
        assert pool.idle_count(server.url) == 1
    await pool.close()


@pytest.mark.anyio
async def test_refused_connection_is_unavailable() -> None:
    pool = UpstreamPool()
    with pytest.raises(UpstreamUnavailable):
        await request(pool, f"http://127.0.0.1:{free_port()}")
    await pool.close()


@pytest.mark.anyio
async def test_close_before_any_byte_is_unavailable_after_some_is_bad() -> None:
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def half_a_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-")
        await writer.drain()

    pool = UpstreamPool()
    async with raw(close_at_once) as server:
        with pytest.raises(UpstreamUnavailable):
            await request(pool, server.url)
    async with raw(half_a_head) as server:
        with pytest.raises(UpstreamBadResponse):
            await request(pool, server.url)
    await pool.close()


@pytest.mark.anyio
async def test_garbage_and_cut_bodies_are_bad_responses() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()

    pool = UpstreamPool()
    async with raw(garbage) as server:
        with pytest.raises(UpstreamBadResponse):
            await request(pool, server.url)
    async with raw(cut) as server:
        with pytest.raises(UpstreamBadResponse):
            await request(pool, server.url)
        assert pool.idle_count(server.url) == 0
    await pool.close()


@pytest.mark.anyio
async def test_header_timeout_aborts_the_connection() -> None:
    saw_eof = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # returns at EOF: the edge gave up
        saw_eof.set()

    pool = UpstreamPool()
    async with raw(silent) as server:
        with pytest.raises(UpstreamTimeout):
            await request(pool, server.url, header_timeout=0.1)
        await asyncio.wait_for(saw_eof.wait(), 2)
    await pool.close()


@pytest.mark.anyio
async def test_cancelling_a_request_aborts_the_connection() -> None:
    saw_eof = asyncio.Event()
    arrived = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        arrived.set()
        await reader.read()
        saw_eof.set()

    pool = UpstreamPool()
    async with raw(silent) as server:
        task = asyncio.create_task(request(pool, server.url, header_timeout=None))
        await asyncio.wait_for(arrived.wait(), 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(saw_eof.wait(), 2)
    await pool.close()


@pytest.mark.anyio
async def test_an_idle_connection_closed_by_the_replica_is_replaced() -> None:
    async def one_per_connection(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        # Keep-alive was offered, but the replica closes the idle connection.

    pool = UpstreamPool()
    async with raw(one_per_connection) as server:
        assert await request(pool, server.url) == (200, b"hi")
        await eventually_async(
            lambda: pool.idle_count(server.url) == 0,
            timeout=2.0,
            message="the pool never saw the replica close its idle connection",
        )
        assert await request(pool, server.url) == (200, b"hi")
        assert server.connections == 2
    await pool.close()


@pytest.mark.anyio
async def test_stale_idle_connections_are_not_reused() -> None:
    pool = UpstreamPool(idle_ttl_s=0.05)
    async with raw(answer_each) as server:
        await request(pool, server.url)
        # Not a wait for anything: the idle connection's age passing idle_ttl_s is what is
        # under test (the pool reads the loop's clock, so there is no clock to turn instead).
        await asyncio.sleep(0.1)
        await request(pool, server.url)
        assert server.connections == 2
    await pool.close()


@pytest.mark.anyio
async def test_informational_responses_are_skipped_and_eof_ends_an_unframed_body() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\n\r\nto the end")
        await writer.drain()

    pool = UpstreamPool()
    async with raw(serve) as server:
        assert await request(pool, server.url) == (201, b"to the end")
        assert pool.idle_count(server.url) == 0
    await pool.close()


@pytest.mark.anyio
async def test_connection_close_is_not_pooled() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi")
        await writer.drain()
        await reader.read()

    pool = UpstreamPool()
    async with raw(serve) as server:
        assert await request(pool, server.url) == (200, b"hi")
        assert pool.idle_count(server.url) == 0
    await pool.close()


def test_origin_parsing() -> None:
    origin = Origin.parse("http://127.0.0.1:9101")
    assert (origin.host, origin.port, origin.tls, origin.host_header) == (
        "127.0.0.1",
        9101,
        False,
        b"127.0.0.1:9101",
    )
    assert Origin.parse("https://[::1]:8443").host_header == b"[::1]:8443"
    with pytest.raises(ValueError, match="origin"):
        Origin.parse("ftp://x:1")


# --- plain responses read without llhttp's callbacks -------------------------------------------


_NAMES = st.sampled_from(
    [b"content-type", b"Date", b"server", b"X-Id", b"content-length", b"Connection",
     b"transfer-encoding", b"Upgrade", b"Keep-Alive"]
)  # fmt: skip
_VALUES = st.one_of(
    st.sampled_from([b"text/plain", b"a b", b"", b"close", b"chunked", b"5", b"v "]),
    st.sampled_from([b"application/json", b"Sun, 29 Nov 2026 17:00:00 GMT", b"uvicorn"]),
    st.binary(max_size=12).filter(lambda v: b"\r" not in v and b"\n" not in v),
)


@settings(max_examples=400)
@given(
    status=st.one_of(st.integers(200, 599), st.integers(100, 199)),
    fields=st.lists(
        st.tuples(_NAMES, st.sampled_from([b": ", b":", b":  ", b":\t"]), _VALUES), max_size=4
    ),
    body=st.binary(max_size=40),
    length=st.one_of(st.just(-1), st.none(), st.integers(0, 50)),  # -1: the body's own
    tail=st.one_of(st.just(b""), st.sampled_from([b"x", b"HTTP/1.1 200 OK\r\n"])),
)
def test_a_plain_response_is_read_as_llhttp_reads_it(
    status: int,
    fields: list[tuple[bytes, bytes, bytes]],
    body: bytes,
    length: int | None,
    tail: bytes,
) -> None:
    lines = [b"HTTP/1.1 %d Reason Here" % status]
    lines += [name + sep + value for name, sep, value in fields]
    if length is not None:
        lines.append(b"Content-Length: %d" % (len(body) if length < 0 else length))
    data = b"\r\n".join(lines) + b"\r\n\r\n" + body + tail
    check_against_llhttp(data)  # whatever plain_response accepts, llhttp reads the same


def test_plain_responses_and_what_is_left_to_llhttp() -> None:
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello"
    fields = ((b"content-type", b"text/plain"), (b"content-length", b"5"))
    assert plain_response(ok) == (200, fields, b"hello", True)
    kept = ok.replace(b"content-type", b"keep-alive: timeout=5\r\ncontent-type")
    assert plain_response(kept) == (200, ((b"keep-alive", b"timeout=5"), *fields), b"hello", False)
    for other in (
        ok[:-1],  # the body is not all here yet
        ok + b"HTTP/1.1",  # more than one message
        ok.replace(b"200 OK", b"204 No Content"),
        ok.replace(b"HTTP/1.1", b"HTTP/1.0"),
        ok.replace(b"content-type", b"connection: close\r\ncontent-type"),
        ok.replace(b"content-length: 5", b"transfer-encoding: chunked"),
        ok.replace(b"content-type: text/plain", b"content-length: 5"),  # two lengths
        ok.replace(b"text/plain", b"text/plain "),  # a trailing space
        ok.replace(b"200 OK", b"101 Switching"),
    ):
        assert plain_response(other) is None, other
