"""The fast lane: which requests it serves itself, and that a connection handed to aiohttp
mid-life, pipelined commands, streamed answers and drains all come out right on the wire."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from edge.core.headers import request_head
from edge.fast.fastpath import parse_head, response_head
from tests.edge.fakes import FakeReplica, fleet, ok, requests
from tests.edge.wire_client import connected, read_response
from tests.harness import eventually_async

SID = "a07-s1.fast"
TARGET = f"/_beyond/agent?session_id={SID}".encode()


def head(*lines: bytes, line: bytes = b"POST " + TARGET + b" HTTP/1.1") -> bytes:
    return b"\r\n".join((line, *lines))


# --- which heads the fast lane takes ------------------------------------------------------------


def test_a_plain_command_head_is_taken_with_its_fields_as_sent() -> None:
    parsed = parse_head(
        head(b"Host: edge", b"Content-Length: 2", b"x-beyond-grant:  g r a n t", b"Accept: */*")
    )
    assert parsed is not None
    assert parsed.target == TARGET.decode()
    assert parsed.length == 2 and not parsed.close
    assert parsed.headers == (
        (b"Host", b"edge"),
        (b"Content-Length", b"2"),
        (b"x-beyond-grant", b"g r a n t"),
        (b"Accept", b"*/*"),
    )


def test_what_is_sent_on_is_what_the_full_path_sends() -> None:
    lines = (
        b"Content-Length: 2",
        b"Connection: keep-alive",
        b"Keep-Alive: timeout=5",
        b"TE: trailers",
        b"x-beyond-grant: g",
        b"Accept:*/*",
    )
    parsed = parse_head(head(*lines))
    assert parsed is not None and not parsed.has_host
    sent = parsed.upstream(b"{}", b"10.0.0.11:9101")
    expected = request_head(
        "POST", parsed.target, parsed.headers, host=b"10.0.0.11:9101", body_length=2
    )
    assert sent == expected + b"{}"
    assert sent == (
        b"POST " + TARGET + b" HTTP/1.1\r\nx-beyond-grant: g\r\nAccept: */*\r\n"
        b"Host: 10.0.0.11:9101\r\nContent-Length: 2\r\n\r\n{}"
    )
    with_host = parse_head(head(b"Host: edge", b"Content-Length: 0"))
    assert with_host is not None and with_host.has_host
    assert with_host.upstream(b"", None) == request_head(
        "POST", with_host.target, with_host.headers, host=b"unused", body_length=0
    )


def test_connection_close_is_noticed() -> None:
    parsed = parse_head(head(b"Content-Length: 0", b"Connection: keep-alive, Close"))
    assert parsed is not None and parsed.close


@pytest.mark.parametrize(
    "lines",
    [
        (b"Host: edge",),  # no Content-Length
        (b"Content-Length: 2", b"Content-Length: 2"),
        (b"Content-Length: +2",),
        (b"Content-Length: 2", b"Transfer-Encoding: chunked"),
        (b"Content-Length: 2", b"Expect: 100-continue"),
        (b"Content-Length: 2", b"Upgrade: websocket"),
        (b"Content-Length: 2", b"Connection: Upgrade"),
        (b"Content-Length: 2", b"Connection: close, X-Hop"),  # names a field hop-by-hop
        (b"Content-Length: 2", b"X-Trailing: space "),
        (b"Content-Length: 2", b"X-Tab: a\tb"),
        (b"Content-Length: 2", b"X-Folded: a", b" b"),  # obs-fold
        (b"Content-Length: 2", b"X-Utf8: \xc3\xa9"),
        (b"Content-Length: 2", b"Bad Name: x"),
        (b"Content-Length: 2", b"NoColon"),
        (b"Content-Length: 2", b"X: a\nb"),
    ],
)
def test_anything_not_canonical_goes_to_the_full_path(lines: tuple[bytes, ...]) -> None:
    assert parse_head(head(*lines)) is None


@pytest.mark.parametrize(
    "line",
    [
        b"GET " + TARGET + b" HTTP/1.1",
        b"post " + TARGET + b" HTTP/1.1",
        b"POST " + TARGET + b" HTTP/1.0",
        b"POST http://edge" + TARGET + b" HTTP/1.1",
        b"POST /_beyond/agent?session_id=\xc3\xa9 HTTP/1.1",
        b"POST  " + TARGET + b" HTTP/1.1",
    ],
)
def test_only_http11_posts_to_a_printable_path_are_taken(line: bytes) -> None:
    assert parse_head(head(b"Content-Length: 0", line=line)) is None


@given(st.binary(max_size=300))
def test_any_bytes_are_either_declined_or_parsed_consistently(data: bytes) -> None:
    parsed = parse_head(data)
    if parsed is not None:
        assert data.startswith(b"POST /")
        assert parsed.target.isascii() and parsed.target.isprintable()
        assert all(b"\r" not in n + v and b"\n" not in n + v for n, v in parsed.headers)


def test_the_answer_head_drops_hop_by_hop_fields_and_writes_its_own_framing() -> None:
    fields = [
        (b"Content-Type", b"application/json"),
        (b"Connection", b"keep-alive, X-Hop"),
        (b"X-Hop", b"1"),
        (b"Content-Length", b"999"),
        (b"Transfer-Encoding", b"chunked"),
        (b"X-Kept", b"yes"),
    ]
    out = response_head(200, fields, length=5, close=True)
    assert out == (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Kept: yes\r\n"
        b"Content-Length: 5\r\nConnection: close\r\n\r\n"
    )


# --- on the wire -------------------------------------------------------------------------------


def command(body: bytes = b"{}", *extra: bytes) -> bytes:
    lines = [b"Host: edge", b"Content-Length: %d" % len(body), *extra]
    return head(*lines) + b"\r\n\r\n" + body


@pytest.mark.anyio
async def test_pipelined_commands_are_answered_in_order_on_the_fast_lane() -> None:
    seen: list[bytes] = []

    async def numbered(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        seen.append(body)
        await asyncio.sleep(0.05 if body == b"1" else 0)  # the first is the slowest
        return web.Response(body=b"answer " + body)

    async with fleet(FakeReplica("r1", numbered)) as edge, connected(edge.url) as (reader, w):
        w.write(command(b"1") + command(b"2") + command(b"3"))
        answers = [await read_response(reader) for _ in range(3)]
        assert [a[2] for a in answers] == [b"answer 1", b"answer 2", b"answer 3"]
        assert all(a[0] == 200 for a in answers)
        assert edge.fast_lane_handovers == 0
        assert requests(edge, "command", "delivered") == 3


@pytest.mark.anyio
async def test_a_connection_is_handed_over_mid_life_with_the_bytes_it_had_read() -> None:
    async with fleet(FakeReplica("r1", ok(b"r1"))) as edge, connected(edge.url) as (reader, w):
        # A command on the fast lane, then a probe and a command with a tab in a field, sent
        # together: the probe is the full path's, so the connection is handed over with both.
        w.write(command() + b"GET /livez HTTP/1.1\r\nHost: e\r\n\r\n" + command(b"{}", b"X: a\tb"))
        first, probe, third = [await read_response(reader) for _ in range(3)]
        assert (first[0], first[2]) == (200, b"r1")
        assert (probe[0], probe[2]) == (200, b"ok\n")
        assert (third[0], third[2]) == (200, b"r1")
        assert edge.fast_lane_handovers == 1
        # The handed-over connection stays usable.
        w.write(command())
        assert (await read_response(reader))[2] == b"r1"


@pytest.mark.anyio
async def test_a_body_in_pieces_and_connection_close() -> None:
    replica = FakeReplica("r1", ok(b"r1"))
    async with fleet(replica) as edge, connected(edge.url) as (reader, writer):
        whole = command(b'{"type":"get_state"}', b"Connection: close")
        for i in range(0, len(whole), 7):
            writer.write(whole[i : i + 7])
            await writer.drain()
            await asyncio.sleep(0.001)  # a client that dribbles: the pieces arrive apart
        status, fields, body = await read_response(reader)
        assert (status, body) == (200, b"r1")
        assert fields[b"connection"] == b"close"
        assert await reader.read() == b""  # and the edge closed it
        assert replica.seen[0].body == b'{"type":"get_state"}'
        assert edge.fast_lane_handovers == 0


@pytest.mark.anyio
async def test_a_streamed_answer_is_relayed_chunk_by_chunk() -> None:
    async def streamed(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse()
        out.enable_chunked_encoding()
        await out.prepare(request)
        for part in (b"one ", b"two ", b"three"):
            await out.write(part)
            await asyncio.sleep(0.01)  # a replica that streams: the chunks leave apart
        await out.write_eof()
        return out

    async with fleet(FakeReplica("r1", streamed)) as edge, connected(edge.url) as (reader, w):
        w.write(command())
        status, fields, body = await read_response(reader)
        assert (status, body) == (200, b"one two three")
        assert fields[b"transfer-encoding"] == b"chunked"
        w.write(command())  # still keep-alive afterwards
        assert (await read_response(reader))[2] == b"one two three"


@pytest.mark.anyio
async def test_an_edge_refusal_on_the_fast_lane_is_complete_and_keeps_the_connection() -> None:
    async with fleet(FakeReplica("r1", ok(b"r1"))) as edge, connected(edge.url) as (reader, w):
        bad = b"POST /_beyond/agent?session_id=zz9-s1.x HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
        w.write(bad + command())
        refused = await read_response(reader)
        assert refused[0] in (400, 404) and refused[2].endswith(b"\n")
        assert (await read_response(reader))[2] == b"r1"


@pytest.mark.anyio
async def test_draining_closes_idle_fast_connections_and_finishes_busy_ones() -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.3)
        return web.Response(body=b"late")

    replica = FakeReplica("r1", slow)
    async with (
        fleet(replica, drain_grace_s=5.0) as edge,
        connected(edge.url) as (idle_r, idle_w),
        connected(edge.url) as (busy_r, busy_w),
    ):
        idle_w.write(command())
        assert (await read_response(idle_r))[2] == b"late"
        busy_w.write(command())
        # The replica has the busy connection's command, so the edge is serving it: a drain
        # finds that connection busy (a fixed 50 ms let a loaded runner's drain see it idle).
        await eventually_async(lambda: len(replica.seen) == 2, timeout=5.0)
        drained = asyncio.create_task(edge.drain())
        assert await asyncio.wait_for(idle_r.read(), 2) == b""
        status, fields, body = await read_response(busy_r)
        assert (status, body) == (200, b"late")
        assert fields[b"connection"] == b"close"
        await asyncio.wait_for(drained, 5)


@pytest.mark.anyio
async def test_a_client_silent_mid_request_or_between_requests_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("edge.fast.fastpath.KEEPALIVE_S", 0.2)
    async with (
        fleet(FakeReplica("r1", ok(b"r1"))) as edge,
        connected(edge.url) as (stalled_r, stalled_w),
        connected(edge.url) as (idle_r, idle_w),
    ):
        stalled_w.write(command()[:30])  # half a request line, then nothing
        idle_w.write(command())
        assert (await read_response(idle_r))[2] == b"r1"
        assert await asyncio.wait_for(stalled_r.read(), 3) == b""
        assert await asyncio.wait_for(idle_r.read(), 3) == b""
        assert edge.fast_lane_handovers == 0
