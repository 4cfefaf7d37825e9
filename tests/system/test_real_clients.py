"""Ordinary clients through the edge of a local fleet: ``curl -N`` on the event stream, and a
WebSocket client from the ``websockets`` library, exactly as a person or a program would use them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from fleet_sim.up import LocalFleet
from tests.harness import eventually
from tests.system.support import local_fleet

pytestmark = pytest.mark.slow

MODEL = "stub:ttft=50ms,per_token=20ms,tokens=8"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    with local_fleet(tmp_path_factory.mktemp("clients-fleet"), MODEL) as local:
        yield local


def command(local: LocalFleet, sid: str, grant: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{local.edge.url}/_beyond/agent",
        params={"session_id": sid},
        headers={"x-beyond-grant": grant},
        json=body,
        timeout=10,
    )


def messages(local: LocalFleet, sid: str, grant: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = command(local, sid, grant, {"type": "get_messages"}).json()[
        "data"
    ]["messages"]
    return found


def finished_turns(local: LocalFleet, sid: str, grant: str) -> int:
    return sum(1 for m in messages(local, sid, grant) if m.get("stop"))


class Curl:
    """``curl -N`` on the event stream; a thread hands its lines over as they arrive."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_event(self, within_s: float = 15.0) -> dict[str, str]:
        """The next SSE event (fields joined), skipping comments such as keepalives."""
        deadline = time.monotonic() + within_s
        event: dict[str, str] = {}
        while True:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line is None:
                raise EOFError("curl's stream ended")
            if line == "" and event:
                return event
            if line and not line.startswith(":"):
                name, _, value = line.partition(":")
                event[name] = value.removeprefix(" ")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._thread.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@contextlib.contextmanager
def curl_stream(local: LocalFleet, sid: str, grant: str, *headers: str) -> Iterator[Curl]:
    path = shutil.which("curl")
    if path is None:
        pytest.fail("curl is not installed")
    argv = [path, "-sS", "-N", "-H", f"x-beyond-grant: {grant}"]
    for header in headers:
        argv += ["-H", header]
    curl = Curl([*argv, f"{local.edge.url}/_beyond/agent/events?session_id={sid}"])
    try:
        yield curl
    finally:
        curl.close()


def test_curl_reads_the_catchup_and_live_deltas_and_resumes(fleet: LocalFleet) -> None:
    made = fleet.new_session()
    sid, grant = made["session_id"], made["grant"]
    assert command(fleet, sid, grant, {"type": "prompt", "message": "first"}).status_code == 202
    eventually(lambda: finished_turns(fleet, sid, grant) == 1, timeout=20)
    before = messages(fleet, sid, grant)

    with curl_stream(fleet, sid, grant) as curl:
        catchup = curl.next_event()
        assert catchup["id"] == before[-1]["id"]
        assert [m["id"] for m in json.loads(catchup["data"])["messages"]] == [
            m["id"] for m in before
        ]
        sent = command(fleet, sid, grant, {"type": "prompt", "message": "second\nwords: 12"})
        assert sent.status_code == 202
        deltas: list[str] = []
        ids: list[str] = []
        for _ in range(200):
            event = curl.next_event()
            frame = json.loads(event["data"])
            if "id" in event:
                ids.append(event["id"])
            if frame["type"] == "event" and frame["event"]["kind"] == "text_delta":
                deltas.append(frame["event"]["text"])
            if frame["type"] == "event" and frame["event"]["kind"] == "turn_ended":
                break
    after = messages(fleet, sid, grant)
    assert deltas and "".join(deltas) == after[-1]["content"]
    assert len(after[-1]["content"].split()) == 12
    assert ids[-1] == after[-1]["id"]  # the committed frame's id is the new leaf

    # Resuming from the first turn's leaf: the catch-up holds only the second turn.
    with curl_stream(fleet, sid, grant, f"Last-Event-ID: {before[-1]['id']}") as curl:
        resumed = json.loads(curl.next_event()["data"])
    assert [m["id"] for m in resumed["messages"]] == [m["id"] for m in after[len(before) :]]

    unknown = subprocess.run(
        [
            "curl",
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            f"x-beyond-grant: {grant}",
            "-H",
            "Last-Event-ID: mNoSuchMessage",
            f"{fleet.edge.url}/_beyond/agent/events?session_id={sid}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert unknown.stdout == "409"


async def follow_turn(ws: websockets.ClientConnection) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(20):
        while True:
            frame = json.loads(await ws.recv())
            frames.append(frame)
            if frame["type"] == "event" and frame["event"]["kind"] == "turn_ended":
                return frames


async def websocket_session(edge: str, sid: str, grant: str) -> dict[str, Any]:
    url = f"{edge.replace('http', 'ws', 1)}/_beyond/agent?session_id={sid}"
    headers = {"x-beyond-grant": grant}
    async with (
        websockets.connect(url, additional_headers=headers) as ws,
        websockets.connect(url, additional_headers=headers) as follower,
    ):
        first = json.loads(await ws.recv())
        assert json.loads(await follower.recv())["type"] == "catchup"
        await ws.send(json.dumps({"type": "prompt", "id": "p1", "message": "hi\nrun: echo ws-ok"}))
        own, seen = await asyncio.gather(follow_turn(ws), follow_turn(follower))
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(url):
            pass
    return {"first": first, "own": own, "seen": seen, "refused": refused.value.response}


def test_websocket_client_holds_a_session_through_the_edge(fleet: LocalFleet) -> None:
    made = fleet.new_session()
    sid, grant = made["session_id"], made["grant"]
    got = asyncio.run(websocket_session(fleet.edge.url, sid, grant))

    assert got["first"]["type"] == "catchup" and got["first"]["messages"] == []
    own: list[dict[str, Any]] = got["own"]
    assert own[0] == {"type": "ack", "id": "p1", "command": "prompt"}
    events = [f["event"] for f in own if f["type"] == "event"]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "turn_started" and kinds[-1] == "turn_ended"
    assert events[-1]["outcome"] == "succeeded"
    call = next(e for e in events if e["kind"] == "tool_call")
    assert json.loads(call["arguments"]) == {"command": "echo ws-ok"}
    result = next(e for e in events if e["kind"] == "tool_result")
    assert result["content"].startswith("ws-ok") and not result["is_error"]
    committed = [f["leaf_id"] for f in own if f["type"] == "committed"]
    final = messages(fleet, sid, grant)
    assert committed == [final[0]["id"], final[-1]["id"]]
    reply = "".join(e["text"] for e in events if e["kind"] == "text_delta")
    assert reply == final[-1]["content"]
    # A second client on the same session saw the same turn, without the first one's ack.
    assert [f for f in got["seen"] if f["type"] != "ack"] == [f for f in own if f["type"] != "ack"]
    assert got["refused"].status_code == 401
