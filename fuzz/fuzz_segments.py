"""Fuzz the sealed record reader: ``replica.segments.parse_segment`` and ``decode_payload``.

Input: a segment script (``fuzz.formats``), whose ``rec`` lines are sealed with the session's real
key, so the fuzzer explores what authenticated records may hold. The first line may be
``epoch E`` (default 1), the epoch the parser is told. The documented error is
:class:`~replica.errors.CorruptHistory` for ``parse_segment`` and ``ValueError`` for
``decode_payload`` (which is also fed the raw input). What parses must be self-consistent.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("replica.segments", "replica.sealing")

import contextlib

from fuzz.common import Harness, main
from fuzz.formats import build_segment
from fuzz.known import Mismatch
from replica.errors import CorruptHistory
from replica.sealing import RecordSealer
from replica.segments import MAX_EPOCH, ParsedSegment, decode_payload, parse_segment

SEALER = RecordSealer.for_session(bytes(range(32)), "acme", "a07-s3.x")

TOKENS = (
    b"prefix 1\n",
    b"rec 0 ",
    b"rec 1 ",
    b"zrec 1 ",
    b"sealed 1 \x01",
    b"sealed 0 \x00",
    b"raw ",
    b"len ",
    b"zero 64\n",
    b"cut ",
    b"bound ",
    b"header-only\n",
    b'{"k":"h","prev":null,"seal":null,"owner":"r1","ts":1.0}',
    b'{"k":"b","m":[]}',
    b'{"k":"r","jobs":[]}',
    b'"prev":',
    b'"seal":',
    b'"ts":',
    b'"m":[{"id":"m1","parent_id":null,"role":"user","content":"hi","ts":1}]',
    b"NaN",
    b"1e999",
    b"[[[[[[[[",
    b"@2 ",
)


def _consistent(parsed: ParsedSegment, size: int, bound: int | None) -> None:
    if parsed.size != size or not 0 <= parsed.valid_end <= size:
        raise Mismatch("segment", f"bad offsets {parsed!r}")
    if bound is not None and parsed.valid_end not in (0, bound):
        raise Mismatch("segment", f"sealed at {bound}, read to {parsed.valid_end}")
    indexes = [r.index for r in parsed.records]
    if indexes != list(range(1, len(indexes) + 1)):
        raise Mismatch("segment", f"record indexes {indexes}")
    if any(not parsed.valid_end >= r.end > r.start for r in parsed.records):
        raise Mismatch("segment", "a record outside the valid region")


def check(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        decode_payload(data)
    lines = data.split(b"\n")
    epoch = 1
    if lines and lines[0].startswith(b"epoch "):
        text = lines.pop(0)[len(b"epoch ") :]
        if text.isdigit() and len(text) <= 10 and 0 < int(text) <= MAX_EPOCH:
            epoch = int(text)
    script = build_segment(lines, epoch, SEALER)
    blob = bytes(script.data)
    try:
        parsed = parse_segment(
            blob, epoch, SEALER, bound=script.bound, header_only=script.header_only
        )
    except CorruptHistory:
        return
    _consistent(parsed, len(blob), None if script.header_only else script.bound)


HARNESS = Harness(target="segments", test=check, tokens=TOKENS, max_len=8192)

if __name__ == "__main__":
    main(HARNESS)
