"""HTTP/1.1 for the model client, without I/O: a request's bytes, and a response read from
whatever pieces the network delivers.

:func:`encode_request` writes a request as one buffer (head and body), so it goes out in one
write. :class:`ResponseReader` is fed the bytes of a connection as they arrive and keeps what
the caller needs: the head (status and header pairs), the body decoded from its framing
(``Content-Length``, ``chunked`` or until the connection closes), whether the response is
complete, and whether the connection may carry another exchange. The message syntax is
llhttp's (``httptools``, the parser uvicorn runs in the replica and the edge runs for its own
upstream connections), so chunk sizes, extensions, trailers and header folding are read as a
well-tested parser reads them; what is decided here is what the client does with it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import httptools

MAX_HEAD: Final = 64 * 1024
"""Bound of a response head (status line and header fields), so a broken server cannot make the
client buffer without end before the body starts."""

_FIELD_NAME: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE: Final = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_TARGET: Final = re.compile(rb"/[\x21-\x7e]*")


class WireError(Exception):
    """The bytes received are not an HTTP/1.1 response this client can read."""


def encode_request(
    method: str, target: bytes, headers: Sequence[tuple[str, str]], body: bytes
) -> bytes:
    """The request as one buffer: request line, ``headers`` (``Content-Length`` is added),
    blank line, body. Header names and values are checked, so nothing a caller passes can
    split the head; a refusal never shows the value."""
    if not _TARGET.fullmatch(target):
        raise ValueError("the request target must be an origin-form path without spaces")
    lines = [f"{method} {target.decode('ascii')} HTTP/1.1"]
    for name, value in headers:
        if not _FIELD_NAME.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise ValueError(f"header {name[:40]!r} cannot be sent as it is")
        lines.append(f"{name}: {value}")
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass(frozen=True, slots=True)
class Head:
    """A response's status and header pairs (names lower-cased, values as sent)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def get(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None."""
        wanted = name.lower().encode("latin-1")
        for key, value in self.headers:
            if key == wanted:
                return value.decode("latin-1")
        return None


class ResponseReader:
    """One response, fed as it arrives (:meth:`feed`), then :meth:`feed_eof` if the connection
    closes. Informational (1xx) responses before it are skipped.

    ``head`` is set once the head is complete; ``complete`` once the body has ended;
    ``reusable`` says whether the connection may carry another exchange (a complete response
    that allows keep-alive, with nothing after it). Errors are :class:`WireError`.
    """

    __slots__ = (
        "_body",
        "_close_delimited",
        "_head_size",
        "_headers",
        "_informational",
        "_parser",
        "_trailing",
        "complete",
        "head",
        "keep_alive",
    )

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0
        self._informational = False
        self._close_delimited = False
        self._trailing = False
        self._body: list[bytes] = []
        self.head: Head | None = None
        self.complete = False
        self.keep_alive = False

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self._trailing

    def feed(self, data: bytes) -> bytes:
        """Read ``data``; returns the body bytes it held (possibly none)."""
        if self.complete:
            # Bytes after the response: the connection is out of step, not the response.
            self._trailing = self._trailing or bool(data)
            return b""
        if self.head is None:
            # Counted as fed, not as parsed: the parser holds a partial field in memory. A head
            # that completes within one read may exceed the bound by at most that read.
            self._head_size += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise WireError("the server switched protocols unasked") from None
        except httptools.HttpParserError as exc:
            if not self.complete:
                raise WireError(f"invalid HTTP response ({type(exc).__name__})") from None
            # Garbage after a complete response: it stays read, the connection is not reused.
            self._trailing = True
        if self.head is None and self._head_size > MAX_HEAD:
            raise WireError("the response head is too large")
        body = self._body
        if not body:
            return b""
        out = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        return out

    def feed_eof(self) -> None:
        """The connection closed: the end of a body delimited by the close, otherwise an
        error (no head yet, or the body broke off)."""
        if self.complete:
            return
        if self.head is not None and self._close_delimited:
            self.complete = True
            self.keep_alive = False
            return
        if self.head is None:
            raise WireError("the server closed the connection without a complete response head")
        raise WireError("the server closed the connection before the end of the body")

    # --- llhttp callbacks (they never raise: an exception would surface as a parser error) ---

    def on_message_begin(self) -> None:
        if self.complete:
            self._trailing = True
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.complete:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # 100 Continue, 103 Early Hints: not the answer; the answer follows.
            self._informational = True
            return
        self._informational = False
        headers = tuple(self._headers)
        self.head = Head(status, headers)
        self._close_delimited = _close_delimited(status, headers)

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self.complete or self.head is None:
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()


def _close_delimited(status: int, headers: tuple[tuple[bytes, bytes], ...]) -> bool:
    """Whether a response's body runs until the connection closes (RFC 9112 6.3): it has one,
    and neither a ``Content-Length`` nor a final ``chunked`` coding bounds it."""
    if status in (204, 304):
        return False
    for name, value in headers:
        if name == b"content-length":
            return False
        if name == b"transfer-encoding":
            return not value.lower().rstrip(b" \t").endswith(b"chunked")
    return True
