"""WebSocket frames as the edge's relay sees them: headers followed, payloads passed by.

The relay (:mod:`edge.aio.wsrelay`) copies the bytes of a session between the client and the
replica as they arrive. It does not decode messages, but it has to know three things about each
direction: where frames begin and end (its own close frames may go only between two frames),
when the sender's close frame arrives (its code and reason are carried to the other side), and
whether a client's message grows past the edge's limit. :class:`FrameTracker` knows them from the
frame headers alone (RFC 6455 5.2): a header's length, its payload length, and for a close frame
its payload, unmasked. Payloads of data and ping/pong frames are neither copied nor unmasked.

The edge reads headers for framing and nothing else: a reserved opcode or bit, an unmasked
client frame, text that is not UTF-8, are the endpoints' to refuse, and they receive the bytes
as sent. The tracker refuses only what would break its own reading: a control frame over 125
bytes or fragmented, a close frame of one byte, a 64-bit length with its top bit set.

Everything here is pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from typing import Final

OP_CLOSE: Final = 0x8
MAX_CONTROL_PAYLOAD: Final = 125
# A close frame's payload is a two-byte code and a reason of at most this many bytes.
MAX_CLOSE_REASON: Final = MAX_CONTROL_PAYLOAD - 2
# The code a close frame without a payload stands for (RFC 6455 7.1.5); it is never sent.
NO_STATUS: Final = 1005


class Stop(enum.Enum):
    """Why a tracker stopped passing bytes on."""

    CLOSE = "close"  # the sender's close frame arrived whole: see close_code, close_reason
    TOO_BIG = "too big"  # a data frame takes its message past the limit
    INVALID = "invalid"  # a header no endpoint may send (see the module docstring)


class FrameTracker:
    """One direction of a WebSocket byte stream, followed frame header by frame header.

    :meth:`feed` takes the bytes as they arrive and returns the part that may go on at once.
    A frame header that is not yet whole is held back until it is, so whatever went on ends
    either between two frames or inside a payload: :attr:`between_frames` says which, and
    whether a frame of the edge's own may be written next. The tracker stops before a close
    frame (held back until whole, then read: :attr:`stopped` is :attr:`Stop.CLOSE`), before a
    data frame that takes a message past ``limit`` bytes (0: no limit), and before an invalid
    header; once stopped, it passes nothing on.
    """

    __slots__ = ("_held", "_limit", "_message", "close_code", "close_reason", "left", "stopped")

    def __init__(self, limit: int = 0) -> None:
        self.left = 0  # payload bytes of the current frame still to come
        self.stopped: Stop | None = None
        self.close_code = NO_STATUS
        self.close_reason = b""
        self._held = b""  # the start of a header (or of a close frame), not passed on yet
        self._limit = limit
        self._message = 0  # payload bytes of the current data message so far

    @property
    def between_frames(self) -> bool:
        """Everything passed on so far ends at a frame boundary (bytes held back are not
        passed on): the edge may write a frame of its own into this direction now."""
        return self.left == 0

    @property
    def holding(self) -> int:
        """Bytes held back: the start of a frame header, or of a close frame."""
        return len(self._held)

    def feed(self, data: bytes) -> bytes:
        """The part of what has arrived (bytes held back before, then ``data``) that may go on
        now; the rest is held back, or dropped once stopped."""
        if self.stopped is not None:
            return b""
        size = len(data)
        if self._held:
            data = self._held + data
            self._held = b""
            size = len(data)
            pos = 0
        else:
            pos = self.left
            if pos >= size:  # inside a payload: the common case for large frames
                self.left = pos - size
                return data
        limit = self._limit
        while pos < size:
            start = pos
            if size - pos < 2:
                return self._hold(data, start)
            first = data[pos]
            second = data[pos + 1]
            length = second & 0x7F
            head = 2
            if length == 126:
                head = 4
            elif length == 127:
                head = 10
            if second & 0x80:
                head += 4
            if size - pos < head:
                return self._hold(data, start)
            if length == 126:
                length = (data[pos + 2] << 8) | data[pos + 3]
            elif length == 127:
                length = int.from_bytes(data[pos + 2 : pos + 10], "big")
                if length >> 63:
                    return self._stop(data, start, Stop.INVALID)
            pos += head
            opcode = first & 0x0F
            if opcode >= 8:
                if length > MAX_CONTROL_PAYLOAD or not first & 0x80:
                    return self._stop(data, start, Stop.INVALID)
                if opcode == OP_CLOSE:
                    return self._close(data, start, pos, length)
            elif limit:
                # A text or binary frame begins a message; a continuation adds to it.
                message = length if opcode else self._message + length
                if message > limit:
                    return self._stop(data, start, Stop.TOO_BIG)
                self._message = message
            pos += length
        self.left = pos - size
        return data

    def rest_of_frame(self, data: bytes) -> bytes:
        """The part of ``data`` that completes the current frame's payload (all of it if the
        frame goes on past it); the tracker is then past those bytes."""
        left = self.left
        if left >= len(data):
            self.left = left - len(data)
            return data
        self.left = 0
        return data[:left]

    def _hold(self, data: bytes, start: int) -> bytes:
        self._held = data[start:]
        self.left = 0
        return data[:start] if start else b""

    def _stop(self, data: bytes, start: int, why: Stop) -> bytes:
        self.stopped = why
        self.left = 0
        return data[:start] if start else b""

    def _close(self, data: bytes, start: int, payload_at: int, length: int) -> bytes:
        end = payload_at + length
        if len(data) < end:
            return self._hold(data, start)  # read again, whole, when the rest has arrived
        if length == 1:
            return self._stop(data, start, Stop.INVALID)
        payload = data[payload_at:end]
        if data[start + 1] & 0x80:
            payload = unmask(payload, data[payload_at - 4 : payload_at])
        if payload:
            self.close_code = (payload[0] << 8) | payload[1]
            reason = payload[2:]
            try:
                reason.decode("utf-8")
            except UnicodeDecodeError:
                reason = b""  # not carried on: the other side would have to fail on it
            self.close_reason = reason
        return self._stop(data, start, Stop.CLOSE)


def unmask(payload: bytes, key: bytes) -> bytes:
    """``payload`` XORed with the four-byte masking ``key`` (masking and unmasking alike)."""
    if not payload:
        return payload
    repeated = (key * (len(payload) // 4 + 1))[: len(payload)]
    mixed = int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")
    return mixed.to_bytes(len(payload), "big")


def sendable_close_code(code: int | None, *, fallback: int) -> int:
    """A close code that may appear on the wire; ``fallback`` replaces the reserved ones."""
    if code is None or code == NO_STATUS:
        return 1000
    if 1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999:
        return code
    return fallback


def close_frame(code: int, reason: bytes = b"", mask: bytes | None = None) -> bytes:
    """A close frame with ``code`` and ``reason`` (cut to what fits, at a character boundary);
    masked with the four bytes of ``mask`` when given (frames the edge sends a replica)."""
    if len(reason) > MAX_CLOSE_REASON:
        reason = reason[:MAX_CLOSE_REASON].decode("utf-8", "ignore").encode("utf-8")
    payload = code.to_bytes(2, "big") + reason
    if mask is None:
        return bytes((0x80 | OP_CLOSE, len(payload))) + payload
    return bytes((0x80 | OP_CLOSE, 0x80 | len(payload))) + mask + unmask(payload, mask)
