"""The SSE event stream of a real replica: catch-up, resume, 409, keepalive, reconnect on lag."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import Fleet, Replica, eventually, post, sse_events
from tests.replica.support import new_sid

pytestmark = pytest.mark.slow
FLEET_DIR = "sse"  # the conftest fleet's directory
EVENTS = "/_beyond/agent/events"


@pytest.fixture(scope="module")
def replica(fleet: Fleet) -> Replica:
    return fleet.replica(
        "sse1",
        {"a07-s1": fleet.root / "s1"},
        "--sse-keepalive",
        "0.3",
        "--model",
        "stub:ttft=50ms,per_token=30ms,tokens=30",
        "--stream-queue-frames",
        "8",
    )


def read_events(
    replica: Replica,
    sid: str,
    grant: str,
    *,
    until: str,
    headers: dict[str, str] | None = None,
    query: str = "",
    timeout: float = 15,
) -> tuple[list[dict[str, str]], list[str]]:
    """Read an SSE stream until an event whose data contains ``until``; returns events and raw
    lines (comments included). ``TimeoutError`` when none comes in ``timeout`` seconds."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with (
        httpx.Client(base_url=replica.url, timeout=timeout) as client,
        client.stream(
            "GET",
            f"{EVENTS}?session_id={sid}{query}",
            headers={"x-beyond-grant": grant, **(headers or {})},
        ) as response,
    ):
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith("data:") and until in line:
                break
            if time.monotonic() > deadline:  # keepalive comments would read on forever
                raise TimeoutError(f"no {until} on the stream in {timeout} s: {lines[-3:]}")
    return sse_events([*lines, ""]), lines


def finished_turn(client: httpx.Client, sid: str, grant: str) -> None:
    assert post(client, sid, grant, {"type": "prompt", "message": "first"}).status_code == 202
    eventually(
        lambda: not post(client, sid, grant, {"type": "get_state"}).json()["data"]["running"]
    )


def test_catchup_then_live_frames_with_ids_on_commits(fleet: Fleet, replica: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    with replica.client() as client:
        finished_turn(client, sid, grant)
        leaf = post(client, sid, grant, {"type": "get_state"}).json()["data"]["leaf_id"]
        post(client, sid, grant, {"type": "prompt", "message": "second"})
    events, _ = read_events(replica, sid, grant, until='"turn_ended"')
    catchup = json.loads(events[0]["data"])
    assert catchup["type"] == "catchup" and events[0]["id"] == catchup["leaf_id"]
    assert catchup["leaf_id"] in (leaf, None) or len(catchup["messages"]) >= 2
    frames = [json.loads(e["data"]) for e in events[1:]]
    committed = [
        (e.get("id"), f["leaf_id"])
        for e, f in zip(events[1:], frames, strict=True)
        if f["type"] == "committed"
    ]
    assert committed and all(event_id == leaf_id for event_id, leaf_id in committed)
    uncommitted_ids = [
        e.get("id") for e, f in zip(events[1:], frames, strict=True) if f["type"] != "committed"
    ]
    assert set(uncommitted_ids) == {None}  # frames inside a turn carry no id


def test_mid_turn_attach_replays_the_turn_from_its_start(fleet: Fleet, replica: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    with replica.client() as client:
        post(client, sid, grant, {"type": "prompt", "message": "replay me"})
    # Some deltas are out (another reader has one) before the reader under test attaches.
    read_events(replica, sid, grant, until='"text_delta"')
    events, _ = read_events(replica, sid, grant, until='"turn_ended"')
    catchup = json.loads(events[0]["data"])
    replayed = [f["event"]["kind"] for f in catchup["turn"]]
    assert replayed[0] == "turn_started" and "text_delta" in replayed
    assert catchup["turn_truncated"] is False
    live = [json.loads(e["data"]) for e in events[1:]]
    text = "".join(
        f["event"]["text"]
        for f in [*catchup["turn"], *live]
        if f["type"] == "event" and f["event"]["kind"] == "text_delta"
    )
    assert len(text.split()) == 30  # replay + live = the whole reply, nothing twice


def test_resume_from_last_event_id_and_since_and_409(fleet: Fleet, replica: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    with replica.client() as client:
        finished_turn(client, sid, grant)
        first_leaf = post(client, sid, grant, {"type": "get_state"}).json()["data"]["leaf_id"]
        assert post(client, sid, grant, {"type": "prompt", "message": "again"}).status_code == 202
        eventually(
            lambda: not post(client, sid, grant, {"type": "get_state"}).json()["data"]["running"]
        )
        unknown = client.get(
            f"{EVENTS}?session_id={sid}",
            headers={"x-beyond-grant": grant, "Last-Event-ID": "m-nope"},
        )
        assert unknown.status_code == 409
    for how in ({"headers": {"Last-Event-ID": first_leaf}}, {"query": f"&since={first_leaf}"}):
        events, _ = read_events(replica, sid, grant, until='"catchup"', **how)
        catchup = json.loads(events[0]["data"])
        assert [m["role"] for m in catchup["messages"]] == ["user", "assistant"]
        assert catchup["messages"][0]["content"] == "again"
        assert catchup["messages"][0]["parent_id"] == first_leaf


def test_keepalive_comments_on_an_idle_stream(fleet: Fleet, replica: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    comments: list[str] = []
    with (
        httpx.Client(base_url=replica.url, timeout=10) as client,
        client.stream(
            "GET", f"{EVENTS}?session_id={sid}", headers={"x-beyond-grant": grant}
        ) as response,
    ):
        started = time.monotonic()
        for line in response.iter_lines():
            if line.startswith(":"):
                comments.append(line)
                if len(comments) == 2:
                    break
    assert comments == [": keepalive", ": keepalive"]
    assert time.monotonic() - started >= 0.5


def _raw_sse(replica: Replica, sid: str, grant: str) -> socket.socket:
    host, port = replica.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a slow, small reader
    sock.connect((host, int(port)))
    sock.sendall(
        f"GET {EVENTS}?session_id={sid} HTTP/1.1\r\nHost: x\r\n"
        f"x-beyond-grant: {grant}\r\nConnection: close\r\n\r\n".encode()
    )
    return sock


def test_a_reader_that_falls_behind_is_told_to_reconnect(fleet: Fleet, tmp_path: Path) -> None:
    fast = fleet.replica(
        "lag",
        {"a07-s1": tmp_path / "s1"},
        "--stream-queue-frames",
        "8",
        # One frame per token, as this flood was sized for: coalesced, its text alone fits in
        # the socket buffers and the reader never falls behind.
        "--coalesce-ms",
        "0",
        "--model",
        "stub:ttft=1ms,per_token=0ms,tokens=100000",
        "--turn-max-tokens",
        "200000",
        "--turn-max-tokens-per-call",
        "200000",
    )
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    sock = _raw_sse(fast, sid, grant)
    try:
        with fast.client() as client:
            post(client, sid, grant, {"type": "prompt", "message": "flood"})
            eventually(
                lambda: (
                    not post(client, sid, grant, {"type": "get_state"}).json()["data"]["running"]
                ),
                timeout=30,
            )
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    text = data.decode(errors="replace")
    assert "event: reconnect" in text
    assert text.rstrip().endswith("data: fell too far behind") or "0\r\n\r\n" in text
    assert 'agent_streams_lagged_total{kind="sse"} 1.0' in fast.scrape()


def test_detaching_stops_nothing(fleet: Fleet, replica: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    with replica.client() as client:
        post(client, sid, grant, {"type": "prompt", "message": "keep going"})
        read_events(replica, sid, grant, until='"text_delta"')  # attach, then drop mid-turn
        eventually(
            lambda: post(client, sid, grant, {"type": "get_state"}).json()["data"]["messages"] == 2
        )
        messages: list[dict[str, Any]] = post(client, sid, grant, {"type": "get_messages"}).json()[
            "data"
        ]["messages"]
    assert len(messages[1]["content"].split()) == 30 and messages[1]["stop"] == "stop"
