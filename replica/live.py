"""A live session: the owned store session plus everyone watching it.

Frames fan out to subscribers (WebSocket connections and SSE streams) through bounded per-reader
queues; a reader that falls too far behind is dropped with a ``reconnect`` rather than allowed to
grow memory. The frames of the turn in flight are kept (up to 4 MiB) so a reader that attaches
mid-turn gets the turn replayed from its start. Each frame is serialised once, whoever reads it.

A turn's text deltas are gathered (``replica.coalescing``) and published as one frame when the
session's window closes, when the text reaches its size bound, or before any other frame; the
replay keeps the frames as published, so a late reader sees what the others saw.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from replica import protocol
from replica.coalescing import DEFAULT_COALESCING, Coalescer, Coalescing, Gathered
from replica.errors import LockLost
from replica.store import Committed, OwnedSession, Superseded
from replica.transcript import Message
from wire.names import SessionId

REPLAY_CAP_BYTES = 4 * 1024 * 1024
SUBSCRIBER_QUEUE_FRAMES = 2048


MERGED_DELTA_CHARS = 4096


@dataclass(frozen=True, slots=True)
class Outgoing:
    text: str
    event_id: str | None = None  # set on committed frames: the SSE id
    delta: tuple[str, str] | None = None  # (run id, text) of a text_delta, which may be merged


def _merge(queued: Outgoing, item: Outgoing) -> Outgoing | None:
    """Two text deltas of one run that no reader has taken yet travel as one frame: a reader
    that is a little behind catches up in fewer, larger frames, and the order never changes."""
    if queued.delta is None or item.delta is None or queued.delta[0] != item.delta[0]:
        return None
    text = queued.delta[1] + item.delta[1]
    if len(text) > MERGED_DELTA_CHARS:
        return None
    return Outgoing(protocol.text_delta_json(item.delta[0], text), None, (item.delta[0], text))


class Subscriber:
    """One reader's bounded queue. Overflow marks it lagged: it gets ``reconnect`` and is closed.

    A reader whose connection can take a frame at once (``direct``: a WebSocket's or an event
    stream's send_now, given the frame) gets it written as it is offered, while its writer
    waits in ``next()`` with nothing queued: so nothing sent earlier is still on its way, and
    the order holds. Anything else (a frame the socket cannot take now, or one offered while
    the writer is busy) is queued."""

    __slots__ = ("_event", "_limit", "closed", "direct", "kind", "lagged", "parked", "queue")

    def __init__(self, kind: str, limit: int = SUBSCRIBER_QUEUE_FRAMES) -> None:
        self.kind = kind
        self.queue: deque[Outgoing] = deque()
        self._limit = limit
        self._event = asyncio.Event()
        self.lagged = False
        self.closed = False
        self.parked = False  # a reader waits in next() for a frame or the end
        self.direct: Callable[[Outgoing], bool] | None = None

    def offer(self, item: Outgoing) -> None:
        if self.closed or self.lagged:
            return
        if self.parked and not self.queue and self.direct is not None and self.direct(item):
            return
        merged = _merge(self.queue[-1], item) if self.queue else None
        if merged is not None:
            self.queue[-1] = merged
        elif len(self.queue) >= self._limit:
            self.lagged = True
            self.queue.clear()
        else:
            self.queue.append(item)
        self._event.set()

    def close(self) -> None:
        self.closed = True
        self._event.set()

    def shed(self) -> None:
        """Tell the reader to reconnect now (as if it had fallen behind)."""
        self.lagged = True
        self.queue.clear()
        self._event.set()

    async def next(self) -> Outgoing | None:
        """The next frame, or None once the reader lagged or the session closed it."""
        while not self.queue:
            if self.lagged or self.closed:
                return None
            self._event.clear()
            self.parked = True
            try:
                await self._event.wait()
            finally:
                self.parked = False
        return self.queue.popleft()


@dataclass(slots=True)
class TurnBuffer:
    """The frames of the turn in flight, for replay to late readers; capped, with a flag."""

    run_id: str
    frames: list[Any] = field(default_factory=list)
    size: int = 0
    truncated: bool = False

    def record(self, frame: dict[str, Any], text: str) -> None:
        if self.truncated:
            return
        size = len(text) if text.isascii() else len(text.encode())
        if self.size + size > REPLAY_CAP_BYTES:
            self.truncated = True
            return
        self.frames.append(frame)
        self.size += size


class LiveState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    SUPERSEDED = "superseded"


@dataclass(slots=True)
class SessionContext:
    """What the latest grant says about the session's sandbox; refreshed on each attach."""

    exec_url: str
    exec_headers: tuple[tuple[str, str], ...] = field(repr=False)
    workspace_root: str
    dek: bytes = field(repr=False)


class LiveSession:
    def __init__(
        self,
        tenant: str,
        session: SessionId,
        owned: OwnedSession,
        context: SessionContext,
        *,
        run_io: Callable[..., Any],
        on_superseded: Callable[[LiveSession], None],
        queue_frames: int = SUBSCRIBER_QUEUE_FRAMES,
        coalescing: Coalescing = DEFAULT_COALESCING,
        on_text_frame: Callable[[int], None] = lambda deltas: None,
    ) -> None:
        self.tenant = tenant
        self.session = session
        self.session_id = str(session)
        self.owned = owned
        self.context = context
        self.state = LiveState.OPEN
        self.subscribers: set[Subscriber] = set()
        self.holds = 0  # POST commands in progress count as attachments
        self.idle_since = time.monotonic()
        self.turn: TurnBuffer | None = None
        self.turn_task: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()  # serialises commits and conversation changes
        # The agent's converted copy of the transcript: (resets, messages converted, chat).
        self.chat_cache: tuple[int, int, list[Any]] | None = None
        self.reconciler: Any = None  # replica.jobs.Reconciler, made on first use
        self.last_outcome: str | None = None  # how the latest run ended
        self._run_io = run_io
        self._queue_frames = queue_frames
        self._on_superseded = on_superseded
        self._coalescing = coalescing
        self._coalescer = Coalescer(coalescing.max_chars, coalescing.window_s)
        # Armed while text is gathered, for the end of the window since the last text frame;
        # cancelled by any flush: at most one timer per window, never one per token, and none
        # at all for a model whose deltas come no more often than a window.
        self._flush_timer: asyncio.TimerHandle | None = None
        self._on_text_frame = on_text_frame

    # -- attachment -------------------------------------------------------------------------

    @property
    def attached(self) -> int:
        return len(self.subscribers) + self.holds

    @property
    def running(self) -> bool:
        return self.turn_task is not None and not self.turn_task.done()

    def attach(self, kind: str) -> Subscriber:
        subscriber = Subscriber(kind, self._queue_frames)
        self.subscribers.add(subscriber)
        return subscriber

    def detach(self, subscriber: Subscriber) -> None:
        subscriber.close()
        self.subscribers.discard(subscriber)
        self.touch()

    def hold(self) -> None:
        self.holds += 1

    def unhold(self) -> None:
        self.holds -= 1
        self.touch()

    def touch(self) -> None:
        self.idle_since = time.monotonic()

    def reapable(self, now: float, idle_timeout: float) -> bool:
        return (
            self.state is LiveState.OPEN
            and self.attached == 0
            and not self.running
            and now - self.idle_since >= idle_timeout
        )

    # -- frames -----------------------------------------------------------------------------

    def publish(self, frame: dict[str, Any]) -> None:
        """Send a frame to every reader, after the text gathered before it."""
        if self._coalescer.pending:
            self.flush_text()
        self._send(frame)

    def publish_delta(self, run_id: str, text: str) -> None:
        """A model's text delta: sent at once when coalescing is off or the session's window
        has closed since its last text frame, else gathered until it does."""
        if not self._coalescing.enabled:
            self._send_text(Gathered(run_id, text, 1))
            return
        now = time.monotonic()
        due = self._coalescer.append(run_id, text, now)
        if due:
            self._cancel_timer()  # the window now runs from this frame
            for gathered in due:
                self._send_text(gathered)
        due_at = self._coalescer.due_at
        if due_at is not None and self._flush_timer is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(max(0.0, due_at - now), self.flush_text)

    def flush_text(self) -> None:
        """Send the gathered text now: its window closed, or another frame must follow it."""
        self._cancel_timer()
        gathered = self._coalescer.flush(time.monotonic())
        if gathered is not None:
            self._send_text(gathered)

    def _cancel_timer(self) -> None:
        timer, self._flush_timer = self._flush_timer, None
        if timer is not None:
            timer.cancel()

    def _send_text(self, gathered: Gathered) -> None:
        self._on_text_frame(gathered.deltas)
        run_id, text = gathered.run_id, gathered.text
        frame = protocol.event("text_delta", run_id=run_id, text=text)
        self._fan_out(frame, protocol.text_delta_json(run_id, text), None, (run_id, text))

    def _send(self, frame: dict[str, Any]) -> None:
        event_id = frame["leaf_id"] if frame["type"] == "committed" else None
        self._fan_out(frame, protocol.dumps(frame), event_id, None)

    def _fan_out(
        self,
        frame: dict[str, Any],
        text: str,
        event_id: str | None,
        delta: tuple[str, str] | None,
    ) -> None:
        """Record the frame for replay (unless it is ``committed``, which ends nothing a late
        reader must see again) and offer it, serialised once, to every reader."""
        if self.turn is not None and frame["type"] != "committed":
            self.turn.record(frame, text)
        item = Outgoing(text, event_id, delta)
        for subscriber in self.subscribers:
            subscriber.offer(item)

    def catchup(self, since: str | None) -> dict[str, Any]:
        """The committed transcript (after ``since``) and the turn in flight, replayed from its
        start. Raises ``transcript.UnknownMessage`` for an id the session does not have."""
        transcript = self.owned.transcript
        messages = [m.to_wire() for m in transcript.since(since)]
        turn = self.turn
        return protocol.catchup(
            messages,
            transcript.leaf_id,
            list(turn.frames) if turn else [],
            turn.truncated if turn else False,
        )

    # -- durability -------------------------------------------------------------------------

    async def commit(self, batch: Sequence[Message]) -> Committed | None:
        """Commit a batch off the event loop; publish ``committed`` or handle being fenced.
        Returns None when this replica no longer owns the session."""
        if self.state is not LiveState.OPEN and self.state is not LiveState.CLOSING:
            return None
        async with self.lock:
            try:
                outcome = await self._run_io(self.owned.commit, list(batch))
            except LockLost:
                outcome = None
        return self._after(outcome)

    async def reset(
        self, archived_to: str | None, closed_jobs: Sequence[str] = ()
    ) -> Committed | None:
        async with self.lock:
            try:
                outcome = await self._run_io(self.owned.reset, archived_to, list(closed_jobs))
            except LockLost:
                outcome = None
        return self._after(outcome)

    def _after(self, outcome: Committed | Superseded | None) -> Committed | None:
        # None: the storage failed under us (EIO on a descriptor after a lapsed lease). Whether
        # or not a successor exists yet, this replica can no longer vouch for the session.
        if outcome is None or isinstance(outcome, Superseded):
            self.supersede()
            return None
        self.publish(protocol.committed(outcome.leaf_id))
        return outcome

    def supersede(self) -> None:
        """Another owner has taken the session: say so to every reader and stop."""
        if self.state is LiveState.SUPERSEDED:
            return
        self.state = LiveState.SUPERSEDED
        self.publish(protocol.superseded(self.session_id))
        for subscriber in self.subscribers:
            subscriber.close()
        if self.turn_task is not None and self.turn_task is not asyncio.current_task():
            self.turn_task.cancel()
        self._on_superseded(self)

    def close_readers(self) -> None:
        self.flush_text()  # queued frames still reach a closed reader; gathered text must too
        for subscriber in list(self.subscribers):
            subscriber.close()
