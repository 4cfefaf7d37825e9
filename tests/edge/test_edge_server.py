from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from edge.core.ring import Ring
from edge.server import ServerState
from tests.edge.fakes import (
    FAST,
    FakeReplica,
    edge_config,
    fleet,
    hang,
    ok,
    requests,
)
from tests.edge.wire_client import send_raw
from tests.harness import eventually_async


async def get(url: str, method: str = "GET", **kw: object) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as client, client.request(method, url, **kw) as resp:  # type: ignore[arg-type]
        return resp.status, await resp.read()


def slow(seconds: float) -> object:
    async def handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        return web.Response(text="finished")

    return handler


@pytest.mark.anyio
async def test_probes_answer_from_the_edge_itself() -> None:
    r1 = FakeReplica("r1")
    async with fleet(r1) as edge:
        assert await get(edge.url + "/livez") == (200, b"ok\n")
        assert await get(edge.url + "/readyz") == (200, b"ready\n")
        edge.state = ServerState.DRAINING
        assert (await get(edge.url + "/readyz"))[0] == 503
        assert (await get(edge.url + "/livez"))[0] == 200
        edge.state = ServerState.SERVING
    assert not r1.seen


@pytest.mark.parametrize(
    ("target", "status"),
    [
        ("/_beyond/agent", 400),
        ("/_beyond/agent?session_id=a07-s1.a&session_id=a07-s1.b", 400),
        ("/_beyond/agent?session_id=not-an-id", 400),
        ("/_beyond/agent?session_id=a07-s1.x/..", 400),
        ("/_beyond/agent?session_id=b99-s1.x", 404),
        ("/elsewhere", 404),
    ],
)
@pytest.mark.anyio
async def test_unroutable_requests_are_answered_by_the_edge(target: str, status: int) -> None:
    r1 = FakeReplica("r1")
    async with fleet(r1) as edge:
        assert (await get(edge.url + target, "POST", data=b"{}"))[0] == status
        assert requests(edge, "command", "rejected") + requests(edge, "other", "rejected") == 1
    assert not r1.seen


@pytest.mark.anyio
async def test_a_post_without_a_length_is_411() -> None:
    r1 = FakeReplica("r1")
    data = (
        b"POST /_beyond/agent?session_id=a07-s1.x HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\r\n"
    )
    async with fleet(r1) as edge:
        assert (await send_raw(edge.port, data))[0] == 411
    assert not r1.seen


@pytest.mark.anyio
async def test_expect_100_continue_is_answered_by_the_edge() -> None:
    r1 = FakeReplica("r1", ok(b"got it"))
    head = (
        b"POST /_beyond/agent?session_id=a07-s1.x HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\n"
        b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
    )
    async with fleet(r1) as edge:
        reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
        writer.write(head)
        assert (
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
            == b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(b"{}")
        answer = await asyncio.wait_for(reader.read(), 2)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"got it")
    (seen,) = r1.seen
    assert seen.body == b"{}" and not seen.header("Expect")


@pytest.mark.anyio
async def test_head_is_passed_through_without_a_body() -> None:
    async def head(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"12345")

    r1 = FakeReplica("r1", head)
    async with fleet(r1) as edge, aiohttp.ClientSession() as client:
        async with client.head(edge.url + "/_beyond/agent?session_id=a07-s1.x") as resp:
            assert resp.status == 200 and resp.headers["Content-Length"] == "5"
        # The connection is still usable afterwards.
        async with client.get(edge.url + "/livez") as resp:
            assert resp.status == 200


@pytest.mark.anyio
async def test_over_the_concurrency_limit_requests_are_shed() -> None:
    r1 = FakeReplica("r1", hang())
    async with fleet(r1, max_concurrent_requests=1) as edge:
        first = asyncio.create_task(
            get(edge.url + "/_beyond/agent?session_id=a07-s1.x", "POST", data=b"{}")
        )
        await eventually_async(lambda: r1.seen, timeout=2.0)
        assert (await get(edge.url + "/_beyond/agent?session_id=a07-s1.y", "POST", data=b"{}"))[
            0
        ] == 503
        assert requests(edge, "command", "shed") == 1
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


@pytest.mark.anyio
async def test_drain_lets_work_in_progress_finish_and_refuses_new_connections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r1 = FakeReplica("r1", slow(0.3))  # type: ignore[arg-type]
    async with fleet(r1) as edge:
        in_flight = asyncio.create_task(
            get(edge.url + "/_beyond/agent?session_id=a07-s1.x", "POST", data=b"{}")
        )
        await eventually_async(lambda: r1.seen, timeout=2.0)
        with caplog.at_level(logging.INFO, "edge.server"):
            drained = asyncio.create_task(edge.drain(5.0))
            # Logged once the drain has stopped accepting and waits for the request in flight.
            await eventually_async(
                lambda: "draining: 1 requests in progress" in caplog.text,
                timeout=2.0,
                message="the drain never began waiting for the request in flight",
            )
        assert edge.state is ServerState.DRAINING
        with pytest.raises(aiohttp.ClientConnectionError):
            await get(edge.url + "/livez")
        assert await in_flight == (200, b"finished")
        await drained
        assert edge.state.name == "STOPPED"


@pytest.mark.anyio
async def test_drain_past_its_grace_cancels_what_is_left() -> None:
    r1 = FakeReplica("r1", hang())
    loop = asyncio.get_running_loop()
    async with fleet(r1) as edge:
        stuck = asyncio.create_task(
            get(edge.url + "/_beyond/agent?session_id=a07-s1.x", "POST", data=b"{}")
        )
        await eventually_async(lambda: r1.seen, timeout=2.0)
        started = loop.time()
        await edge.drain(0.2)
        assert loop.time() - started < 3.0
        with pytest.raises(aiohttp.ClientError):
            await stuck
        await eventually_async(lambda: r1.cancelled, timeout=2.0)
    assert r1.cancelled == 1


@pytest.mark.anyio
async def test_reload_moves_only_the_sessions_the_new_ring_moves() -> None:
    replicas = [FakeReplica(n, ok(n.encode())) for n in ("r1", "r2", "r3")]
    sids = [f"a07-s1.k{i}" for i in range(40)]
    async with fleet(*replicas[:2]) as edge:
        await replicas[2].start()
        try:
            before = {
                s: (await get(f"{edge.url}/_beyond/agent?session_id={s}", "POST", data=b"{}"))[1]
                for s in sids
            }
            edge.reload(edge_config(replicas, **FAST))
            after = {
                s: (await get(f"{edge.url}/_beyond/agent?session_id={s}", "POST", data=b"{}"))[1]
                for s in sids
            }
        finally:
            await replicas[2].close()
    new_ring = Ring(("r1", "r2", "r3"))
    moved = {s for s in sids if before[s] != after[s]}
    assert moved == {s for s in sids if new_ring.owner(s) == "r3"}
    assert moved and len(moved) < len(sids)
    assert all(after[s] == new_ring.owner(s).encode() for s in sids)


@pytest.mark.anyio
async def test_a_bad_config_file_keeps_the_running_config(tmp_path: Path) -> None:
    r1 = FakeReplica("r1", ok(b"r1"))
    bad = tmp_path / "edge.toml"
    bad.write_text("[edge]\nretry_budget = 5\n")
    async with fleet(r1) as edge:
        assert await edge.reload_from(bad) is False
        assert await get(edge.url + "/_beyond/agent?session_id=a07-s1.x", "POST", data=b"{}") == (
            200,
            b"r1",
        )
        assert (
            edge.metrics.registry.get_sample_value(
                "edge_config_reloads_total", {"result": "failed"}
            )
            == 1
        )
