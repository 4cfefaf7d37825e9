"""Text deltas coalesced by a real replica: the text every reader gets, over WebSocket and SSE,
is exactly the model's, in order, in fewer frames; window 0 is one frame per delta; the size
bound and any other frame send the gathered text at once; a reader attaching mid-turn gets the
coalesced frames replayed and then the rest; a reader that falls behind is still dropped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.harness import Fleet, Replica, agent_url, eventually_async, sse_events
from tests.replica.support import (
    FRAME_WAIT_S,
    kind,
    new_sid,
    settled_messages,
    streamed_text,
    ws_session,
)

pytestmark = pytest.mark.slow
FLEET_DIR = "coalescing"  # the conftest fleet's directory
EVENTS = "/_beyond/agent/events"
TOKENS = 300
# Many deltas, a few ms apart: one per token (tick=0ms), so what is coalesced is the replica's
# doing, not the stub's.
STREAM = f"stub:ttft=0ms,per_token=2ms,tokens={TOKENS},tick=0ms"
TURN_WAIT_S = 60.0  # a loaded machine stretches a streamed turn; the bound is for a hung one


def shard(fleet: Fleet, name: str) -> dict[str, Path]:
    return {"a07-s1": fleet.root / f"shard-{name}"}


@pytest.fixture(scope="module")
def default_window(fleet: Fleet) -> Replica:
    return fleet.replica("co", shard(fleet, "co"), "--model", STREAM)


@pytest.fixture(scope="module")
def held(fleet: Fleet) -> Replica:
    """An instant model behind a window far longer than its turns: text goes out only when the
    size bound or another frame sends it."""
    return fleet.replica(
        "held",
        shard(fleet, "held"),
        "--model",
        "mock",
        "--coalesce-ms",
        "1000",
        "--coalesce-max-chars",
        "64",
    )


class SseReader:
    """The frames of one SSE stream, each read within a bound."""

    def __init__(self, lines: AsyncIterator[str]) -> None:
        self._lines = lines

    async def next(self) -> dict[str, Any]:
        block: list[str] = []
        async with asyncio.timeout(FRAME_WAIT_S):
            async for line in self._lines:
                if line:
                    block.append(line)
                    continue
                parsed = sse_events([*block, ""])
                block = []
                if parsed:  # a keepalive comment alone is no event
                    frame: dict[str, Any] = json.loads(parsed[0]["data"])
                    return frame
        raise AssertionError("the event stream ended")

    async def until(self, done: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        frames: list[dict[str, Any]] = []
        async with asyncio.timeout(TURN_WAIT_S):
            while not frames or not done(frames[-1]):
                frames.append(await self.next())
        return frames


@contextlib.asynccontextmanager
async def sse_reader(
    replica: Replica, sid: str, grant: str
) -> AsyncIterator[tuple[SseReader, dict[str, Any]]]:
    """Attach to a session's event stream; yields the reader and the catch-up frame."""
    async with (
        httpx.AsyncClient(base_url=replica.url, timeout=TURN_WAIT_S) as client,
        client.stream(
            "GET", f"{EVENTS}?session_id={sid}", headers={"x-beyond-grant": grant}
        ) as response,
    ):
        assert response.status_code == 200
        reader = SseReader(response.aiter_lines())
        catchup = await reader.next()
        assert catchup["type"] == "catchup"
        yield reader, catchup


def ended(frame: dict[str, Any]) -> bool:
    return kind(frame) == "turn_ended"


def stream_kinds(frames: list[dict[str, Any]]) -> list[str]:
    """The kinds of a turn's frames as every reader sees them (a prompt's ack is its sender's)."""
    return [kind(f) for f in frames if kind(f) != "ack"]


def texts(frames: list[dict[str, Any]]) -> list[str]:
    return [f["event"]["text"] for f in frames if kind(f) == "text_delta"]


def metric(scrape: str, sample: str) -> float:
    found = re.search(rf"^{re.escape(sample)} (\S+)$", scrape, re.M)
    assert found is not None, sample
    return float(found.group(1))


def text_counters(replica: Replica) -> tuple[float, float]:
    """(text frames published, model deltas they held) since the replica started."""
    scrape = replica.scrape()
    return metric(scrape, "agent_text_frames_total"), metric(scrape, "agent_text_deltas_total")


def counted_since(replica: Replica, before: tuple[float, float]) -> tuple[float, float]:
    frames, deltas = text_counters(replica)
    return frames - before[0], deltas - before[1]


def reply_of(replica: Replica, sid: str, grant: str) -> str:
    with replica.client() as client:
        messages = settled_messages(client, sid, grant, timeout=TURN_WAIT_S)
    assert messages[-1]["role"] == "assistant"
    content: str = messages[-1]["content"]
    return content


def test_websocket_and_sse_readers_get_the_exact_text_in_fewer_frames(
    fleet: Fleet, default_window: Replica
) -> None:
    replica = default_window
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    before = text_counters(replica)

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with sse_reader(replica, sid, grant) as (sse, _):
            async with ws_session(replica, sid, grant) as (ws, _):
                ws_frames = await ws.turn("stream it", wait_s=TURN_WAIT_S)
            return ws_frames, await sse.until(ended)

    ws_frames, sse_frames = asyncio.run(run())
    reply = reply_of(replica, sid, grant)
    frames, deltas = counted_since(replica, before)
    assert len(reply.split()) == TOKENS and deltas == TOKENS  # one delta per token
    assert frames < deltas / 2  # a 25 ms window over deltas 2 ms apart
    for seen in (ws_frames, sse_frames):
        assert streamed_text(seen) == reply
        kinds = stream_kinds(seen)
        assert kinds[:2] == ["turn_started", "committed"]
        assert kinds[-2:] == ["committed", "turn_ended"]
        assert set(kinds[2:-2]) == {"text_delta"}
        # A reader gets each published frame, or fewer when it merged some it had not taken.
        assert len(kinds) - 4 <= frames


def test_window_zero_is_one_frame_per_delta(fleet: Fleet) -> None:
    replica = fleet.replica("zero", shard(fleet, "zero"), "--model", STREAM, "--coalesce-ms", "0")
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    before = text_counters(replica)

    async def run() -> list[dict[str, Any]]:
        async with ws_session(replica, sid, grant) as (ws, _):
            return await ws.turn("one by one", wait_s=TURN_WAIT_S)

    seen = asyncio.run(run())
    reply = reply_of(replica, sid, grant)
    assert streamed_text(seen) == reply and len(reply.split()) == TOKENS
    assert counted_since(replica, before) == (TOKENS, TOKENS)


def test_the_size_bound_sends_the_text_before_the_window_closes(
    fleet: Fleet, held: Replica
) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    before = text_counters(held)

    async def run() -> list[dict[str, Any]]:
        async with ws_session(held, sid, grant) as (ws, _):
            return await ws.turn("words: 200\nfill the page", wait_s=TURN_WAIT_S)

    seen = asyncio.run(run())
    reply = reply_of(held, sid, grant)
    sent = texts(seen)
    assert "".join(sent) == reply and len(reply.split()) == 200
    # The first delta went out at once (nothing had been sent for a window); each frame after
    # it but the last went out on reaching 64 characters, not on the 1 s window: the whole turn
    # took the instant model a few milliseconds.
    assert len(sent[0]) <= 17 and all(len(text) >= 64 for text in sent[1:-1])
    frames, deltas = counted_since(held, before)
    assert deltas == 200 and frames >= len(reply) // (64 + 16)  # a word piece is <= 16 + 1
    kinds = stream_kinds(seen)
    assert kinds[-2:] == ["committed", "turn_ended"] and kinds[-3] == "text_delta"


def test_any_other_frame_sends_the_gathered_text_first(fleet: Fleet, held: Replica) -> None:
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with ws_session(held, sid, grant) as (ws, _):
            return await ws.turn("hold on"), await ws.turn("hangup: 2\nbreak it off")

    plain, broken = asyncio.run(run())
    # Under a 1 s window the first delta goes out at once and the rest are gathered; the turn's
    # own frames send them: the commit of the reply...
    assert stream_kinds(plain) == [
        "turn_started",
        "committed",
        "text_delta",
        "text_delta",
        "committed",
        "turn_ended",
    ]
    assert texts(plain) == ["ok: ", "hold on"]
    # ...and a model error, which comes after the text streamed before it (gathered whole, as
    # the first turn's text went out less than the window before).
    kinds = stream_kinds(broken)
    assert kinds[:2] == ["turn_started", "committed"]
    assert kinds[-3:] == ["error", "committed", "turn_ended"]
    assert set(kinds[2:-3]) == {"text_delta"} and len(kinds[2:-3]) <= 2
    assert streamed_text(broken) == reply_of(held, sid, grant) == "ok: break "


def test_readers_attaching_mid_turn_get_the_coalesced_frames_then_the_rest(
    fleet: Fleet,
) -> None:
    # A turn of about 4 s: long enough that two readers attach while it streams.
    replica = fleet.replica(
        "mid", shard(fleet, "mid"), "--model", "stub:ttft=0ms,per_token=10ms,tokens=400,tick=0ms"
    )
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    Seen = tuple[dict[str, Any], list[dict[str, Any]]]

    async def run() -> tuple[list[dict[str, Any]], Seen, Seen]:
        async with ws_session(replica, sid, grant) as (first, _):
            await first.send({"type": "prompt", "message": "take a while"})
            await first.until(lambda f: kind(f) == "text_delta")  # some text is out
            async with sse_reader(replica, sid, grant) as (sse, sse_catchup):
                async with ws_session(replica, sid, grant) as (late, ws_catchup):
                    late_frames = await late.until(ended, wait_s=TURN_WAIT_S)
                sse_frames = await sse.until(ended)
            await first.until(ended, wait_s=TURN_WAIT_S)
            return first.frames, (sse_catchup, sse_frames), (ws_catchup, late_frames)

    first, *late_readers = asyncio.run(run())
    reply = reply_of(replica, sid, grant)
    assert len(reply.split()) == 400 and streamed_text(first) == reply
    for catchup, rest in late_readers:
        replayed = catchup["turn"]
        assert replayed, "attached after the turn ended"
        assert kind(replayed[0]) == "turn_started" and not catchup["turn_truncated"]
        replayed_text = texts(replayed)
        assert replayed_text, "no text was replayed"
        # The replay holds the frames as sent: several tokens to a frame, not one each.
        assert len("".join(replayed_text).split()) > len(replayed_text)
        assert "".join(replayed_text) + streamed_text(rest) == reply  # nothing lost or twice
        assert stream_kinds(rest)[-2:] == ["committed", "turn_ended"]


def test_a_websocket_reader_that_falls_behind_is_told_to_reconnect(
    fleet: Fleet, tmp_path: Path
) -> None:
    replica = fleet.replica(
        "lag",
        {"a07-s1": tmp_path / "s1"},
        "--stream-queue-frames",
        "4",
        # Each delta sent on reaching the size bound, so the flood outgrows the socket buffers
        # (in 4 KiB frames, 100,000 tokens of text fit in them and nobody falls behind).
        "--coalesce-max-chars",
        "1",
        "--model",
        "stub:ttft=1ms,per_token=0ms,tokens=100000",
        "--turn-max-tokens",
        "200000",
        "--turn-max-tokens-per-call",
        "200000",
    )
    sid = new_sid()
    grant = fleet.grant("acme", sid, sandbox=False)
    host, port = replica.url.removeprefix("http://").split(":")

    async def turn_done() -> bool:
        async with httpx.AsyncClient(base_url=replica.url, timeout=10) as client:
            response = await client.post(
                agent_url(sid), json={"type": "get_state"}, headers={"x-beyond-grant": grant}
            )
        data = response.json()["data"]
        return data["messages"] == 2 and not data["running"]

    async def run() -> tuple[list[dict[str, Any]], int | None]:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a slow, small reader
        sock.connect((host, int(port)))
        sock.setblocking(False)
        url = replica.url.replace("http", "ws", 1) + agent_url(sid)
        frames: list[dict[str, Any]] = []
        async with websockets.connect(
            url,
            sock=sock,
            additional_headers={"x-beyond-grant": grant},
            max_queue=1,
            max_size=None,
            ping_interval=None,  # a reader that reads nothing cannot answer pings either
            open_timeout=FRAME_WAIT_S,
        ) as ws:
            await ws.send(json.dumps({"type": "prompt", "message": "flood"}))
            # Read nothing until the whole reply is committed: the reader falls behind.
            await eventually_async(turn_done, timeout=TURN_WAIT_S, message="the turn did not end")
            with contextlib.suppress(websockets.ConnectionClosed):
                async with asyncio.timeout(TURN_WAIT_S):
                    async for raw in ws:
                        frames.append(json.loads(raw))
            return frames, ws.close_code

    frames, code = asyncio.run(run())
    assert frames[-1] == {"type": "reconnect"} and code == 1013
    assert metric(replica.scrape(), 'agent_streams_lagged_total{kind="ws"}') == 1.0
    # What it was sent before it fell behind is the reply's start, whole and in order.
    assert reply_of(replica, sid, grant).startswith(streamed_text(frames))
