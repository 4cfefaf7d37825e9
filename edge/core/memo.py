"""Remembered answers of a pure function of a message head.

Clients send the same request head time after time (one session's commands differ, if at all,
in their body), and a replica's answers to them share their head until the ``date`` field
turns over. Reading a head is a regular-expression match and a loop over its fields; looking
its bytes up in a dictionary costs a small fraction of that. :class:`Memo` keeps the answers of
one pure function by the exact bytes it was given, so a hit returns what the function would
return, and a head the function has not seen (or one too long to keep) is simply read again.

The memory is bounded by count and by key length; when it is full it is forgotten all at once
rather than kept in least-recently-used order, which would cost bookkeeping on every hit. A
working set that fits comes back within as many requests as it has members.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Generic, TypeVar

Answer = TypeVar("Answer")

_UNSEEN: Final = object()


class Memo(Generic[Answer]):
    """``read(key)`` for a pure ``read``, remembered for at most ``size`` keys of at most
    ``key_max`` bytes each. ``None`` answers are remembered too."""

    __slots__ = ("_answers", "_key_max", "_read", "_size", "hits", "misses")

    def __init__(self, read: Callable[[bytes], Answer], *, size: int, key_max: int) -> None:
        if size < 1 or key_max < 1:
            raise ValueError("a memo needs room for at least one key of at least one byte")
        self._read = read
        self._size = size
        self._key_max = key_max
        self._answers: dict[bytes, Answer] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, key: bytes) -> Answer:
        answer = self._answers.get(key, _UNSEEN)
        if answer is not _UNSEEN:
            self.hits += 1
            return answer  # type: ignore[return-value]  # only Answers are stored
        self.misses += 1
        fresh = self._read(key)
        if len(key) <= self._key_max:
            answers = self._answers
            if len(answers) >= self._size:
                answers.clear()
            answers[key] = fresh
        return fresh
