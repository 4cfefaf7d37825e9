from __future__ import annotations

import asyncio
import logging

import pytest

from edge.aio.callbacks import CallbackLimits
from edge.core.config import EdgeOptions
from edge.core.metrics import LimitScope
from tests.edge.fakes import (
    FakeReplica,
    fleet,
    hang,
    ok,
    refuse,
    requests,
    sample,
    session_with_walk,
)
from tests.edge.wire_client import send_raw
from tests.harness import eventually_async

TOKEN = b"bjn_v1.c2VjcmV0LXRva2VuLW5ldmVyLWxvZ2dlZA"
SID = "a07-s1.job"


def callback(
    *auth: bytes,
    method: bytes = b"POST",
    path: bytes = b"/_beyond/agent?session_id=" + SID.encode() + b"&tenant=t1",
    body: bytes = b'{"type": "job_ended", "job": 7}',
    extra: bytes = b"",
) -> bytes:
    lines = b"".join(b"Authorization: " + a + b"\r\n" for a in auth)
    return (
        method
        + b" "
        + path
        + b" HTTP/1.1\r\nHost: fleet.example\r\n"
        + lines
        + extra
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n"
        + body
    )


# --- E1: classification, on the wire -------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "status", "forwarded"),
    [
        (callback(b"Bearer " + TOKEN), 200, True),
        (callback(b"bearer   " + TOKEN), 200, True),
        (callback(b"BEARER " + TOKEN), 200, True),
        (callback(b"Bearer user-grant"), 200, True),  # a user request, routed as a command
        (callback(b"Bearer\t" + TOKEN), 400, False),
        (callback(b"Bearer \t" + TOKEN), 400, False),
        (callback(b"Bearer" + TOKEN), 400, False),
        (callback(b"Bearer " + TOKEN, b"Bearer " + TOKEN), 400, False),
        (callback(b"Bearer " + TOKEN, b"Basic dXNlcg=="), 400, False),
        (callback(b"Bearer " + TOKEN + b"\xff"), 400, False),
        (callback(b"Bearer " + TOKEN, method=b"GET", body=b""), 403, False),
        (callback(b"Bearer " + TOKEN, method=b"PUT"), 403, False),
        (
            callback(b"Bearer " + TOKEN, path=b"/_beyond/agent/events?session_id=" + SID.encode()),
            403,
            False,
        ),
        (callback(b"Bearer " + TOKEN, path=b"/livez"), 403, False),
        (
            callback(
                b"Bearer " + TOKEN, path=b"/_beyond/agent?session_id=a07-s1.a&session_id=a07-s1.b"
            ),
            400,
            False,
        ),
        (
            callback(
                b"Bearer " + TOKEN, path=b"/_beyond/agent?session_id=a07-s1.a&session%5Fid=a07-s1.b"
            ),
            400,
            False,
        ),
        (callback(b"Bearer " + TOKEN, path=b"/_beyond/agent?tenant=t1"), 400, False),
        (callback(b"Bearer " + TOKEN, path=b"/_beyond/agent?session_id=zz-s1.a"), 404, False),
        (callback(b"Bearer " + TOKEN, path=b"/_beyond/agent?session_id=a07-s1.a/b"), 400, False),
    ],
)
@pytest.mark.anyio
async def test_e1_callbacks_are_classified_exactly(
    request_bytes: bytes, status: int, forwarded: bool
) -> None:
    r1 = FakeReplica("r1", ok(b"taken"))
    async with fleet(r1) as edge:
        got, body = await send_raw(edge.port, request_bytes)
    assert got == status
    assert bool(r1.seen) is forwarded
    assert TOKEN not in body


# --- E2: forwarded unchanged ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_e2_a_callback_is_forwarded_unchanged() -> None:
    body = b'{"type":"job_ended","job":"j-1","state":"exited","code":0}'
    extra = (
        b"X-Sandbox-Id: sbx-9\r\nx-beyond-grant: not-for-the-edge\r\n"
        b"Content-Type: application/json\r\n"
    )
    r1 = FakeReplica("r1", ok(b"taken"))
    async with fleet(r1) as edge:
        assert await send_raw(edge.port, callback(b"Bearer  " + TOKEN, extra=extra, body=body)) == (
            200,
            b"taken",
        )
    (seen,) = r1.seen
    assert seen.body == body
    assert seen.headers == [
        (b"Host", b"fleet.example"),
        (b"Authorization", b"Bearer  " + TOKEN),
        (b"X-Sandbox-Id", b"sbx-9"),
        (b"x-beyond-grant", b"not-for-the-edge"),
        (b"Content-Type", b"application/json"),
        (b"Content-Length", str(len(body)).encode()),
    ]
    assert seen.raw_target == f"/_beyond/agent?session_id={SID}&tenant=t1"


@pytest.mark.anyio
async def test_e2_a_chunked_callback_keeps_its_transfer_encoding() -> None:
    data = (
        b"POST /_beyond/agent?session_id=" + SID.encode() + b" HTTP/1.1\r\nHost: f\r\n"
        b"Authorization: Bearer "
        + TOKEN
        + b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b'4\r\n{"a"\r\n3\r\n:1}\r\n0\r\n\r\n'
    )
    r1 = FakeReplica("r1", ok(b"taken"))
    async with fleet(r1) as edge:
        assert await send_raw(edge.port, data) == (200, b"taken")
    (seen,) = r1.seen
    assert seen.body == b'{"a":1}'
    assert seen.header("Transfer-Encoding") == [b"chunked"] and not seen.header("Content-Length")


# --- E3, E4, E5 ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_e3_a_callback_is_routed_like_any_request() -> None:
    r1, r2 = FakeReplica("r1", refuse(503, "not here")), FakeReplica("r2", ok(b"holder"))
    sid = session_with_walk(("r1", "r2"), ("r1", "r2"))
    path = b"/_beyond/agent?session_id=" + sid.encode()
    async with fleet(r1, r2) as edge:
        assert await send_raw(edge.port, callback(b"Bearer " + TOKEN, path=path)) == (
            200,
            b"holder",
        )
    assert len(r1.seen) == 3 and len(r2.seen) == 1


@pytest.mark.anyio
async def test_e4_an_unanswered_callback_is_503_in_time_and_cancelled_upstream() -> None:
    r1 = FakeReplica("r1", hang())
    loop = asyncio.get_running_loop()
    async with fleet(r1, callback_budget_s=0.5) as edge:
        started = loop.time()
        status, body = await send_raw(edge.port, callback(b"Bearer " + TOKEN))
        elapsed = loop.time() - started
        await eventually_async(lambda: r1.cancelled, timeout=2.0)
        assert requests(edge, "callback", "timed_out") == 1
    assert status == 503 and b"0.5 s" in body
    assert 0.5 <= elapsed < 2.5
    assert r1.cancelled == 1


@pytest.mark.anyio
async def test_e4_a_callback_budget_bounds_the_walk_too() -> None:
    r1 = FakeReplica("r1", refuse(503, "not here"))
    loop = asyncio.get_running_loop()
    async with fleet(r1, callback_budget_s=0.3, retry_budget_s=30.0) as edge:
        started = loop.time()
        status, _ = await send_raw(edge.port, callback(b"Bearer " + TOKEN))
        assert status == 503 and loop.time() - started < 2.5


@pytest.mark.parametrize("status", [200, 202, 400, 401, 403, 404, 410, 411, 413])
@pytest.mark.anyio
async def test_e5_the_replicas_status_passes_through(status: int) -> None:
    r1 = FakeReplica("r1", refuse(status, f"replica says {status}"))
    async with fleet(r1) as edge:
        got = await send_raw(edge.port, callback(b"Bearer " + TOKEN))
    assert got == (status, f"replica says {status}".encode())
    assert len(r1.seen) == 1


# --- E6 and the per-source limit -----------------------------------------------------------------


@pytest.mark.anyio
async def test_e6_at_most_20_callbacks_a_second_per_session() -> None:
    r1 = FakeReplica("r1", ok(b"taken"))
    other = b"/_beyond/agent?session_id=a07-s1.other"
    async with fleet(r1) as edge:
        # Sent together, so all 21 land well inside one second even on a loaded machine.
        answers = await asyncio.gather(
            *(send_raw(edge.port, callback(b"Bearer " + TOKEN)) for _ in range(21))
        )
        assert sorted(status for status, _ in answers) == [200] * 20 + [429]
        assert (await send_raw(edge.port, callback(b"Bearer " + TOKEN, path=other)))[0] == 200
        assert sample(edge, "edge_callbacks_rate_limited_total", scope="session") == 1
    assert len(r1.seen) == 21


@pytest.mark.anyio
async def test_a_source_address_is_rate_limited_across_sessions() -> None:
    r1 = FakeReplica("r1", ok(b"taken"))
    async with fleet(r1, callback_rate_per_source=2.0) as edge:
        paths = [b"/_beyond/agent?session_id=a07-s1.s%d" % i for i in range(3)]
        answers = await asyncio.gather(
            *(send_raw(edge.port, callback(b"Bearer " + TOKEN, path=p)) for p in paths)
        )
        assert sorted(status for status, _ in answers) == [200, 200, 429]
        assert sample(edge, "edge_callbacks_rate_limited_total", scope="source") == 1
        assert sample(edge, "edge_callbacks_rate_limited_total", scope="session") == 0


def test_limits_check_the_source_before_the_session() -> None:
    limits = CallbackLimits(
        EdgeOptions(callback_rate_per_source=2.0, callback_rate_per_session=1.0)
    )
    assert limits.check("s", "10.0.0.1", 0.0) is None
    assert limits.check("s", "10.0.0.1", 0.1) is LimitScope.SESSION
    assert limits.check("s", "10.0.0.1", 0.2) is LimitScope.SOURCE
    assert limits.check("s", "10.0.0.2", 1.5) is None


# --- E7 ------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_e7_the_token_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    r1 = FakeReplica("r1", refuse(401, "token did not verify"))
    unparseable = callback(b"Bearer " + TOKEN + b"\x01")  # aiohttp logs the bytes it rejects
    with caplog.at_level(logging.DEBUG):
        async with fleet(r1) as edge:
            for data in (
                callback(b"Bearer " + TOKEN),
                callback(b"Bearer\t" + TOKEN),
                callback(b"Bearer " + TOKEN, method=b"GET", body=b""),
                unparseable,
            ):
                await send_raw(edge.port, data)
            scrape = edge.metrics.render()
    assert "edge.access" in caplog.text
    # The request aiohttp could not parse is logged by its kind and peer, not its bytes.
    assert "bad request from 127.0.0.1: BadHttpMessage (400)" in caplog.text
    assert TOKEN.decode() not in caplog.text
    assert TOKEN[7:].decode() not in caplog.text
    assert TOKEN not in scrape and b"a07-s1" not in scrape
