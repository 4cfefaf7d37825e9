"""Readable input formats shared by several harnesses, so seed corpora are plain text files.

Request heads (``classify``) are HTTP/1.1 heads as they arrive. Segments and session directories
(``segments``, ``history``) are described by a small line-oriented script, which lets a mutator
reach code behind the seal: a ``rec`` line is sealed with the session's real key, so the fuzzer
explores what *authenticated* records may hold, not just tag failures. Script lines (one per
``\\n``; a line that does not parse is skipped)::

    prefix E [V]       the 13-byte prefix naming epoch E (format version V, default 1)
    rec I[@E] JSON     a record at index I holding payload b"\\0" + JSON, sealed at (E, I)
    zrec I[@E] JSON    the same, payload zlib-compressed (flags byte 1)
    sealed I[@E] B     B sealed as is (its first byte is the flags byte)
    raw B              the bytes B
    len N              a 4-byte length field N
    zero N             N zero bytes (N <= 4096)
    cut N              keep only the first N bytes so far
    bound N            (segments) parse with the seal bound N
    header-only        (segments) parse with header_only
    file NAME          (history) start a new file NAME in the session directory
    dir NAME           (history) a directory NAME where a segment file is expected
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

from replica.sealing import RecordSealer
from replica.segments import LENGTH, MAGIC, PREFIX, parse_segment_name

MAX_ZERO = 4096
MAX_FILES = 4
MAX_NAME_BYTES = 255
_U32 = 2**32 - 1
_U64 = 2**64 - 1


def request_head(data: bytes) -> tuple[str, str, list[tuple[bytes, bytes]]]:
    """``(method, raw target, raw header pairs)`` of an HTTP/1.1 request head.

    Values lose their surrounding spaces and tabs as every HTTP parser strips them; the target
    is decoded as latin-1, which is how the edge hands raw target bytes to the classifier."""
    lines = [line.removesuffix(b"\r") for line in data.split(b"\n")]
    request_line = lines[0] if lines else b""
    method, _, rest = request_line.partition(b" ")
    target, space, version = rest.rpartition(b" ")
    if not space or not version.startswith(b"HTTP/"):
        target = rest
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        if not line:
            break
        name, colon, value = line.partition(b":")
        if colon:
            headers.append((name, value.strip(b" \t")))
    return method.decode("latin-1"), target.decode("latin-1"), headers


def _int(token: bytes, limit: int) -> int | None:
    if not token or not token.isdigit() or len(token) > 20:
        return None
    value = int(token)
    return value if value <= limit else None


def _position(token: bytes, epoch: int) -> tuple[int, int] | None:
    index_text, at, epoch_text = token.partition(b"@")
    index = _int(index_text, _U64)
    if at:
        parsed = _int(epoch_text, _U32)
        if parsed is None:
            return None
        epoch = parsed
    return None if index is None else (epoch, index)


@dataclass(slots=True)
class SegmentScript:
    """What one file's script built, and the parse options it asked for."""

    data: bytearray = field(default_factory=bytearray)
    bound: int | None = None
    header_only: bool = False


def build_segment(lines: list[bytes], epoch: int, sealer: RecordSealer) -> SegmentScript:
    out = SegmentScript()
    data = out.data
    for line in lines:
        word, _, rest = line.partition(b" ")
        if word == b"prefix":
            epoch_text, _, version_text = rest.partition(b" ")
            named = _int(epoch_text, _U64)
            version = _int(version_text, 255) if version_text else 1
            if named is not None and version is not None:
                data += PREFIX.pack(MAGIC, version, named)
        elif word in (b"rec", b"zrec", b"sealed"):
            where, _, body = rest.partition(b" ")
            position = _position(where, epoch)
            if position is None:
                continue
            if word == b"rec":
                plain = b"\0" + body
            elif word == b"zrec":
                plain = b"\x01" + zlib.compress(body)
            else:
                plain = body
            sealed = sealer.seal(position[0], position[1], plain)
            data += LENGTH.pack(len(sealed)) + sealed
        elif word == b"raw":
            data += rest
        elif word == b"len":
            length = _int(rest, _U32)
            if length is not None:
                data += struct.pack(">I", length)
        elif word == b"zero":
            count = _int(rest, MAX_ZERO)
            if count is not None:
                data += bytes(count)
        elif word == b"cut":
            keep = _int(rest, _U64)
            if keep is not None:
                del data[keep:]
        elif word == b"bound":
            out.bound = _int(rest, _U64)
        elif word == b"header-only":
            out.header_only = True
    return out


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    directory: bool
    content: bytes


def build_session_dir(data: bytes, sealer: RecordSealer) -> list[Entry]:
    """The files (at most ``MAX_FILES``) a history script describes, in order. Records are sealed
    at the epoch the file's name gives by default (epoch 1 for a name that is no segment's)."""
    # Lines before any "file"/"dir" line belong to the first segment file.
    sections: list[tuple[str, bool, list[bytes]]] = [("epoch-0000000001.seg", False, [])]
    for line in data.split(b"\n"):
        word, _, rest = line.partition(b" ")
        if word in (b"file", b"dir"):
            if not sections[0][2] and len(sections) == 1:
                sections.clear()
            sections.append((rest.decode("utf-8", "replace"), word == b"dir", []))
        else:
            sections[-1][2].append(line)
    entries: list[Entry] = []
    for name, is_dir, body in sections:
        if len(entries) < MAX_FILES and _safe_name(name):
            epoch = parse_segment_name(name) or 1
            content = b"" if is_dir else bytes(build_segment(body, epoch, sealer).data)
            entries.append(Entry(name, is_dir, content))
    return entries


def _safe_name(name: str) -> bool:
    # Names a directory can hold; what a real shard may contain, never a harness error.
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        return False
    return len(name.encode("utf-8", "surrogateescape")) <= MAX_NAME_BYTES
