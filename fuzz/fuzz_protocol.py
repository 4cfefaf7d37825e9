"""Fuzz command decoding (``replica.protocol.parse_command``): WebSocket messages and POST bodies.

Input: the raw message. A WebSocket delivers text or bytes, so both are tried: the bytes as is,
and the bytes decoded as UTF-8 with invalid sequences kept as lone surrogates. The documented
error is :class:`~replica.errors.BadRequest`. What is accepted must be safe to act on: a known
type, bounded fields, and text every frame built from it can be sent as UTF-8.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("replica.protocol", "json")

from fuzz.common import Harness, main
from fuzz.known import Mismatch
from replica import protocol
from replica.errors import BadRequest


def _accepted(command: protocol.Command) -> None:
    if command.type not in protocol.COMMANDS or not 0 < len(command.id) <= protocol.MAX_ID_CHARS:
        raise Mismatch("command", f"accepted {command!r}")
    if not 1 <= command.limit <= protocol.LIST_CAP or len(command.query) > protocol.MAX_QUERY_CHARS:
        raise Mismatch("command", f"accepted unbounded {command!r}")
    if command.type == "prompt" and not command.message.strip():
        raise Mismatch("command", "accepted an empty prompt")
    for frame in (
        protocol.ack(command),
        protocol.response(command, {"message": command.message, "since": command.since}),
        protocol.failure(command, "x"),
    ):
        protocol.dumps(frame).encode("utf-8")


def check(data: bytes) -> None:
    for raw in (data, data.decode("utf-8", "surrogateescape")):
        try:
            command = protocol.parse_command(raw)
        except BadRequest:
            continue
        _accepted(command)


HARNESS = Harness(
    target="protocol",
    test=check,
    tokens=(
        b'{"type":"prompt","message":"',
        b'{"type":"get_messages","since":"',
        b'{"type":"list_sessions","limit":',
        b'"query":"',
        b'"id":"',
        b'"job_id":"',
        b'"type":"job_ended"',
        b'"type":"abort"',
        b"\\ud800",
        b"\\udc00",
        b"NaN",
        b"Infinity",
        b"[[[[[[[[",
        b"1e999",
        b"\xef\xbb\xbf",
        b"\xff\xfe",
    ),
    max_len=8192,
)

if __name__ == "__main__":
    main(HARNESS)
