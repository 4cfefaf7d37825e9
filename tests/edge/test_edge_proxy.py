from __future__ import annotations

import asyncio
import os
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy

from tests.edge.fakes import (
    FakeReplica,
    Handler,
    fleet,
    hang,
    ok,
    refuse,
    requests,
    sample,
    script,
    session_with_walk,
)
from tests.harness import eventually_async

NAMES = ("r1", "r2", "r3")


def agent(edge_url: str, sid: str, extra: str = "") -> str:
    return f"{edge_url}/_beyond/agent?session_id={sid}{extra}"


async def call(method: str, url: str, **kw: Any) -> tuple[int, bytes, CIMultiDictProxy[str]]:
    async with aiohttp.ClientSession() as client, client.request(method, url, **kw) as resp:
        return resp.status, await resp.read(), resp.headers


def three(*handlers: Handler) -> tuple[FakeReplica, ...]:
    return tuple(FakeReplica(n, h) for n, h in zip(NAMES, handlers, strict=True))


@pytest.mark.anyio
async def test_a_session_keeps_landing_on_its_owner() -> None:
    r1, r2, r3 = three(ok(b"r1"), ok(b"r2"), ok(b"r3"))
    sid = session_with_walk(NAMES, ("r2",))
    async with fleet(r1, r2, r3) as edge:
        for _ in range(5):
            assert (await call("POST", agent(edge.url, sid), json={"type": "get_state"}))[:2] == (
                200,
                b"r2",
            )
    assert (len(r1.seen), len(r2.seen), len(r3.seen)) == (0, 5, 0)
    assert all(s.query == f"session_id={sid}" for s in r2.seen)


@pytest.mark.anyio
async def test_a_busy_owner_is_retried_in_place_after_its_retry_after() -> None:
    r1, r2, r3 = three(script(refuse(503, "held elsewhere", retry_after=1), ok(b"r1")), ok(), ok())
    sid = session_with_walk(NAMES, ("r1",))
    async with fleet(r1, r2, r3, retry_after_cap_s=2.0) as edge:
        assert (await call("POST", agent(edge.url, sid), data=b"{}"))[:2] == (200, b"r1")
        assert sample(edge, "edge_retries_total", kind="command") == 1
    assert len(r1.seen) == 2 and not r2.seen and not r3.seen
    assert r1.seen[1].at - r1.seen[0].at >= 1.0


@pytest.mark.anyio
async def test_a_session_live_on_a_substitute_is_found_by_the_walk() -> None:
    r1, r2, r3 = three(refuse(503), refuse(503), ok(b"here"))
    sid = session_with_walk(NAMES, ("r1", "r2", "r3"))
    async with fleet(r1, r2, r3) as edge:
        assert (await call("POST", agent(edge.url, sid), data=b"{}"))[:2] == (200, b"here")
        assert sample(edge, "edge_walk_steps_total", kind="command") == 2
    assert (len(r1.seen), len(r2.seen), len(r3.seen)) == (3, 1, 1)


@pytest.mark.anyio
async def test_a_dead_replica_is_walked_past() -> None:
    r2, r3 = FakeReplica("r2", ok(b"r2")), FakeReplica("r3", ok(b"r3"))
    sid = session_with_walk(NAMES, ("r1", "r2"))
    async with fleet(r2, r3, dead=["r1"]) as edge:
        assert (await call("POST", agent(edge.url, sid), data=b"{}"))[:2] == (200, b"r2")
        assert sample(edge, "edge_upstream_unreachable_total", kind="command") == 3


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 500])
@pytest.mark.anyio
async def test_other_statuses_pass_through_untried(status: int) -> None:
    r1, r2, r3 = three(refuse(status, f"reason {status}"), ok(), ok())
    sid = session_with_walk(NAMES, ("r1",))
    async with fleet(r1, r2, r3) as edge:
        answer = await call("POST", agent(edge.url, sid), data=b"{}")
        assert answer[:2] == (status, f"reason {status}".encode())
    assert (len(r1.seen), len(r2.seen), len(r3.seen)) == (1, 0, 0)


@pytest.mark.anyio
async def test_421_is_never_retried_on_that_replica() -> None:
    r1, r2, r3 = three(refuse(421, "not mounted"), script(refuse(503), ok(b"r2")), refuse(503))
    sid = session_with_walk(NAMES, ("r1", "r2", "r3"))
    async with fleet(r1, r2, r3) as edge:
        assert (await call("POST", agent(edge.url, sid), data=b"{}"))[:2] == (200, b"r2")
        assert sample(edge, "edge_misdirected_total", kind="command") == 1
    assert (len(r1.seen), len(r2.seen), len(r3.seen)) == (1, 2, 1)


@pytest.mark.anyio
async def test_a_slice_that_answers_421_everywhere_is_misrouted() -> None:
    only = FakeReplica("r1", refuse(421, "not mounted"))
    async with fleet(only) as edge:
        status, body, _ = await call("POST", agent(edge.url, "a07-s1.x"), data=b"{}")
        assert status == 502 and b"421" in body
        assert requests(edge, "command", "misrouted") == 1
    assert len(only.seen) == 1


@pytest.mark.anyio
async def test_budget_exhaustion_is_a_clear_503_from_the_edge() -> None:
    r1 = FakeReplica("r1", refuse(503, "held elsewhere"))
    r2 = FakeReplica("r2", refuse(503, "held elsewhere"))
    loop = asyncio.get_running_loop()
    async with fleet(r1, r2, retry_budget_s=0.3) as edge:
        started = loop.time()
        status, body, headers = await call("POST", agent(edge.url, "a07-s1.x"), data=b"{}")
        assert status == 503 and headers["Retry-After"] == "1"
        assert loop.time() - started < 2.0
        text = body.decode()
        assert "slice a07" in text and "0.3 s" in text and "held elsewhere" in text
        assert sample(edge, "edge_budget_exhaustions_total", kind="command") == 1
    # Retried in place, then walked: how many retries fit in 0.3 s depends on the machine's load.
    assert len(r1.seen) >= 2 and r2.seen


@pytest.mark.anyio
async def test_a_client_that_leaves_cancels_its_placement() -> None:
    only = FakeReplica("r1", refuse(503, retry_after=1))
    async with fleet(only, retry_budget_s=30.0) as edge, aiohttp.ClientSession() as client:
        task = asyncio.create_task(client.post(agent(edge.url, "a07-s1.x"), data=b"{}"))
        await eventually_async(
            lambda: len(only.seen) >= 2, timeout=5.0, message="the placement never retried"
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually_async(
            lambda: requests(edge, "command", "client_gone") == 1,
            timeout=5.0,
            message="the edge never ended the request of the client that left",
        )
        asked = len(only.seen)
        # Not a wait for anything: no further ask is the claim, and 0.3 s is several of the
        # placement's retry pauses (FAST caps them at 0.05 s).
        await asyncio.sleep(0.3)
        assert len(only.seen) == asked
        assert edge.in_flight == 0
        assert requests(edge, "command", "client_gone") == 1


@pytest.mark.anyio
async def test_a_client_that_leaves_cancels_the_replica_request() -> None:
    only = FakeReplica("r1", hang())
    async with fleet(only) as edge, aiohttp.ClientSession() as client:
        task = asyncio.create_task(client.post(agent(edge.url, "a07-s1.x"), data=b"{}"))
        await eventually_async(lambda: only.seen, timeout=1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually_async(lambda: only.cancelled, timeout=1.0)
        assert only.cancelled == 1 and edge.in_flight == 0


@pytest.mark.anyio
async def test_the_body_is_resent_intact_on_every_retry() -> None:
    body = os.urandom(200_000)
    r1 = FakeReplica("r1", script(refuse(503), refuse(503), ok(b"done")))
    async with fleet(r1) as edge:
        assert (await call("POST", agent(edge.url, "a07-s1.x"), data=body))[:2] == (200, b"done")
    assert [s.body == body for s in r1.seen] == [True, True, True]
    assert all(s.header("Content-Length") == [b"200000"] for s in r1.seen)


@pytest.mark.anyio
async def test_a_chunked_body_is_buffered_and_sent_with_a_length() -> None:
    async def chunks() -> object:
        for piece in (b"ab", b"cd", b"ef"):
            yield piece

    r1 = FakeReplica("r1", ok())
    async with fleet(r1) as edge:
        assert (await call("POST", agent(edge.url, "a07-s1.x"), data=chunks()))[0] == 200
    (seen,) = r1.seen
    assert seen.body == b"abcdef"
    assert seen.header("Content-Length") == [b"6"] and not seen.header("Transfer-Encoding")


@pytest.mark.anyio
async def test_body_limits_are_the_edges_own_answers() -> None:
    r1 = FakeReplica("r1", ok())
    async with fleet(r1, max_request_body_bytes=1000) as edge:
        assert (await call("POST", agent(edge.url, "a07-s1.x"), data=b"x" * 1001))[0] == 413
        assert (await call("POST", agent(edge.url, "a07-s1.x"), data=b"x" * 1000))[0] == 200
    assert len(r1.seen) == 1


@pytest.mark.anyio
async def test_hop_by_hop_fields_are_dropped_both_ways() -> None:
    async def reply(request: web.Request) -> web.StreamResponse:
        return web.Response(
            text="ok",
            headers={
                "X-Kept": "yes",
                "Keep-Alive": "timeout=5",
                "Trailer": "X",
                "X-Drop": "1",
                "Connection": "X-Drop",
            },
        )

    r1 = FakeReplica("r1", reply)
    headers = {
        "Connection": "keep-alive, X-Private",
        "X-Private": "secret-hop",
        "Keep-Alive": "timeout=1",
        "TE": "trailers",
        "Proxy-Authorization": "Basic x",
        "X-Beyond-Grant": "grant-value",
        "X-Custom": "a",
    }
    async with fleet(r1) as edge:
        _, _, got = await call("POST", agent(edge.url, "a07-s1.x"), data=b"{}", headers=headers)
        assert got["X-Kept"] == "yes"
        assert "X-Drop" not in got and "Trailer" not in got and "Keep-Alive" not in got
    (seen,) = r1.seen
    names = {n.lower() for n, _ in seen.headers}
    assert {b"x-private", b"keep-alive", b"te", b"proxy-authorization"}.isdisjoint(names)
    assert seen.header("X-Beyond-Grant") == [b"grant-value"] and seen.header("X-Custom") == [b"a"]


@pytest.mark.anyio
async def test_a_silent_replica_is_a_504() -> None:
    r1 = FakeReplica("r1", hang())
    async with fleet(r1, upstream_header_timeout_s=0.2) as edge:
        assert (await call("POST", agent(edge.url, "a07-s1.x"), data=b"{}"))[0] == 504
    assert len(r1.seen) == 1


@pytest.mark.anyio
async def test_a_large_response_is_streamed_whole() -> None:
    big = os.urandom(3 * 1024 * 1024)
    r1 = FakeReplica("r1", ok(big))
    async with fleet(r1) as edge:
        assert (await call("GET", agent(edge.url, "a07-s1.x")))[:2] == (200, big)


# --- SSE -----------------------------------------------------------------------------------------


def event_stream(gate: asyncio.Event) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Last-Event-ID") == "unknown":
            return web.Response(status=409, text="unknown message id")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: catchup\nid: m1\ndata: {"type": "catchup"}\n\n')
        await gate.wait()
        await resp.write(b'id: m2\ndata: {"type": "committed"}\n\n')
        await resp.write_eof()
        return resp

    return handler


@pytest.mark.anyio
async def test_sse_is_streamed_unbuffered_with_last_event_id_forwarded() -> None:
    gate = asyncio.Event()
    r1 = FakeReplica("r1", event_stream(gate))
    url = "/_beyond/agent/events?session_id=a07-s1.x&since=m0"
    async with fleet(r1) as edge, aiohttp.ClientSession() as client:
        async with client.get(edge.url + url, headers={"Last-Event-ID": "m0"}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/event-stream"
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 2)
            assert b"catchup" in first
            assert sample(edge, "edge_open_streams", kind="sse") == 1
            gate.set()
            rest = await asyncio.wait_for(resp.read(), 2)
            assert b"committed" in rest
        async with client.get(edge.url + url, headers={"Last-Event-ID": "unknown"}) as resp:
            assert (resp.status, await resp.text()) == (409, "unknown message id")
        assert sample(edge, "edge_open_streams", kind="sse") == 0
    assert r1.seen[0].header("Last-Event-ID") == [b"m0"]
    assert r1.seen[0].raw_target == url


@pytest.mark.parametrize(("pause", "status", "body"), [(0.05, 200, b"whole"), (1.0, 504, None)])
@pytest.mark.anyio
async def test_a_short_answer_written_in_two_parts_is_sent_whole(
    pause: float, status: int, body: bytes | None
) -> None:
    done = asyncio.Event()

    async def split(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Session-Id: a07-s1.x\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(pause)
            writer.write(b"whole")
            await writer.drain()
            await reader.read()
        except ConnectionError:
            pass
        finally:
            writer.close()
            done.set()

    server = await asyncio.start_server(split, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with fleet(upstream_header_timeout_s=0.5, extra=[("r1", url)]) as edge:
            got_status, got_body, headers = await call(
                "POST", agent(edge.url, "a07-s1.x"), data=b"{}"
            )
        await asyncio.wait_for(done.wait(), 5)
    finally:
        server.close()
    assert got_status == status
    if body is not None:
        assert got_body == body and headers["X-Session-Id"] == "a07-s1.x"
