"""The two WebSocket opening handshakes a relayed session takes, as pure decisions.

The edge stands between the two (RFC 6455 4): it checks the client's upgrade request and
computes its ``Sec-WebSocket-Accept`` (:func:`client_handshake`), writes the replica its own
upgrade request with a key of its own and the client's fields (:func:`upgrade_request`), and
checks the replica's 101 (:func:`check_upgrade`). No extension is offered to either side, so the
frames of the two connections are alike and pass through unchanged.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from typing import Final

from edge.core.headers import RawHeaders

_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_CRLF: Final = b"\r\n"
# Versions aiohttp, which answered clients before, accepted; 13 is RFC 6455's.
_VERSIONS: Final = frozenset({b"13", b"8", b"7"})


def accept_value(key: bytes) -> bytes:
    """The ``Sec-WebSocket-Accept`` that answers ``Sec-WebSocket-Key: key``."""
    return base64.b64encode(hashlib.sha1(key + _GUID, usedforsecurity=False).digest())


def new_key() -> bytes:
    """A fresh ``Sec-WebSocket-Key`` (16 random bytes in base64)."""
    return base64.b64encode(os.urandom(16))


def _first(headers: RawHeaders, name: bytes) -> bytes | None:
    for field, value in headers:
        if field.lower() == name:
            return value
    return None


def _tokens(headers: RawHeaders, name: bytes) -> set[bytes]:
    found: set[bytes] = set()
    for field, value in headers:
        if field.lower() == name:
            found.update(t.strip().lower() for t in value.split(b","))
    return found


def client_handshake(headers: RawHeaders) -> bytes | str:
    """The ``Sec-WebSocket-Accept`` for a client's upgrade request, or the reason it is refused
    with a 400 (the checks and words of aiohttp, which answered clients before)."""
    upgrade = _first(headers, b"upgrade")
    if upgrade is None or upgrade.strip().lower() != b"websocket":
        shown = None if upgrade is None else upgrade.decode("latin-1")
        return f'No WebSocket UPGRADE hdr: {shown}\n Can "Upgrade" only to "WebSocket".'
    if b"upgrade" not in _tokens(headers, b"connection"):
        connection = _first(headers, b"connection")
        shown = None if connection is None else connection.decode("latin-1")
        return f"No CONNECTION upgrade hdr: {shown}"
    version = _first(headers, b"sec-websocket-version") or b""
    if version not in _VERSIONS:
        return f"Unsupported version: {version.decode('latin-1')}"
    key = _first(headers, b"sec-websocket-key")
    try:
        if not key or len(base64.b64decode(key)) != 16:
            raise ValueError(key)
    except (binascii.Error, ValueError):
        shown = None if key is None else key.decode("latin-1")
        return f"Handshake error: {shown!r}"
    return accept_value(key)


def upgrade_request(
    target: str,
    fields: RawHeaders,
    *,
    host: bytes,
    key: bytes,
    protocols: tuple[str, ...],
) -> bytes:
    """The upgrade request for a replica: ``fields`` (the client's, without its handshake
    fields: see :func:`edge.core.headers.websocket_headers`), ``host`` if the client sent no
    ``Host``, then the edge's own handshake fields."""
    parts = [b"GET " + target.encode("latin-1") + b" HTTP/1.1\r\n"]
    saw_host = False
    for name, value in fields:
        if name.lower() == b"host":
            saw_host = True
        parts.append(name + b": " + value + _CRLF)
    if not saw_host:
        parts.append(b"Host: " + host + _CRLF)
    parts.append(
        b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: " + key + _CRLF
    )
    if protocols:
        parts.append(b"Sec-WebSocket-Protocol: " + ",".join(protocols).encode() + _CRLF)
    parts.append(_CRLF)
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class Upgrade:
    """A replica's 101 that completes the edge's handshake."""

    protocol: str | None  # the subprotocol it chose among those offered


def check_upgrade(headers: RawHeaders, key: bytes, offered: tuple[str, ...]) -> Upgrade | str:
    """A replica's 101 to the edge's upgrade request with ``key``, or what is wrong with it.

    A subprotocol that was not offered is ignored, as aiohttp did; an extension is refused,
    since none was offered and its frames would not pass through unchanged.
    """
    if (_first(headers, b"upgrade") or b"").strip().lower() != b"websocket":
        return "Invalid upgrade header"
    if b"upgrade" not in _tokens(headers, b"connection"):
        return "Invalid connection header"
    if (_first(headers, b"sec-websocket-accept") or b"").strip() != accept_value(key):
        return "Invalid challenge response"
    if _first(headers, b"sec-websocket-extensions") is not None:
        return "an extension the edge did not offer"
    chosen: str | None = None
    answered = _first(headers, b"sec-websocket-protocol")
    if offered and answered is not None:
        for name in answered.decode("utf-8", "replace").split(","):
            if name.strip() in offered:
                chosen = name.strip()
                break
    return Upgrade(chosen)
