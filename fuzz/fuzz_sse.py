"""Fuzz SSE framing: frames as the replica sends them, parsed as the spec and the tests read them.

Input: text, split on U+001F into the fields of one event frame (text, then the event id, then
more strings); the first byte picks how bytes become text (UTF-8, UTF-16 code units with lone
surrogates allowed, or latin-1). The frame is serialised exactly as ``replica/app.py`` does
(``protocol.dumps`` into sse-starlette's ``ServerSentEvent``), between a keepalive comment and a
``reconnect`` event, and then read back:

* by :func:`parse_sse`, a parser written from the HTML standard's event-stream rules: it must
  give back the same JSON, the id with CR/LF removed (sse-starlette drops them), or none when
  it holds NUL (the standard ignores such an id), and the ``reconnect`` event;
* by the tests' own client (``tests/harness.py`` ``sse_events``), both on the standard's lines
  and through the httpx line splitting the functional tests use, fed in uneven chunks.

No step documents an error.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("replica.protocol", "sse_starlette.event", "tests.harness")

import json
import random
import re
from dataclasses import dataclass
from typing import Any

from httpx._decoders import LineDecoder
from sse_starlette.event import ServerSentEvent

from fuzz.common import Harness, main
from fuzz.known import Mismatch
from replica import protocol
from tests.harness import sse_events

_LINES = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class Event:
    type: str
    data: str
    last_event_id: str


def parse_sse(stream: bytes) -> list[Event]:
    """The HTML standard's event-stream interpretation, for a complete stream."""
    text = stream.decode("utf-8", "replace").removeprefix("\ufeff")
    events: list[Event] = []
    data: list[str] = []
    event_type = ""
    last_id = ""
    lines = _LINES.split(text)
    # The last piece is what follows the final line break: an unterminated line, never processed.
    for line in lines[:-1]:
        if line == "":
            if data:
                events.append(Event(event_type or "message", "\n".join(data), last_id))
            data, event_type = [], ""
            continue
        if line.startswith(":"):
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            event_type = value
        elif name == "data":
            data.append(value)
        elif name == "id" and "\0" not in value:
            last_id = value
    return events


def decode_text(data: bytes) -> str:
    mode, body = (data[0] % 3, data[1:]) if data else (0, b"")
    if mode == 0:
        return body.decode("utf-8", "replace")
    if mode == 1:
        units = body[: len(body) // 2 * 2]
        return "".join(
            chr(int.from_bytes(units[i : i + 2], "little")) for i in range(0, len(units), 2)
        )
    return body.decode("latin-1")


def _client_lines(text: str, chunking: random.Random) -> list[str]:
    decoder = LineDecoder()
    lines: list[str] = []
    at = 0
    while at < len(text):
        step = chunking.randrange(1, 64)
        lines += decoder.decode(text[at : at + step])
        at += step
    return lines + decoder.flush()


def _encodable(fields: list[str]) -> bool:
    try:
        for field in fields:
            field.encode()
    except UnicodeEncodeError:
        return False
    return True


def check(data: bytes) -> None:
    fields = decode_text(data).split("\x1f")
    event_id = fields[1] if len(fields) > 1 and fields[1] else None
    if event_id is not None and not (event_id.isascii() and event_id.isprintable()):
        # SSE ids are message ids the replica mints ([A-Za-z0-9_-]); text in them is not ours.
        event_id = None
    frame: dict[str, Any] = protocol.event("text_delta", text=fields[0], more=fields[2:])
    text = protocol.dumps(frame)
    wire = b"".join(
        (
            ServerSentEvent(comment="keepalive").encode(),
            ServerSentEvent(data=text, id=event_id).encode(),
            ServerSentEvent(event="reconnect", data="fell too far behind").encode(),
        )
    )
    sent_id = "" if event_id is None else _LINES.sub("", event_id)
    if "\0" in sent_id:
        sent_id = ""
    expected = [
        Event("message", text, sent_id),
        Event("reconnect", "fell too far behind", sent_id),
    ]
    got = parse_sse(wire)
    if got != expected:
        raise Mismatch("sse-wire", f"sent {expected!r}, the standard reads {got!r}")
    # Ill-formed text (lone surrogates) has no exact JSON spelling: escaped, a high and a low
    # surrogate read back as one character. The replica cleans model and tool text before it
    # makes frames; for valid text the round trip must be exact.
    valid = _encodable(fields)
    if valid and json.loads(got[0].data) != frame:
        raise Mismatch("sse-wire", "the frame did not survive the round trip")
    decoded = wire.decode("utf-8")
    by_standard = sse_events(_LINES.split(decoded))
    if [e.get("data") for e in by_standard] != [text, "fell too far behind"]:
        raise Mismatch("client-parser", f"tests/harness.py read {by_standard!r}")
    by_client = sse_events([*_client_lines(decoded, random.Random(data)), ""])
    if [e.get("data") for e in by_client] != [text, "fell too far behind"]:
        raise Mismatch("client-pipeline", f"httpx lines + tests/harness.py read {by_client!r}")


HARNESS = Harness(
    target="sse",
    test=check,
    tokens=(
        b"\x1f",
        b"\r",
        b"\n",
        b"\r\n",
        b"\0",
        b":",
        b"data: ",
        b"id: ",
        b"\xef\xbb\xbf",
        b"\xc2\x85",
        b"\xe2\x80\xa8",
        b"\x00\xd8",
        b"\x00\xdc",
    ),
    max_len=2048,
)

if __name__ == "__main__":
    main(HARNESS)
