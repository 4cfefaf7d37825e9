"""Fuzz the edge fast lane's request-head parser against the replica's own HTTP parser.

Input: the bytes of a request head without its blank line. ``parse_head`` documents no error:
it returns a request or declines (None, and the connection goes to aiohttp's full path). What
it accepts must be read identically by httptools (llhttp, what uvicorn runs in the replica):
the same method, request-target and header pairs byte for byte, the same ``Content-Length``,
no upgrade and no chunked body. A head the fast lane reads differently from the replica would
let the edge route or frame a request by values the replica never sees. And the request the
fast lane sends on must be byte for byte what the full path (``request_head``) would send.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fuzz.common import instrument

    instrument("edge.fast.fastpath")

import httptools

from edge.core.headers import request_head
from edge.fast.fastpath import parse_head
from fuzz.common import Harness, main
from fuzz.known import Mismatch


class _Reader:
    """httptools callbacks, collected."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


def check(data: bytes) -> None:
    request = parse_head(data)
    if request is None:
        return
    body = b"b" * request.length
    reader = _Reader()
    parser = httptools.HttpRequestParser(reader)
    try:
        parser.feed_data(data + b"\r\n\r\n" + body)
    except httptools.HttpParserUpgrade:
        raise Mismatch("upgrade", f"the replica reads an upgrade in {data!r}") from None
    except httptools.HttpParserError as exc:
        raise Mismatch("refused", f"the replica refuses {data!r}: {exc}") from None
    if parser.get_method() != b"POST" or parser.get_http_version() != "1.1":
        raise Mismatch("request-line", f"the replica reads {parser.get_method()!r} in {data!r}")
    if reader.url.decode("latin-1") != request.target:
        raise Mismatch("target", f"edge {request.target!r}, replica {reader.url!r}")
    if tuple(reader.headers) != request.headers:
        raise Mismatch("headers", f"edge {request.headers!r}, replica {reader.headers!r}")
    if not reader.complete or reader.body != body:
        raise Mismatch("framing", f"the replica frames {data!r} differently")
    # What the fast lane sends on is what the full path would have sent.
    for host in (None, b"replica:9101"):
        expected = request_head(
            "POST", request.target, request.headers, host=host or b"", body_length=len(body)
        )
        if host is None and not request.has_host:
            continue  # the fast lane always has the replica's Host to offer
        if request.upstream(body, host) != expected + body:
            raise Mismatch("forwarded", f"fast lane and request_head differ for {data!r}")


HARNESS = Harness(
    target="fasthead",
    test=check,
    tokens=(
        b"POST /_beyond/agent?session_id=a07-s1.x HTTP/1.1",
        b"\r\n",
        b"Content-Length: ",
        b"content-length:",
        b"Transfer-Encoding: chunked",
        b"Connection: close",
        b"Connection: upgrade",
        b"Upgrade: websocket",
        b"Expect: 100-continue",
        b"Host: edge",
        b"\t",
        b" ",
        b"\xff",
    ),
    max_len=1024,
)

if __name__ == "__main__":
    main(HARNESS)
