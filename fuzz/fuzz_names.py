"""Fuzz the one strict parser of tenants, shards and session ids (``wire/names.py``).

Input: text (UTF-8; invalid bytes become lone surrogates, as ``surrogateescape`` makes them). The
parsers document :class:`~wire.errors.InvalidName` only. What they accept must round-trip to
the same text, be ASCII, and put ``session_dir`` exactly three levels under the shard root. A
``|`` splits the input into a tenant and a session id for ``session_dir``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("wire.names", "replica.layout")

import contextlib

from fuzz.common import Harness, main
from fuzz.known import Mismatch
from replica.layout import session_dir
from wire.errors import InvalidName
from wire.names import parse_session_id, parse_shard, parse_slice, parse_tenant

ROOT = Path("/srv/shards/a07-s1")


def _accepted(text: str, parsed: object) -> None:
    if str(parsed) != text or not text.isascii():
        raise Mismatch("round-trip", f"{text!r} parsed as {parsed!r}")


def check(data: bytes) -> None:
    text = data.decode("utf-8", "surrogateescape")
    for parser in (parse_session_id, parse_shard, parse_slice, parse_tenant):
        with contextlib.suppress(InvalidName):
            _accepted(text, parser(text))
    tenant, _, sid = text.partition("|")
    try:
        path = session_dir(ROOT, parse_tenant(tenant), parse_session_id(sid or text))
    except InvalidName:
        return
    relative = path.relative_to(ROOT).parts
    if len(relative) != 3 or relative[1] != "sessions" or any(p in (".", "..") for p in relative):
        raise Mismatch("session-dir", f"{text!r} -> {path}")


HARNESS = Harness(
    target="names",
    test=check,
    tokens=(b"a07-s1.", b"-", b".", b"..", b"/", b"|", b"\0", b"_", b"\xc4\xb1", b"\xef\xbc\x8e"),
    max_len=512,
)

if __name__ == "__main__":
    main(HARNESS)
