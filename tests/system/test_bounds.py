"""Every bound on hostile input, on a real replica: an excess gets the right status (and is
counted), never an unbounded allocation or a stuck connection."""

from __future__ import annotations

import asyncio
import secrets
import socket

import httpx
import pytest
import websockets

from tests.harness import Fleet, Replica, agent_url, post

pytestmark = pytest.mark.slow
FLEET_DIR = "bounds"  # the conftest fleet's directory


@pytest.fixture(scope="module")
def replica(fleet: Fleet) -> Replica:
    return fleet.replica("bounds", {"a07-s1": fleet.root / "s1"})


def sid() -> str:
    return f"a07-s1.{secrets.token_urlsafe(6)}"


def test_request_headers_over_16_kib_are_431(fleet: Fleet, replica: Replica) -> None:
    session = sid()
    grant = fleet.grant("acme", session, sandbox=False)
    with replica.client() as client:
        padding = {f"x-pad-{i}": "p" * 1000 for i in range(17)}
        refused = post(client, session, grant, {"type": "get_state"}, **padding)
        assert refused.status_code == 431
        events = client.get(
            f"/_beyond/agent/events?session_id={session}",
            headers={"x-beyond-grant": grant, **padding},
        )
        assert events.status_code == 431
        just_under = {f"x-pad-{i}": "p" * 1000 for i in range(13)}
        assert post(client, session, grant, {"type": "get_state"}, **just_under).status_code == 200
    assert 'agent_refusals_total{reason="too_large"} 2.0' in replica.scrape()


def test_websocket_bounds(fleet: Fleet, replica: Replica) -> None:
    session = sid()
    grant = fleet.grant("acme", session, sandbox=False)
    url = replica.url.replace("http", "ws") + agent_url(session)

    async def run() -> tuple[int, int | None, dict[str, object]]:
        padding = {f"x-pad-{i}": "p" * 1000 for i in range(17)}
        try:
            async with websockets.connect(
                url, additional_headers={"x-beyond-grant": grant, **padding}
            ):
                denied = 101
        except websockets.InvalidStatus as exc:
            denied = exc.response.status_code
        async with websockets.connect(
            url, additional_headers={"x-beyond-grant": grant}, max_size=None
        ) as ws:
            await ws.recv()
            closed = None
            try:
                await ws.send("x" * (8 * 1024 * 1024 + 1))
                await asyncio.wait_for(ws.recv(), 10)
            except websockets.ConnectionClosed as exc:
                closed = exc.rcvd.code if exc.rcvd else None
        async with websockets.connect(url, additional_headers={"x-beyond-grant": grant}) as ws:
            await ws.recv()
            await ws.send('{"type": "get_state", "id": "' + "i" * 200 + '"}')
            import json

            answer: dict[str, object] = json.loads(await asyncio.wait_for(ws.recv(), 10))
        return denied, closed, answer

    denied, closed, answer = asyncio.run(run())
    assert denied == 431
    assert closed == 1009  # message too big: the connection is closed, nothing is buffered
    assert answer["type"] == "error" and "1-128" in str(answer["error"])


def test_post_body_and_list_bounds(fleet: Fleet, replica: Replica) -> None:
    session = sid()
    grant = fleet.grant("acme", session, sandbox=False)
    with replica.client() as client:
        host, port = replica.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.sendall(
                f"POST {agent_url(session)} HTTP/1.1\r\nHost: x\r\n"
                f"x-beyond-grant: {grant}\r\nContent-Length: {9 * 1024 * 1024}\r\n"
                "\r\n{}".encode()
            )
            assert raw.recv(4096).startswith(b"HTTP/1.1 413 ")  # answered before the body
        listing = post(client, session, grant, {"type": "list_sessions", "limit": 10_000})
        assert listing.status_code == 200 and isinstance(listing.json()["data"]["sessions"], list)
        assert (
            post(client, session, grant, {"type": "list_sessions", "query": "q" * 300}).status_code
            == 400
        )
    with httpx.Client(base_url=replica.url, timeout=10) as client:
        assert client.get("/livez").status_code == 200  # still serving after all of it
