"""A turn's text deltas gathered into fewer frames: the decision, with no clock and no I/O.

A model streams its reply a token at a time. Sent as they come, every token costs a JSON
encoding, a replay entry and a socket write for each reader, and the edge relays each as a frame.
A live session instead gathers a turn's deltas while a short window is open and publishes them
as one ``text_delta`` frame when the window closes, when the gathered text reaches a size bound,
or just before any other frame (so the order of frames never changes).

:class:`Coalescer` decides what is due and holds what is not; the live session
(``replica.live``) owns the one timer per window and publishes what it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_WINDOW_MS = 25.0
DEFAULT_MAX_CHARS = 4096
# Longer than this and the text no longer reads as a stream; the bound catches a value typed
# in seconds or microseconds by mistake.
MAX_WINDOW_MS = 1000.0
# Frames above this would only delay text and press against clients' frame size limits.
MAX_CHARS_CAP = 65_536


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
    """The text gathered since the last frame, in order, for one run at a time."""

    __slots__ = ("_chars", "_max_chars", "_pieces", "_run_id")

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        if max_chars < 1:
            raise ValueError("max_chars must be at least 1")
        self._max_chars = max_chars
        self._run_id = ""
        self._pieces: list[str] = []  # joined once, at the flush, not once per delta
        self._chars = 0

    @property
    def pending(self) -> bool:
        return bool(self._pieces)

    def append(self, run_id: str, text: str) -> list[Gathered]:
        """Gather one delta. Returns what must be published now, in order: the text of an
        earlier run (a run's text never shares a frame with another's), then everything
        gathered once it reaches the size bound. An empty delta says nothing and is dropped."""
        if not text:
            return []
        due: list[Gathered] = []
        if self._pieces and run_id != self._run_id:
            due.append(self._take())
        self._run_id = run_id
        self._pieces.append(text)
        self._chars += len(text)
        if self._chars >= self._max_chars:
            due.append(self._take())
        return due

    def flush(self) -> Gathered | None:
        """Everything gathered, as one frame's worth, or None when nothing is."""
        return self._take() if self._pieces else None

    def _take(self) -> Gathered:
        pieces = self._pieces
        self._pieces = []
        self._chars = 0
        return Gathered(self._run_id, "".join(pieces), len(pieces))
