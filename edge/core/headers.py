"""Header rewriting between the client and a replica: hop-by-hop fields out, nothing else touched.

A proxy owns each of its two connections, so the fields that describe a connection rather than
the message (RFC 9110 7.6.1: ``Connection`` and every field it names, ``Keep-Alive``,
``Proxy-*``, ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``) are dropped in both
directions. Everything else passes byte for byte, in order, with its original case: the edge
works on raw header pairs and never decodes a value it does not need to read.

Two exceptions, both for the request side:

* a job-end callback keeps its ``Content-Length`` and ``Transfer-Encoding`` exactly as received
  (rule E2: forwarded unchanged); its body is then re-framed to match them;
* ``Expect`` is consumed by the edge (it answers ``100 Continue`` itself before buffering the
  body), so it is not sent on.

Any other request has its body buffered and re-sent with a ``Content-Length`` of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from wire.http import RETRY_AFTER_HEADER

RawHeaders = Sequence[tuple[bytes, bytes]]

# The name to compare lower-cased raw field names with.
RETRY_AFTER_FIELD = RETRY_AFTER_HEADER.lower().encode("ascii")

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Bodies are re-framed by the edge, and Expect is answered by the edge.
REFRAMED = HOP_BY_HOP | {b"content-length", b"expect"}
_CALLBACK_DROP = (HOP_BY_HOP - {b"transfer-encoding"}) | {b"expect"}
# The edge writes its own handshake for the replica side of a WebSocket.
_WS_HANDSHAKE = HOP_BY_HOP | {
    b"content-length",
    b"expect",
    b"sec-websocket-key",
    b"sec-websocket-version",
    b"sec-websocket-extensions",
    b"sec-websocket-protocol",
    b"sec-websocket-accept",
}
_RESPONSE_REFRAMED = HOP_BY_HOP | {b"content-length"}
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_CRLF = b"\r\n"
# A header line in the form on which every HTTP/1.1 parser agrees byte for byte: a token, a
# colon, optional spaces or tabs, then a printable-ASCII value with no trailing space (a
# regular-expression fragment, for the fast lane's request heads and replicas' response heads).
CANONICAL_FIELD = (
    rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[ \t]*(?:[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?)?"
)


def connection_tokens(headers: RawHeaders) -> frozenset[bytes]:
    """Lower-cased field names listed in ``Connection`` (they are hop-by-hop too)."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b","))
    tokens.discard(b"")
    return frozenset(tokens)


def _drop_set(headers: RawHeaders, base: frozenset[bytes]) -> frozenset[bytes]:
    # Only "close" / "keep-alive" / "upgrade" in Connection is the common case: skip the union.
    extra = connection_tokens(headers) - {b"close", b"keep-alive", b"upgrade"}
    return base | extra if extra else base


def has_header(headers: RawHeaders, name: bytes) -> bool:
    return any(n.lower() == name for n, _ in headers)


def request_head(
    method: str,
    target: str,
    headers: RawHeaders,
    *,
    host: bytes,
    body_length: int,
    keep_framing: bool = False,
) -> bytes:
    """The request line and header block for a replica, ending in the blank line.

    ``host`` is used only when the client sent no ``Host`` (HTTP/1.0). With ``keep_framing``
    (callbacks) ``Content-Length`` / ``Transfer-Encoding`` are kept as received; otherwise the
    body is announced with ``Content-Length: body_length`` (omitted for an empty body on a
    method that carries none).
    """
    drop = _drop_set(headers, _CALLBACK_DROP if keep_framing else REFRAMED)
    parts = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1")]
    append = parts.append
    saw_host = False
    for name, value in headers:
        lower = name.lower()
        if lower in drop:
            continue
        if lower == b"host":
            saw_host = True
        append(name + b": " + value + _CRLF)
    if not saw_host:
        append(b"Host: " + host + _CRLF)
    if not keep_framing and (body_length or method in _BODY_METHODS):
        append(b"Content-Length: %d\r\n" % body_length)
    append(_CRLF)
    return b"".join(parts)


def chunked_body(body: bytes) -> bytes:
    """``body`` as one chunk plus the terminator (the re-framing of a chunked callback)."""
    if not body:
        return b"0\r\n\r\n"
    return b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"


def is_chunked(headers: RawHeaders) -> bool:
    for name, value in headers:
        if name.lower() == b"transfer-encoding" and b"chunked" in value.lower():
            return True
    return False


def declared_length(headers: RawHeaders) -> int | None:
    """The ``Content-Length`` a response declares, if it declares exactly one valid one."""
    found: int | None = None
    for name, value in headers:
        if name.lower() == b"content-length":
            if found is not None or not value.isdigit():
                return None
            found = int(value)
    return found


def _text(value: bytes) -> str:
    # aiohttp serialises header values as UTF-8: decode so that valid UTF-8 round-trips
    # exactly; anything else is replaced rather than letting one odd byte fail the response.
    return value.decode("utf-8", "replace")


def response_headers(headers: RawHeaders, *, keep_length: bool) -> list[tuple[str, str]]:
    """A replica's response fields for the client, as ``str`` pairs for aiohttp.

    ``keep_length=False`` drops ``Content-Length`` too, for a body the edge hands to aiohttp
    whole (aiohttp then writes the length of what it actually sends).
    """
    drop = _drop_set(headers, HOP_BY_HOP if keep_length else HOP_BY_HOP | {b"content-length"})
    return [(_text(n), _text(v)) for n, v in headers if n.lower() not in drop]


def response_fields(headers: RawHeaders) -> bytes:
    """A replica's response fields for the client as raw header lines, without hop-by-hop
    fields and without ``Content-Length`` (the fast lane writes the framing itself)."""
    lines: list[bytes] = []
    for name, value in headers:
        lower = name.lower()
        if lower == b"connection":  # it may name more fields to drop: the general rule
            drop = _drop_set(headers, _RESPONSE_REFRAMED)
            return b"".join(n + b": " + v + _CRLF for n, v in headers if n.lower() not in drop)
        if lower not in _RESPONSE_REFRAMED:
            lines.append(name + b": " + value + _CRLF)
    return b"".join(lines)


def websocket_headers(headers: RawHeaders) -> list[tuple[bytes, bytes]]:
    """The client's handshake fields to send on to the replica (its grant, cookies, origin...),
    as received."""
    drop = _drop_set(headers, _WS_HANDSHAKE)
    return [(n, v) for n, v in headers if n.lower() not in drop]


def websocket_protocols(headers: RawHeaders) -> tuple[str, ...]:
    """The subprotocols the client offered, in its order of preference."""
    offered: list[str] = []
    for name, value in headers:
        if name.lower() == b"sec-websocket-protocol":
            offered.extend(p.strip() for p in _text(value).split(",") if p.strip())
    return tuple(offered)
