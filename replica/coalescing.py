"""A turn's text deltas gathered into fewer frames: the decision, with no clock and no I/O.

A model streams its reply a token at a time. Sent as they come, every token costs a JSON
encoding, a replay entry and a socket write for each reader, and the edge relays each as a frame.
A live session instead sends a
turn's text at most once a window: a delta that arrives a window or more after the last text
frame goes out at once (so the first token of a reply, and every delta of a model that sends no
more often than that, waits for nothing); one that arrives sooner is gathered, and what is
gathered goes out when the window since the last frame closes, when it reaches a size bound, or
just before any other frame (so the order of frames never changes).

:class:`Coalescer` decides what is due and when, with the time handed in and no I/O; the live
session (``replica.live``) owns the one timer per window and publishes what it is handed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_WINDOW_MS = 25.0
DEFAULT_MAX_CHARS = 4096
# Longer than this and the text no longer reads as a stream; the bound catches a value typed
# in seconds or microseconds by mistake.
MAX_WINDOW_MS = 1000.0
# Frames above this would only delay text and press against clients' frame size limits.
MAX_CHARS_CAP = 65_536
# A delta this close to the end of the window counts as after it: a timer (the model's own, or
# the loop's) may wake a millisecond early, and a frame 2 ms early costs less than a timer more.
EARLY_S = 0.002


@dataclass(frozen=True, slots=True)
class Coalescing:
    """How long a window stays open (0: every delta is its own frame) and how much text it may
    gather before it is sent regardless."""

    window_s: float = DEFAULT_WINDOW_MS / 1000
    max_chars: int = DEFAULT_MAX_CHARS

    @property
    def enabled(self) -> bool:
        return self.window_s > 0


DEFAULT_COALESCING = Coalescing()


@dataclass(frozen=True, slots=True)
class Gathered:
    """Text of one run to publish as one frame, and how many model deltas it holds."""

    run_id: str
    text: str
    deltas: int


class Coalescer:
    """The text gathered since the last frame, in order, for one run at a time, and when the
    last text frame went out."""

    __slots__ = ("_chars", "_max_chars", "_pieces", "_run_id", "_sent_at", "_window_s")

    def __init__(
        self, max_chars: int = DEFAULT_MAX_CHARS, window_s: float = DEFAULT_WINDOW_MS / 1000
    ) -> None:
        if max_chars < 1:
            raise ValueError("max_chars must be at least 1")
        if not window_s >= 0:
            raise ValueError("window_s must not be negative")
        self._max_chars = max_chars
        self._window_s = window_s
        self._run_id = ""
        self._pieces: list[str] = []  # joined once, at the flush, not once per delta
        self._chars = 0
        self._sent_at = -math.inf

    @property
    def pending(self) -> bool:
        return bool(self._pieces)

    @property
    def due_at(self) -> float | None:
        """When the gathered text must go out (a window after the last text frame), or None
        when nothing is gathered."""
        return self._sent_at + self._window_s if self._pieces else None

    def append(self, run_id: str, text: str, now: float) -> list[Gathered]:
        """Gather one delta that arrived at ``now``. Returns what must be published now, in
        order: the text of an earlier run (a run's text never shares a frame with another's),
        then everything gathered once the window since the last frame has closed or the text
        has reached the size bound. An empty delta says nothing and is dropped."""
        if not text:
            return []
        due: list[Gathered] = []
        if self._pieces and run_id != self._run_id:
            due.append(self._take(now))
        self._run_id = run_id
        self._pieces.append(text)
        self._chars += len(text)
        if self._chars >= self._max_chars or now >= self._sent_at + self._window_s - EARLY_S:
            due.append(self._take(now))
        return due

    def flush(self, now: float) -> Gathered | None:
        """Everything gathered, as one frame's worth, or None when nothing is."""
        return self._take(now) if self._pieces else None

    def _take(self, now: float) -> Gathered:
        pieces = self._pieces
        self._pieces = []
        self._chars = 0
        self._sent_at = now
        return Gathered(self._run_id, "".join(pieces), len(pieces))
