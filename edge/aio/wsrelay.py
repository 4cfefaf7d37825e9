"""A WebSocket session relayed as bytes, by protocol callbacks, once both sides are upgraded.

Once the client and the replica have both completed their handshakes, the relay takes both
transports over (``transport.set_protocol``) and copies what each side sends to the other as it
arrives: one ``write`` per chunk read, no task, no message decoded. Frames pass unchanged, so
client frames stay masked on their way to the replica, replica frames stay unmasked, and pings
and pongs go through like any other frame. A :class:`edge.core.wsframes.FrameTracker` follows the
frame headers of each direction to know where frames end (the edge's own close frames go only
between two frames), to read close frames and to hold client messages to the edge's limit.

Backpressure is the transports' own: when a side's write buffer passes its high-water mark its
transport calls ``pause_writing``, and the relay stops reading the other side until
``resume_writing``; the edge holds at most a write buffer and a read per direction.

Closing, as the edge did when it relayed messages:

* a close frame from one side goes to the other with its code and reason (a code that may not
  be sent is mapped by :func:`edge.core.wsframes.sendable_close_code`: 1000 from a client,
  1011 from a replica); the first side's close is answered, with the same code, once the other
  side has answered (or has gone, or the close time is up);
* a client that vanishes closes the replica with 1001; a replica that vanishes closes the client
  with 1011 "the replica connection was lost". Either needs the relay to be between two frames
  in that direction: a side that vanishes in the middle of a frame leaves no clean way to end
  the other side's half-received frame, so that side's connection is aborted instead;
* a client message over the limit closes the client with 1009 and the replica with 1001; a
  frame the tracker cannot read (:class:`edge.core.wsframes.Stop`) closes its sender with 1002;
* :meth:`Relay.shut_down` (the edge draining) closes both with 1001 "the edge is going away",
  each as soon as the frame in flight towards it has ended.

A relay that has begun closing gets :data:`CLOSE_TIMEOUT_S` to finish: then a side still owed the
answer to its close gets it, both connections close, and whatever has not closed
:data:`LAST_WRITE_S` later is aborted. :attr:`Relay.finished` is done once both connections are.
"""

from __future__ import annotations

import asyncio
import enum
import os
from typing import Final

from edge.core.wsframes import (
    FrameTracker,
    Stop,
    close_frame,
    sendable_close_code,
)

CLOSE_TIMEOUT_S: Final = 5.0
# After the close time, what a connection still has to write gets this long to go out.
LAST_WRITE_S: Final = 1.0

Close = tuple[int, bytes]
CLIENT_GONE: Final[Close] = (1001, b"")
REPLICA_GONE: Final[Close] = (1011, b"the replica connection was lost")
REPLICA_BROKE: Final[Close] = (1011, b"the replica broke the WebSocket protocol")
GOING_AWAY: Final[Close] = (1001, b"the edge is going away")
TOO_BIG: Final[Close] = (1009, b"message too big")
PROTOCOL_ERROR: Final[Close] = (1002, b"protocol error")


class State(enum.Enum):
    OPEN = enum.auto()  # bytes go on
    ENDING = enum.auto()  # the frame in flight goes on, then the edge's close frame
    SEALED = enum.auto()  # the sink has the edge's close (or is gone): the source's close awaited
    DONE = enum.auto()  # the source's close arrived, or the source is gone: nothing more read


class Side(asyncio.Protocol):
    """One of the relay's two connections, as the protocol of its transport."""

    __slots__ = ("gone", "into", "masks", "name", "out", "paused", "relay", "transport")

    def __init__(
        self, relay: Relay, name: str, transport: asyncio.Transport, *, masks: bool
    ) -> None:
        self.relay = relay
        self.name = name
        self.transport = transport
        self.masks = masks  # frames the edge writes to this side are masked (it is the server)
        self.out: Flow  # from this side
        self.into: Flow  # to this side
        self.paused = False
        self.gone = False

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        flow = self.out
        if flow.state is State.OPEN:
            tracker = flow.tracker
            data = tracker.feed(data)
            if data:
                flow.sink.transport.write(data)
            if tracker.stopped is not None:
                self.relay.stopped(flow)
        else:
            flow.closing_bytes(data)

    def eof_received(self) -> bool:
        # A half-close ends the side: its transport closes, and connection_lost follows.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.gone:
            self.gone = True
            self.relay.lost(self)

    def pause_writing(self) -> None:
        flow = self.into
        if flow.state is State.OPEN or flow.state is State.ENDING:
            flow.source.pause()

    def resume_writing(self) -> None:
        self.into.source.resume()

    # --- for the relay -------------------------------------------------------------------------

    def pause(self) -> None:
        if not self.paused and not self.gone:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.gone:
            self.paused = False
            self.transport.resume_reading()

    def write_close(self, close: Close) -> None:
        if not self.gone:
            mask = os.urandom(4) if self.masks else None
            self.transport.write(close_frame(close[0], close[1], mask))

    def abort(self) -> None:
        if not self.gone:
            self.transport.abort()


class Flow:
    """One direction of the session: the bytes from ``source`` to ``sink``."""

    __slots__ = ("answer", "fallback", "other", "pending", "sink", "source", "state", "tracker")

    def __init__(self, source: Side, sink: Side, tracker: FrameTracker, fallback: int) -> None:
        self.source = source
        self.sink = sink
        self.tracker = tracker
        self.fallback = fallback  # replaces a close code from the source that may not be sent
        self.state = State.OPEN
        self.pending: Close | None = None  # the edge's close, once the frame in flight ends
        # The edge's close to the sink when the source's close arrives, instead of the source's
        # own: the echo owed to the sink for a close it began.
        self.answer: Close | None = None
        self.other: Flow

    def seal(self, close: Close) -> None:
        """Send the sink the edge's close as soon as it is between two frames."""
        if self.state is not State.OPEN:
            return
        if self.sink.gone or self.tracker.between_frames:
            self.sink.write_close(close)
            self._sealed()
        else:
            self.state = State.ENDING
            self.pending = close

    def closing_bytes(self, data: bytes) -> None:
        """What the source sends once the flow is no longer simply open."""
        tracker = self.tracker
        if self.state is State.ENDING:
            rest = tracker.rest_of_frame(data)
            if rest:
                self.sink.transport.write(rest)
            if not tracker.between_frames:
                return
            assert self.pending is not None
            self.sink.write_close(self.pending)
            self._sealed()
            data = data[len(rest) :]
            if not data:
                return
        if self.state is State.SEALED:
            # Nothing goes on; the frames are followed only to see the source's close.
            tracker.feed(data)
            if tracker.stopped is not None:
                self.state = State.DONE
                self.source.relay.check()

    def _sealed(self) -> None:
        self.state = State.SEALED
        self.pending = None
        self.source.resume()  # its bytes no longer wait for the sink: read on, for its close


class Relay:
    """The byte relay of one WebSocket session. Make it, :meth:`start` it, await
    :attr:`finished`; :meth:`shut_down` closes it from the edge's side."""

    def __init__(
        self,
        client: asyncio.Transport,
        replica: asyncio.Transport,
        *,
        message_limit: int,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.client = Side(self, "client", client, masks=False)
        self.replica = Side(self, "replica", replica, masks=True)
        self.up = Flow(self.client, self.replica, FrameTracker(message_limit), fallback=1000)
        self.down = Flow(self.replica, self.client, FrameTracker(), fallback=1011)
        self.up.other, self.down.other = self.down, self.up
        self.client.out = self.replica.into = self.up
        self.replica.out = self.client.into = self.down
        self.finished: asyncio.Future[None] = self._loop.create_future()
        self.closing = False
        self._close_timeout_s = close_timeout_s
        self._deadline: asyncio.TimerHandle | None = None

    def start(self, *, client_tail: bytes, replica_tail: bytes, replica_lost: bool) -> None:
        """Take both transports over. ``client_tail`` and ``replica_tail`` are what each side
        sent past its handshake before the relay had its transport; they go first, in order.
        ``replica_lost``: the replica's connection ended before the relay took it."""
        client, replica = self.client, self.replica
        client.transport.set_protocol(client)
        replica.transport.set_protocol(replica)
        if replica_tail:
            replica.data_received(replica_tail)
        if client_tail:
            client.data_received(client_tail)
        if replica_lost:
            replica.connection_lost(None)
        elif not replica.gone and not replica.paused:
            # Paused since its 101 (edge.upstream.wsconnect), unless the client is already
            # behind with what it sent since.
            replica.transport.resume_reading()

    def shut_down(self, close: Close = GOING_AWAY) -> None:
        """Close both sides with ``close`` from the edge (each after its frame in flight)."""
        if self.finished.done():
            return
        self.replica.into.seal(close)
        self.client.into.seal(close)
        self._begin_closing()
        self.check()

    # --- what the sides report -----------------------------------------------------------------

    def stopped(self, flow: Flow) -> None:
        """``flow``'s tracker stopped while the flow was open (it is between two frames)."""
        tracker = flow.tracker
        if tracker.stopped is Stop.CLOSE:
            code = sendable_close_code(tracker.close_code, fallback=flow.fallback)
            answer = flow.answer or (code, tracker.close_reason)
            flow.sink.write_close(answer)
            flow.state = State.DONE
            flow.source.resume()
            back = flow.other
            if back.state is State.OPEN and back.answer is None:
                back.answer = answer  # the source's close is answered once the sink's arrives
        else:
            # The source broke the rules the edge keeps: it is closed, the sink told why.
            from_client = flow.source is self.client
            if from_client:
                flow.sink.write_close(CLIENT_GONE)
            else:
                flow.sink.write_close(REPLICA_BROKE)
            flow.state = State.DONE
            flow.other.seal(TOO_BIG if tracker.stopped is Stop.TOO_BIG else PROTOCOL_ERROR)
        self._begin_closing()
        self.check()

    def lost(self, side: Side) -> None:
        """``side``'s connection ended (with or without a close frame)."""
        flow = side.out
        if flow.state is State.OPEN and flow.tracker.between_frames:
            gone = CLIENT_GONE if side is self.client else REPLICA_GONE
            flow.sink.write_close(flow.answer or gone)
        elif flow.state is State.OPEN or flow.state is State.ENDING:
            # Mid-frame (ENDING is always mid-frame): the sink has part of a frame that will
            # never be finished, and a close frame cannot follow it. Nothing clean is left but
            # to abort the sink's connection.
            flow.sink.abort()
        flow.state = State.DONE
        flow.pending = None
        back = side.into
        if back.state is State.OPEN or back.state is State.ENDING:
            back.state = State.SEALED  # nothing can reach the side; its peer's close awaited
            back.pending = None
            back.source.resume()
        if self.client.gone and self.replica.gone:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            if not self.finished.done():
                self.finished.set_result(None)
            return
        self._begin_closing()
        self.check()

    def check(self) -> None:
        """Once each side's close has arrived (or the side is gone), both connections close
        (what is written goes out first)."""
        if self.up.state is State.DONE and self.down.state is State.DONE:
            for side in (self.client, self.replica):
                if not side.gone:
                    side.transport.close()

    # --- the close time ------------------------------------------------------------------------

    def _begin_closing(self) -> None:
        if not self.closing:
            self.closing = True
            self._deadline = self._loop.call_later(self._close_timeout_s, self._out_of_time)

    def _out_of_time(self) -> None:
        """The close time is up. A side still owed the echo of its close gets it if it can
        (between two frames), as when the edge closed sessions message by message; then both
        connections close, and what has not closed :data:`LAST_WRITE_S` later is aborted."""
        self._deadline = self._loop.call_later(LAST_WRITE_S, self._abort)
        for side in (self.client, self.replica):
            if side.gone:
                continue
            into = side.into
            if into.state is State.OPEN and into.tracker.between_frames:
                side.write_close(into.answer or GOING_AWAY)
            elif into.state is State.OPEN or into.state is State.ENDING:
                side.abort()  # mid-frame: nothing clean can follow
                continue
            side.transport.close()

    def _abort(self) -> None:
        self._deadline = None
        for side in (self.client, self.replica):
            side.abort()
