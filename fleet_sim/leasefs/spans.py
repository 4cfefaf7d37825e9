"""Byte-range bookkeeping for one lock owner on one file.

The backing kernel does the real locking; this only tracks which ranges an owner still holds so
the daemon knows when an owner holds nothing (and its backing descriptor can be closed) and how
many locks a host holds. Semantics follow POSIX record locks: a new lock or an unlock replaces
whatever the same owner held on the overlapping bytes. Ends are exclusive; ``None`` means "to the
end of the file and beyond", which is what ``l_len == 0`` asks for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LockType(enum.Enum):
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class Span:
    start: int
    end: int | None
    kind: LockType


def span_end(start: int, length: int) -> int | None:
    """The exclusive end of a lock request (the kernel hands FUSE non-negative lengths)."""
    if length < 0:
        raise ValueError("negative lock length")
    return None if length == 0 else start + length


def _before(a: int | None, b: int | None) -> bool:
    """a < b where None is +infinity."""
    if a is None:
        return False
    return b is None or a < b


def apply(
    held: tuple[Span, ...], start: int, end: int | None, kind: LockType | None
) -> tuple[Span, ...]:
    """Return the owner's spans after locking ``[start, end)`` as ``kind`` (None = unlock)."""
    if start < 0 or (end is not None and end <= start):
        raise ValueError("empty or negative lock range")
    out: list[Span] = []
    for span in held:
        if not _before(span.start, end) or not _before(start, span.end):
            out.append(span)  # no overlap
            continue
        if span.start < start:
            out.append(Span(span.start, start, span.kind))
        if _before(end, span.end):
            assert end is not None  # _before(None, x) is always False
            out.append(Span(end, span.end, span.kind))
    if kind is not None:
        out.append(Span(start, end, kind))
    return tuple(sorted(out, key=lambda s: s.start))
