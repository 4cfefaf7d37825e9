"""Fuzz resuming by ``Last-Event-ID`` or ``?since=``: ``Transcript.since`` on what clients send.

Input lines: the raw ``Last-Event-ID`` header value, the raw query string, then the ids of the
session's committed messages. The id is picked as ``replica/app.py`` picks it (the header, else
the ``since`` query value, read by Starlette from raw bytes), then ``since`` answers. The
documented error is :class:`~replica.transcript.UnknownMessage` (the replica's 409). What it
returns must be exactly the messages after the named one, and the catch-up built from it must go
out as an SSE event.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("replica.transcript", "starlette.datastructures", "sse_starlette.event")

from sse_starlette.event import ServerSentEvent
from starlette.datastructures import Headers, QueryParams

from fuzz.common import Harness, main
from fuzz.known import Mismatch
from replica import protocol
from replica.transcript import Message, Transcript, UnknownMessage


def transcript_of(ids: list[str]) -> Transcript:
    transcript = Transcript()
    parent: str | None = None
    batch = []
    for message_id in ids:
        if message_id:
            batch.append(Message(message_id, parent, "user", "x", 1.0))
            parent = message_id
    transcript.apply_batch(batch)
    return transcript


def check(data: bytes) -> None:
    header, _, rest = data.partition(b"\n")
    query, _, id_lines = rest.partition(b"\n")
    transcript = transcript_of(id_lines.decode("utf-8", "replace").split("\n"))
    headers = Headers(raw=[(b"last-event-id", header)])
    since = headers.get("last-event-id") or QueryParams(query).get("since")
    try:
        after = transcript.since(since or None)
    except UnknownMessage:
        if since and since in transcript:
            raise Mismatch("since", f"{since!r} is in the transcript but was refused") from None
        return
    messages = transcript.messages
    if since:
        last = max(i for i, m in enumerate(messages) if m.id == since)
        expected = messages[last + 1 :]
    else:
        expected = messages
    if list(after) != expected:
        raise Mismatch("since", f"since {since!r} returned {len(after)} of {len(messages)}")
    frame = protocol.catchup([m.to_wire() for m in after], transcript.leaf_id, [], False)
    ServerSentEvent(data=protocol.dumps(frame), id=frame["leaf_id"]).encode()


HARNESS = Harness(
    target="last_event_id",
    test=check,
    tokens=(b"since=", b"&", b"%", b"+", b"\n", b"mAAAAAAAAAAAA", b"\xff", b"\xc3\xa9"),
    max_len=2048,
)

if __name__ == "__main__":
    main(HARNESS)
