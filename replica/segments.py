"""The on-disk format of one epoch segment, and the pure parser that reads it back.

A session's history is a series of segment files ``epoch-NNNNNNNNNN.seg``, one per owner, each
created with ``O_EXCL`` and only ever appended to. A segment is::

    prefix   b"BFSG" | version (1 byte) | epoch (8 bytes, big-endian)        13 bytes, plaintext
    record 0 the header: which epoch came before and the offset it is sealed at
    record 1 a batch (one turn's messages), a reset (conversation archived), ...
    ...

and every record is ``length (4 bytes) | sealed payload``, sealed at its position (epoch, index)
by :mod:`replica.sealing`. The header of segment *e+1* records ``seal``, the byte offset at which
segment *e* ends: readers bound *e* there, so whatever a stale owner of *e* appends later is never
read. Only ids and sizes are plaintext; message text is inside sealed payloads, compressed first.

Parsing distinguishes a *torn tail* (an incomplete last record: a crash mid-append, which loses
only the uncommitted batch) from *corruption* (a complete record that does not open, a sealed
region that is short or misaligned), which is always reported.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from replica.errors import CorruptHistory
from replica.sealing import TAG_BYTES, RecordSealer

MAGIC = b"BFSG"
VERSION = 1
PREFIX = struct.Struct(">4sBQ")
LENGTH = struct.Struct(">I")
MAX_RECORD = 16 * 1024 * 1024
MAX_EPOCH = 2**32 - 1

_NAME = re.compile(r"epoch-(\d{10})\.seg")
_FLAG_ZLIB = 0x01
_COMPRESS_OVER = 64

KIND_HEADER = "h"
KIND_BATCH = "b"
KIND_RESET = "r"


def segment_name(epoch: int) -> str:
    if not 0 < epoch <= MAX_EPOCH:
        raise ValueError("epoch out of range")
    return f"epoch-{epoch:010d}.seg"


def parse_segment_name(name: str) -> int | None:
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    epoch = int(match.group(1))
    return epoch if 0 < epoch <= MAX_EPOCH else None


def encode_payload(payload: Mapping[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > _COMPRESS_OVER:
        packed = zlib.compress(body, 6)
        if len(packed) < len(body):
            return bytes([_FLAG_ZLIB]) + packed
    return b"\0" + body


def decode_payload(data: bytes) -> dict[str, Any]:
    if not data:
        raise ValueError("empty payload")
    flags, body = data[0], data[1:]
    if flags & ~_FLAG_ZLIB:
        raise ValueError("unknown payload flags")
    if flags & _FLAG_ZLIB:
        inflater = zlib.decompressobj()
        try:
            body = inflater.decompress(body, MAX_RECORD)
        except zlib.error:
            raise ValueError("payload does not inflate") from None
        if inflater.unconsumed_tail or not inflater.eof:
            raise ValueError("payload does not inflate within bounds")
    try:
        value = json.loads(body)
    except RecursionError:
        raise ValueError("payload nests too deeply") from None
    if not isinstance(value, dict) or not isinstance(value.get("k"), str):
        raise ValueError("payload is not a record object")
    return value


def encode_prefix(epoch: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, epoch)


def encode_record(
    sealer: RecordSealer, epoch: int, index: int, payload: Mapping[str, Any]
) -> bytes:
    sealed = sealer.seal(epoch, index, encode_payload(payload))
    if len(sealed) > MAX_RECORD:
        raise ValueError("record exceeds the maximum record size")
    return LENGTH.pack(len(sealed)) + sealed


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    epoch: int
    prev_epoch: int | None
    seal: int | None  # where prev_epoch's segment ends
    owner: str
    ts: float

    def payload(self) -> dict[str, Any]:
        return {
            "k": KIND_HEADER,
            "prev": self.prev_epoch,
            "seal": self.seal,
            "owner": self.owner,
            "ts": self.ts,
        }


def encode_segment_start(sealer: RecordSealer, header: SegmentHeader) -> bytes:
    return encode_prefix(header.epoch) + encode_record(sealer, header.epoch, 0, header.payload())


@dataclass(frozen=True, slots=True)
class Record:
    index: int
    start: int
    end: int
    payload: dict[str, Any] = field(repr=False)


@dataclass(frozen=True, slots=True)
class ParsedSegment:
    epoch: int
    size: int
    header: SegmentHeader | None  # None: the creator died before its header was complete
    records: tuple[Record, ...]  # body records (index >= 1), within the bound
    valid_end: int  # offset just past the last record read
    torn_bytes: int  # bytes past valid_end that form no complete record


def _header_from(epoch: int, payload: Mapping[str, Any]) -> SegmentHeader:
    prev, seal, owner, ts = (payload.get(k) for k in ("prev", "seal", "owner", "ts"))
    if payload.get("k") != KIND_HEADER:
        raise CorruptHistory(f"segment {epoch} does not start with a header record")
    ok_prev = prev is None or (isinstance(prev, int) and 0 < prev < epoch)
    ok_seal = (seal is None) == (prev is None) and (seal is None or isinstance(seal, int))
    if not ok_prev or not ok_seal or not isinstance(owner, str) or not isinstance(ts, int | float):
        raise CorruptHistory(f"segment {epoch} has a malformed header")
    try:
        return SegmentHeader(epoch, prev, seal, owner, float(ts))
    except OverflowError:
        raise CorruptHistory(f"segment {epoch} has a malformed header") from None


def parse_segment(
    data: bytes,
    epoch: int,
    sealer: RecordSealer,
    *,
    bound: int | None = None,
    header_only: bool = False,
) -> ParsedSegment:
    """Read one segment. With ``bound`` (the seal its successor recorded) the segment must hold
    complete, valid records exactly up to it; without, a torn tail is allowed and reported.
    ``header_only`` stops after record 0, for learning seals before bounds are known."""
    size = len(data)
    if bound is not None and (bound > size or bound < PREFIX.size):
        raise CorruptHistory(
            f"segment {epoch} is sealed at {bound} bytes but holds {size}: history was truncated"
        )
    limit = size if bound is None else bound
    if limit < PREFIX.size:
        if data.strip(b"\0") and not MAGIC.startswith(data[: len(MAGIC)]):
            raise CorruptHistory(f"segment {epoch} has a damaged prefix")
        return ParsedSegment(epoch, size, None, (), 0, size)
    magic, version, named = PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise CorruptHistory(f"segment {epoch} is not a version-{VERSION} segment")
    if named != epoch:
        raise CorruptHistory(f"segment file for epoch {epoch} says it is epoch {named}")

    header: SegmentHeader | None = None
    records: list[Record] = []
    offset, index = PREFIX.size, 0
    while offset < limit:
        start = offset
        if limit - offset < LENGTH.size:
            break
        (length,) = LENGTH.unpack_from(data, offset)
        body_end = offset + LENGTH.size + length
        if length < TAG_BYTES + 1 or length > MAX_RECORD:
            if bound is None and not data[offset:].strip(b"\0"):
                break  # a zero-filled tail: space allocated but never written
            raise CorruptHistory(f"segment {epoch} record {index} has an impossible length")
        if body_end > limit:
            break
        plain = sealer.open(epoch, index, data[offset + LENGTH.size : body_end])
        try:
            payload = decode_payload(plain)
        except ValueError as exc:
            raise CorruptHistory(f"segment {epoch} record {index} is unreadable: {exc}") from None
        if index == 0:
            header = _header_from(epoch, payload)
            if header_only:
                return ParsedSegment(epoch, size, header, (), body_end, 0)
        elif payload["k"] == KIND_HEADER:
            raise CorruptHistory(f"segment {epoch} record {index} is a second header")
        else:
            records.append(Record(index, start, body_end, payload))
        offset, index = body_end, index + 1

    if bound is not None and offset != bound:
        raise CorruptHistory(f"segment {epoch} is sealed at {bound}, inside a record")
    if header is None and records:
        raise CorruptHistory(f"segment {epoch} has records but no header")
    if header is None and bound is not None:
        raise CorruptHistory(f"segment {epoch} is sealed but has no header")
    if header is None:
        offset = 0
    return ParsedSegment(epoch, size, header, tuple(records), offset, size - offset)
