"""Fuzz the edge's quick reading of a replica's answer against llhttp.

Input: the bytes one read from a replica connection returned. ``plain_response`` documents no
error: it returns (status, header pairs, body) or declines (None, and llhttp parses the bytes
instead). What it accepts must be exactly one whole response that llhttp reads identically: the
same status, the same header pairs byte for byte, the same body, complete, with the connection
reusable afterwards. An answer the edge read differently from llhttp would hand a client
something other than what the replica sent, or pool a connection that is out of step. Read
through a memo of heads, as a replica connection reads it, the answer must be the same.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("edge.upstream.pool")

import httptools

from edge.core.headers import HOP_BY_HOP
from edge.core.memo import Memo
from edge.upstream.pool import plain_head, plain_response
from fuzz.common import Harness, main
from fuzz.known import Mismatch


class _Reader:
    """httptools callbacks, collected; keep-alive is read as the pool reads it."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.messages = 0
        self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.messages += 1
        self.keep_alive = self.parser.should_keep_alive()


# As a replica connection reads: through a memo of heads, which sees the same head with other
# bodies (the fuzzer mutates bodies as often as heads).
_HEADS = Memo(plain_head, size=64, key_max=4096)


def check(data: bytes) -> None:
    plain = plain_response(data)
    for _ in range(2):  # once to fill the memo, once from it
        remembered = plain_response(data, _HEADS.get)
        if remembered != plain:
            raise Mismatch("memo", f"{data!r} read as {plain!r}, from the memo {remembered!r}")
    if plain is None:
        return
    reader = _Reader()
    try:
        reader.parser.feed_data(data)
    except httptools.HttpParserError as exc:
        raise Mismatch("refused", f"llhttp refuses {data!r}: {exc}") from None
    status = reader.parser.get_status_code()
    if (status, tuple(reader.headers), reader.body) != plain[:3]:
        read = (status, reader.headers, reader.body)
        raise Mismatch("read", f"edge {plain!r}, llhttp {read!r}")
    if reader.messages != 1 or not reader.keep_alive:
        raise Mismatch("framing", f"llhttp frames {data!r} differently")
    hop = any(name.lower() in HOP_BY_HOP for name, _ in reader.headers)
    if plain.hop_free == hop:
        raise Mismatch("hop-by-hop", f"passed on as received or not, wrongly: {data!r}")


HARNESS = Harness(
    target="plainresponse",
    test=check,
    tokens=(
        b"HTTP/1.1 200 OK",
        b"\r\n",
        b"Content-Length: ",
        b"content-length:",
        b"Transfer-Encoding: chunked",
        b"Connection: close",
        b"Upgrade: h2c",
        b"HTTP/1.0",
        b" 204 ",
        b"\t",
        b" ",
        b"\xff",
    ),
    max_len=1024,
)

if __name__ == "__main__":
    main(HARNESS)
