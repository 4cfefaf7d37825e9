"""Crashes the harnesses have found and that are reported but not yet fixed.

A harness that hits one of these counts it and goes on, so the suite keeps fuzzing everything
else; ``python -m fuzz.run --strict`` (or ``FUZZ_STRICT=1``) turns them back into crashes. Each
entry is matched narrowly, by exception type *and* the frame it is raised in (file and function),
so a new crash of the same type elsewhere is still a crash. ``found`` says how each was found: by
a harness, or by reading the code while writing one (those inputs were written by hand, in the
harness's format, and crash the harness as it stands). The inputs live in
``tests/corpus/<target>/crash-<key>-<sha1>``; ``tests/system/test_fuzz.py`` replays each one, xfails
while the bug is there and fails once it is fixed, so the entry here goes with the fix.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass


class Mismatch(AssertionError):
    """A differential check failed: two implementations that must agree did not."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


@dataclass(frozen=True, slots=True)
class KnownBug:
    key: str
    targets: tuple[str, ...]
    exception: type[BaseException]
    # "path/suffix.py:function": the innermost frame of the traceback must be this one (or,
    # with anywhere=True, any frame: for errors raised deep inside a library call).
    frame: str = ""
    anywhere: bool = False
    # For a Mismatch: its code.
    code: str = ""
    found: str = ""
    summary: str = ""

    def matches(self, target: str, exc: BaseException) -> bool:
        if target not in self.targets or not isinstance(exc, self.exception):
            return False
        if self.code and getattr(exc, "code", None) != self.code:
            return False
        if not self.frame:
            return True
        suffix, _, function = self.frame.partition(":")
        frames = list(traceback.extract_tb(exc.__traceback__))
        if not self.anywhere:
            frames = frames[-1:]
        return any(f.filename.endswith(suffix) and f.name == function for f in frames)


KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug(
        "query-empty-key",
        ("query",),
        Mismatch,
        code="query-values-empty-key",
        found="fuzz_query (both engines, first inputs)",
        summary="query_values(query, '') counts empty '&&' parts as blank values of the empty "
        "key on its fast path, where parse_qsl (Starlette) skips them; unreachable today, "
        "since the edge only asks for session_id",
    ),
)


def known_bug(target: str, exc: BaseException) -> KnownBug | None:
    for bug in KNOWN_BUGS:
        if bug.matches(target, exc):
            return bug
    return None
