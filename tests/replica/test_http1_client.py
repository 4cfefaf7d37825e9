"""The lean streaming client (``replica.http1_client``) against servers on 127.0.0.1: keep-alive
and what may be reused, the idle bound, closing, timeouts, TLS, and reading once per window."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from replica.http1_client import (
    ConnectError,
    ConnectionPool,
    ConnectTimeout,
    Origin,
    ReadTimeout,
    RemoteProtocolError,
    Response,
    WriteTimeout,
)
from replica.http1_wire import encode_request
from tests.replica.raw_http import (
    LAST_CHUNK,
    RawRequest,
    RawServer,
    answer,
    certificates,
    chunk,
    client_gone,
    raw_server,
    stream_head,
)

TARGET = b"/v1/chat/completions"


def request(body: bytes = b"{}", host: str = "127.0.0.1") -> bytes:
    return encode_request("POST", TARGET, [("host", host)], body)


def origin_of(server: RawServer) -> Origin:
    return Origin(server.scheme, "127.0.0.1", server.port)


async def read_all(response: Response) -> bytes:
    out = b""
    while data := await response.read():
        out += data
    return out


@contextlib.asynccontextmanager
async def pool(timeout_s: float = 10.0, **options: Any) -> AsyncIterator[ConnectionPool]:
    client = ConnectionPool(timeout_s, **options)
    try:
        yield client
    finally:
        await client.aclose()


async def ok(request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
    """Answers each request with its number on its connection, alternating the framing."""
    body = f"answer {request.connection}.{request.index}".encode()
    w.write(answer(200, {"content-type": "text/plain"}, body, chunked=request.index % 2 == 1))
    return True


@pytest.mark.anyio
async def test_keep_alive_connections_are_reused_after_a_whole_answer() -> None:
    async with raw_server(ok) as server, pool() as client:
        bodies = []
        for _ in range(4):
            response = await client.request(origin_of(server), request())
            assert response.status == 200
            bodies.append(await read_all(response))
            response.release()
        assert client.idle_count() == 1
    assert bodies == [b"answer 0.0", b"answer 0.1", b"answer 0.2", b"answer 0.3"]
    assert client.connects == 1


@pytest.mark.anyio
async def test_an_answer_not_read_to_its_end_closes_its_connection() -> None:
    gone = asyncio.Event()

    async def slow(
        request: RawRequest, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        if request.connection == 0:
            w.write(stream_head() + chunk(b"first"))
            await client_gone(reader)
            gone.set()
            return False
        return await ok(request, reader, w)

    async with raw_server(slow) as server, pool() as client:
        response = await client.request(origin_of(server), request())
        assert await response.read() == b"first"
        response.release()
        await asyncio.wait_for(gone.wait(), 10)
        again = await client.request(origin_of(server), request())
        assert await read_all(again) == b"answer 1.0"
        again.release()
    assert client.connects == 2


@pytest.mark.anyio
@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\n\r\nok",  # delimited by the close
    ],
    ids=["connection-close", "http-1.0", "until-close"],
)
async def test_an_answer_that_forbids_reuse_is_not_pooled(head: bytes) -> None:
    async def once(_: RawRequest, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(head)
        return False  # and the server closes

    async with raw_server(once) as server, pool() as client:
        for _ in range(2):
            response = await client.request(origin_of(server), request())
            assert await read_all(response) == b"ok"
            response.release()
        assert client.idle_count() == 0
    assert client.connects == 2


@pytest.mark.anyio
async def test_idle_connections_are_bounded_and_expire() -> None:
    async with raw_server(ok) as server, pool(max_idle=1) as client:
        first = await client.request(origin_of(server), request())
        second = await client.request(origin_of(server), request())
        for response in (first, second):
            await read_all(response)
            response.release()
        assert client.idle_count() == 1
        # The older idle connection made room: the server sees it closed.
        await asyncio.wait_for(server.closed(0).wait(), 10)
        assert not server.closed(1).is_set()
    async with raw_server(ok) as server, pool(idle_ttl_s=0.0) as client:
        for _ in range(2):
            response = await client.request(origin_of(server), request())
            await read_all(response)
            response.release()
    assert client.connects == 2


@pytest.mark.anyio
async def test_a_pooled_connection_the_server_closed_is_replaced_once() -> None:
    async def first_only(
        request: RawRequest, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        if request.index > 0:
            return False  # a kept-alive connection closed as the next request came
        return await ok(request, reader, w)

    async with raw_server(first_only) as server, pool() as client:
        for expected in (b"answer 0.0", b"answer 1.0"):
            response = await client.request(origin_of(server), request())
            assert await read_all(response) == expected
            response.release()
    assert [(r.connection, r.index) for r in server.requests] == [(0, 0), (0, 1), (1, 0)]


@pytest.mark.anyio
async def test_a_new_connection_closed_before_an_answer_is_an_error() -> None:
    async def hang_up(_: RawRequest, __: asyncio.StreamReader, ___: asyncio.StreamWriter) -> bool:
        return False

    async with raw_server(hang_up) as server, pool() as client:
        with pytest.raises(RemoteProtocolError):
            await client.request(origin_of(server), request())
    assert server.connections == 1


@pytest.mark.anyio
async def test_a_body_broken_off_mid_chunk_is_an_error() -> None:
    async def broken(_: RawRequest, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(stream_head() + b"10\r\nonly part")
        return False

    async with raw_server(broken) as server, pool() as client:
        response = await client.request(origin_of(server), request())
        with pytest.raises(RemoteProtocolError):
            await read_all(response)
        response.release()
        assert client.idle_count() == 0


@pytest.mark.anyio
async def test_aclose_closes_idle_connections_and_refuses_more() -> None:
    async with raw_server(ok) as server:
        client = ConnectionPool(10.0)
        response = await client.request(origin_of(server), request())
        await read_all(response)
        response.release()
        await client.aclose()
        await asyncio.wait_for(server.closed(0).wait(), 10)
        with pytest.raises(ConnectError):
            await client.request(origin_of(server), request())


@pytest.mark.anyio
async def test_waits_for_the_head_and_for_more_body_are_bounded() -> None:
    release = asyncio.Event()

    async def stall(request: RawRequest, _: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        if request.connection == 1:
            w.write(stream_head() + chunk(b"some"))
        await release.wait()
        return False

    async with raw_server(stall) as server, pool(0.2) as client:
        try:
            started = time.monotonic()
            with pytest.raises(ReadTimeout):
                await client.request(origin_of(server), request())
            assert time.monotonic() - started >= 0.2
            response = await client.request(origin_of(server), request())
            assert await response.read() == b"some"
            started = time.monotonic()
            with pytest.raises(ReadTimeout):
                await response.read()
            assert time.monotonic() - started >= 0.2
            response.release()
        finally:
            release.set()


@pytest.mark.anyio
async def test_sending_to_a_server_that_does_not_read_times_out() -> None:
    accepted = asyncio.Event()
    release = asyncio.Event()

    async def deaf(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await release.wait()
        writer.close()

    server = await asyncio.start_server(deaf, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with pool(0.3) as client:
            # Far more than the socket buffers of both ends hold.
            with pytest.raises(WriteTimeout):
                await client.request(Origin("http", "127.0.0.1", port), request(b"x" * 64_000_000))
        assert accepted.is_set()
    finally:
        release.set()
        server.close()
        await server.wait_closed()


@pytest.mark.anyio
async def test_a_tls_handshake_that_never_completes_is_a_connect_timeout() -> None:
    release = asyncio.Event()

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with pool(0.3) as client:
            with pytest.raises(ConnectTimeout):
                await client.request(Origin("https", "127.0.0.1", port), request())
    finally:
        release.set()
        server.close()
        await server.wait_closed()


@pytest.mark.anyio
async def test_https_verifies_the_certificate_and_the_host_name(tmp_path: Path) -> None:
    for_us = certificates(tmp_path)
    (tmp_path / "other").mkdir()
    for_another_name = certificates(tmp_path / "other", ("model.example.test",))

    def trusting(ca: Path) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(ca))

    async with raw_server(ok, tls=for_us.server) as server:
        async with pool(ssl_context=lambda: trusting(for_us.ca)) as client:
            response = await client.request(origin_of(server), request())
            assert await read_all(response) == b"answer 0.0"
            response.release()
        # The default trust store does not know the test authority.
        async with pool() as client:
            with pytest.raises(ConnectError):
                await client.request(origin_of(server), request())
    async with (
        raw_server(ok, tls=for_another_name.server) as server,
        pool(ssl_context=lambda: trusting(for_another_name.ca)) as client,
    ):
        with pytest.raises(ConnectError):
            await client.request(origin_of(server), request())


@pytest.mark.anyio
async def test_a_paced_body_is_read_at_most_once_per_window() -> None:
    window = 0.4
    pieces = [b"a", b"bc", b"de"]
    taken = [asyncio.Event() for _ in pieces]
    written = [asyncio.Event() for _ in pieces]

    async def tokens(_: RawRequest, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(stream_head())
        for i, group in enumerate(pieces):
            # Each byte its own write, sent on its own: read as they came, each would be a
            # read of its own.
            for byte in group:
                w.write(chunk(bytes([byte])))
                await w.drain()
            written[i].set()
            await taken[i].wait()
        w.write(LAST_CHUNK)
        return True

    async with raw_server(tokens) as server, pool() as client:
        response = await client.request(origin_of(server), request())
        await written[0].wait()
        response.pace(window)
        reads: list[tuple[bytes, float]] = []
        for i in range(len(pieces)):
            reads.append((await response.read(), time.monotonic()))
            assert written[i].is_set()
            taken[i].set()
        assert [data for data, _ in reads] == pieces
        gaps = [later - earlier for (_, earlier), (_, later) in itertools.pairwise(reads)]
        assert min(gaps) >= window * 0.9
        # A paced response still reads to its end and is pooled.
        assert await read_all(response) == b""
        response.release()
        assert client.idle_count() == 1
