from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from replica import protocol
from replica.coalescing import DEFAULT_COALESCING, Coalescing
from replica.live import (
    REPLAY_CAP_BYTES,
    LiveSession,
    LiveState,
    Outgoing,
    SessionContext,
    Subscriber,
    TurnBuffer,
)
from replica.locking import NoLocking
from replica.store import SessionStore
from replica.transcript import Message, UnknownMessage
from tests.harness import eventually_async
from wire.names import parse_session_id

pytestmark = pytest.mark.anyio
T = TypeVar("T")
DEK = bytes(range(32))
SID = parse_session_id("a07-s1.live1")
CONTEXT = SessionContext("http://127.0.0.1:9/exec", (("x-token", "t"),), "/work", DEK)


async def run_io(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


def make_live(
    store: SessionStore,
    superseded: list[LiveSession] | None = None,
    coalescing: Coalescing = DEFAULT_COALESCING,
    text_frames: list[int] | None = None,
) -> LiveSession:
    owned = store.open("acme", SID, DEK)
    sink = superseded if superseded is not None else []
    counted = text_frames if text_frames is not None else []
    return LiveSession(
        "acme",
        SID,
        owned,
        CONTEXT,
        run_io=run_io,
        on_superseded=sink.append,
        coalescing=coalescing,
        on_text_frame=counted.append,
    )


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveSession]:
    session = make_live(SessionStore(tmp_path))
    yield session
    session.owned.release()


def msg(tag: str, role: str = "user") -> Message:
    return Message(tag, None, role, f"text {tag}", 1.0)


def drain(subscriber: Subscriber) -> list[dict[str, Any]]:
    out = [json.loads(item.text) for item in subscriber.queue]
    subscriber.queue.clear()
    return out


async def next_within(subscriber: Subscriber) -> Outgoing | None:
    async with asyncio.timeout(1.0):
        return await subscriber.next()


async def test_subscriber_overflow_lags_and_ends() -> None:
    sub = Subscriber("ws", limit=3)
    for i in range(3):
        sub.offer(Outgoing(f"f{i}"))
    assert not sub.lagged and len(sub.queue) == 3
    sub.offer(Outgoing("f3"))
    # Too far behind: what it had is dropped, and it must reconnect and catch up instead.
    assert sub.lagged and not sub.queue
    sub.offer(Outgoing("f4"))
    assert not sub.queue
    assert await next_within(sub) is None
    assert await next_within(sub) is None


async def test_subscriber_waits_for_frames_and_drains_before_closing() -> None:
    sub = Subscriber("sse")
    waiter = asyncio.create_task(next_within(sub))
    await eventually_async(lambda: sub.parked, timeout=1.0, message="the reader never waited")
    assert not waiter.done()
    sub.offer(Outgoing("a", "m1"))
    assert await waiter == Outgoing("a", "m1")
    sub.offer(Outgoing("b"))
    sub.offer(Outgoing("c"))
    sub.close()
    sub.offer(Outgoing("after close"))
    assert [(await next_within(sub)) for _ in range(3)] == [Outgoing("b"), Outgoing("c"), None]
    blocked = Subscriber("ws")
    pending = asyncio.create_task(next_within(blocked))
    await eventually_async(lambda: blocked.parked, timeout=1.0, message="the reader never waited")
    blocked.close()  # a reader parked in next() wakes up to the close
    assert await pending is None


async def test_a_waiting_writer_s_frames_are_written_at_once_and_the_rest_queued() -> None:
    written: list[str] = []
    socket_open = True

    def send_now(item: Outgoing) -> bool:
        if socket_open:
            written.append(item.text)
        return socket_open

    sub = Subscriber("ws")
    sub.direct = send_now
    sub.offer(Outgoing("catchup"))  # no writer waiting yet: queued
    assert written == [] and len(sub.queue) == 1
    assert await next_within(sub) == Outgoing("catchup")
    waiter = asyncio.create_task(next_within(sub))
    await eventually_async(lambda: sub.parked, timeout=1.0, message="the reader never waited")
    sub.offer(Outgoing("a"))
    sub.offer(Outgoing("b"))
    # Straight to the socket while the writer waits with nothing queued; it keeps waiting.
    assert written == ["a", "b"] and not sub.queue and not waiter.done()
    socket_open = False  # the socket cannot take a frame now (flow control, closing)
    sub.offer(Outgoing("c"))
    sub.offer(Outgoing("d"))  # behind a queued frame: queued too, in order
    assert await waiter == Outgoing("c") and await next_within(sub) == Outgoing("d")
    socket_open = True
    sub.offer(Outgoing("e"))  # the writer is not waiting in next(): queued, never overtaking
    assert written == ["a", "b"] and [i.text for i in sub.queue] == ["e"]


def test_turn_buffer_stops_at_the_cap() -> None:
    buffer = TurnBuffer("r1")
    chunk = "x" * (1024 * 1024)
    for i in range(4):
        buffer.record({"i": i}, chunk)
    assert buffer.size == REPLAY_CAP_BYTES == 4 * 1024 * 1024 and not buffer.truncated
    buffer.record({"i": 4}, "y")
    assert buffer.truncated and len(buffer.frames) == 4
    buffer.record({"i": 5}, "")  # once truncated, nothing more, not even an empty frame
    assert [f["i"] for f in buffer.frames] == [0, 1, 2, 3] and buffer.size == REPLAY_CAP_BYTES


def test_turn_buffer_cap_is_in_bytes() -> None:
    buffer = TurnBuffer("r1")
    text = protocol.dumps(protocol.event("text_delta", text="é" * (1024 * 1024)))
    for _ in range(3):
        buffer.record({}, text)  # 3 MiB of characters, 6 MiB of UTF-8
    assert buffer.truncated


async def test_publish_serialises_once_and_ids_committed_frames(
    live: LiveSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    real = protocol.dumps

    def counting(frame: Any) -> str:
        calls.append(frame)
        return real(frame)

    monkeypatch.setattr(protocol, "dumps", counting)
    readers = [live.attach("ws"), live.attach("sse"), live.attach("sse")]
    live.turn = TurnBuffer("r1")
    delta = protocol.event("text_delta", run_id="r1", text="hé")
    live.publish(delta)
    live.publish(protocol.committed("m9"))
    assert len(calls) == 2
    first, second = readers[0].queue
    assert all(r.queue[0] is first and r.queue[1] is second for r in readers)
    assert (first.text, first.event_id) == (real(delta), None)
    assert second.event_id == "m9" and json.loads(second.text)["leaf_id"] == "m9"
    # The turn keeps stream frames for replay; commits are the transcript's, not the turn's.
    assert live.turn.frames == [delta]


async def test_a_lagging_reader_does_not_hold_back_the_others(live: LiveSession) -> None:
    slow, fast = Subscriber("ws", limit=2), live.attach("ws")
    live.subscribers.add(slow)
    for i in range(5):
        live.publish(protocol.event("tool_call", run_id="r1", id=f"c{i}", name="bash"))
    assert slow.lagged and not fast.lagged and len(fast.queue) == 5


async def test_commit_publishes_and_catchup_resumes(live: LiveSession) -> None:
    reader = live.attach("sse")
    first = await live.commit([msg("m1"), msg("m2", "assistant")])
    assert first is not None and first.leaf_id == "m2"
    second = await live.commit([msg("m3")])
    assert second is not None and second.leaf_id == "m3"
    assert [f["leaf_id"] for f in drain(reader)] == ["m2", "m3"]
    everything = live.catchup(None)
    assert [m["id"] for m in everything["messages"]] == ["m1", "m2", "m3"]
    assert everything["messages"][1]["parent_id"] == "m1"
    assert everything["leaf_id"] == "m3" and everything["turn"] == []
    assert everything["turn_truncated"] is False
    assert [m["id"] for m in live.catchup("m1")["messages"]] == ["m2", "m3"]
    assert live.catchup("m3")["messages"] == []
    with pytest.raises(UnknownMessage):
        live.catchup("m404")
    # A reader attaching mid-turn gets the turn replayed from its start.
    live.turn = TurnBuffer("r2")
    live.publish(protocol.event("turn_started", run_id="r2"))
    live.publish(protocol.event("text_delta", run_id="r2", text="par"))
    live.turn.truncated = True
    mid = live.catchup("m2")
    assert [f["event"]["kind"] for f in mid["turn"]] == ["turn_started", "text_delta"]
    assert mid["turn_truncated"] is True and [m["id"] for m in mid["messages"]] == ["m3"]
    assert mid == protocol.catchup(mid["messages"], "m3", mid["turn"], True)


async def test_a_fenced_commit_supersedes_the_session(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, locker=NoLocking())
    superseded: list[LiveSession] = []
    live = make_live(store, superseded)
    try:
        reader = live.attach("ws")
        turn = asyncio.create_task(asyncio.sleep(10))
        live.turn_task = turn
        successor = store.open("acme", SID, DEK)  # a new owner took the session
        successor.release()
        assert await live.commit([msg("m1")]) is None
        assert live.state is LiveState.SUPERSEDED and superseded == [live]
        frames = drain(reader)
        assert frames == [protocol.superseded("a07-s1.live1")]
        assert reader.closed and await next_within(reader) is None
        await asyncio.wait({turn}, timeout=1.0)  # the supersede cancelled it: let it end
        assert turn.cancelled()
        assert await live.commit([msg("m2")]) is None
        live.supersede()
        assert superseded == [live]  # said once
        assert store.read("acme", SID, DEK).transcript.messages == []
    finally:
        live.owned.release()


async def test_attachment_and_reapability(live: LiveSession) -> None:
    now = time.monotonic()
    live.idle_since = now - 100
    assert live.attached == 0 and live.reapable(now, 60)
    assert not live.reapable(now, 101)
    reader = live.attach("ws")
    assert live.attached == 1 and not live.reapable(now, 60)
    live.detach(reader)
    assert reader.closed and live.attached == 0
    assert not live.reapable(time.monotonic(), 60)  # detaching restarts the idle clock
    live.hold()
    assert live.attached == 1
    live.unhold()
    live.idle_since = now - 100
    live.turn_task = asyncio.create_task(asyncio.sleep(10))
    assert live.running and not live.reapable(now, 60)
    live.turn_task.cancel()
    await asyncio.wait({live.turn_task}, timeout=1.0)
    assert not live.running and live.reapable(now, 60)
    live.state = LiveState.CLOSING
    assert not live.reapable(now, 60)


# -- coalescing of text deltas -------------------------------------------------------------------

# A window that never closes within a test: only the rule under test sends the text.
LONG_WINDOW = Coalescing(window_s=60.0)


def opened(live: LiveSession, counted: list[int]) -> LiveSession:
    """The session with its window just opened: a first delta (which goes out at once, to no
    reader yet) was sent, so the next ones are gathered."""
    live.publish_delta("r0", "opening ")
    assert counted == [1] and live._flush_timer is None
    counted.clear()
    return live


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[LiveSession, list[int]]]:
    counted: list[int] = []
    session = make_live(SessionStore(tmp_path), coalescing=LONG_WINDOW, text_frames=counted)
    yield opened(session, counted), counted
    session.owned.release()


def texts(frames: list[dict[str, Any]]) -> list[str]:
    return [f["event"]["text"] for f in frames if f["type"] == "event" and "text" in f["event"]]


def delta(text: str, run_id: str = "r1") -> dict[str, Any]:
    return protocol.event("text_delta", run_id=run_id, text=text)


async def test_a_window_of_deltas_is_one_frame_on_one_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted: list[int] = []
    live = make_live(SessionStore(tmp_path), coalescing=Coalescing(0.01), text_frames=counted)
    try:
        loop = asyncio.get_running_loop()
        armed: list[float] = []
        real = loop.call_later

        def counting(delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
            if callback == live.flush_text:  # the polling below sleeps on timers too
                armed.append(delay)
            return real(delay, callback, *args)

        monkeypatch.setattr(loop, "call_later", counting)
        reader = live.attach("ws")
        live.turn = TurnBuffer("r1")
        # The first delta of a reply goes out at once, on no timer.
        live.publish_delta("r1", "zero ")
        assert drain(reader) == [delta("zero ")] and counted == [1] and armed == []
        for piece in ("one ", "two ", "three"):
            live.publish_delta("r1", piece)
        # Gathered, on one timer for the end of the window the first frame opened.
        assert not reader.queue and len(armed) == 1 and 0 <= armed[0] <= 0.01
        await eventually_async(lambda: reader.queue, timeout=5.0, interval=0.005)
        assert drain(reader) == [delta("one two three")] and counted == [1, 3]
        # The replay holds what was sent.
        assert live.turn.frames == [delta("zero "), delta("one two three")]
        live.publish_delta("r1", "four")  # within the next window: the next timer
        assert len(armed) == 2
        await eventually_async(lambda: reader.queue, timeout=5.0, interval=0.005)
        assert drain(reader) == [delta("four")] and counted == [1, 3, 1]
    finally:
        live.owned.release()


async def test_any_other_frame_sends_the_gathered_text_first(
    held: tuple[LiveSession, list[int]],
) -> None:
    live, counted = held
    reader = live.attach("sse")
    live.publish_delta("r1", "let me ")
    live.publish_delta("r1", "look")
    call = protocol.event("tool_call", run_id="r1", id="c1", name="bash", arguments="{}")
    live.publish(call)
    live.publish_delta("r1", "found it")
    live.publish(protocol.committed("m2"))
    live.publish_delta("r1", "bye")
    live.publish(protocol.event("turn_ended", run_id="r1", outcome="succeeded", reason="stop"))
    assert drain(reader) == [
        delta("let me look"),
        call,
        delta("found it"),
        protocol.committed("m2"),
        delta("bye"),
        protocol.event("turn_ended", run_id="r1", outcome="succeeded", reason="stop"),
    ]
    assert counted == [2, 1, 1] and live._flush_timer is None  # no timer left behind


async def test_the_size_bound_sends_before_the_window_closes(tmp_path: Path) -> None:
    counted: list[int] = []
    bounded = Coalescing(window_s=60.0, max_chars=8)
    live = make_live(SessionStore(tmp_path), coalescing=bounded, text_frames=counted)
    opened(live, counted)
    try:
        reader = live.attach("ws")
        live.publish_delta("r1", "abcd")
        assert not reader.queue and live._flush_timer is not None
        live.publish_delta("r1", "efgh")
        assert drain(reader) == [delta("abcdefgh")] and counted == [2]
        assert live._flush_timer is None  # the flush took the window's timer with it
    finally:
        live.owned.release()


async def test_window_zero_is_one_frame_per_delta_as_before(tmp_path: Path) -> None:
    counted: list[int] = []
    live = make_live(SessionStore(tmp_path), coalescing=Coalescing(0.0), text_frames=counted)
    try:
        reader = Subscriber("ws", limit=100)
        live.subscribers.add(reader)
        live.turn = TurnBuffer("r1")
        for piece in ("a", "b", "c"):
            live.publish_delta("r1", piece)
        # The reader's queue merges deltas it has not taken, as it always has; the replay and
        # the count show one frame per delta.
        assert live.turn.frames == [delta("a"), delta("b"), delta("c")] and counted == [1, 1, 1]
        assert live._flush_timer is None
    finally:
        live.owned.release()


async def test_a_reader_attaching_mid_window_gets_the_gathered_text_after_its_catchup(
    held: tuple[LiveSession, list[int]],
) -> None:
    live, _ = held
    early = live.attach("ws")
    live.turn = TurnBuffer("r1")
    live.publish(protocol.event("turn_started", run_id="r1"))
    live.publish_delta("r1", "sent ")
    live.publish(protocol.event("tool_result", run_id="r1", id="c1", content="x", is_error=False))
    live.publish_delta("r1", "gathered ")
    catchup = live.catchup(None)  # taken as a reader attaches, in the same step
    late = live.attach("sse")
    live.publish_delta("r1", "and more")
    live.publish(protocol.event("turn_ended", run_id="r1", outcome="succeeded", reason="stop"))
    assert texts(catchup["turn"]) == ["sent "]  # the replay holds only frames already sent
    assert "".join(texts(catchup["turn"]) + texts(drain(late))) == "sent gathered and more"
    assert "".join(texts(drain(early))) == "sent gathered and more"


async def test_closing_the_readers_sends_the_gathered_text_first(
    held: tuple[LiveSession, list[int]],
) -> None:
    live, _ = held
    reader = live.attach("ws")
    live.publish_delta("r1", "last words")
    live.close_readers()
    sent = await next_within(reader)
    assert sent is not None and json.loads(sent.text) == delta("last words")
    assert await next_within(reader) is None


async def test_superseded_comes_after_the_gathered_text(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, locker=NoLocking())
    counted: list[int] = []
    live = opened(make_live(store, coalescing=LONG_WINDOW, text_frames=counted), counted)
    try:
        reader = live.attach("ws")
        live.publish_delta("r1", "half a")
        live.supersede()
        assert drain(reader) == [delta("half a"), protocol.superseded("a07-s1.live1")]
        assert live._flush_timer is None
    finally:
        live.owned.release()


async def test_a_lagging_reader_is_dropped_as_before_when_frames_are_coalesced(
    held: tuple[LiveSession, list[int]],
) -> None:
    live, _ = held
    slow, fast = Subscriber("ws", limit=2), live.attach("ws")
    live.subscribers.add(slow)
    for i in range(3):
        live.publish_delta("r1", f"text {i}")
        live.publish(protocol.event("tool_call", run_id="r1", id=f"c{i}", name="bash"))
    assert slow.lagged and not slow.queue and await next_within(slow) is None
    assert not fast.lagged and len(fast.queue) == 6
