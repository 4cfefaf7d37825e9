"""WebSocket ends written by hand, for tests that need the bytes on the wire: a replica that
answers the upgrade itself and then sends exactly what a test scripts, and a client that does
the same from the other side. Frames are built and read here, masked or not."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
TEXT, BINARY, CONTINUATION, CLOSE, PING, PONG = 0x1, 0x2, 0x0, 0x8, 0x9, 0xA


def accept(key: bytes) -> bytes:
    return base64.b64encode(hashlib.sha1(key + GUID, usedforsecurity=False).digest())


def mask_bytes(payload: bytes, key: bytes) -> bytes:
    return bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def frame(opcode: int, payload: bytes = b"", *, fin: bool = True, masked: bool = False) -> bytes:
    """One frame; ``masked`` (as a client sends) with a random key."""
    first = (0x80 if fin else 0) | opcode
    size = len(payload)
    mask_bit = 0x80 if masked else 0
    if size < 126:
        head = bytes((first, mask_bit | size))
    elif size < 1 << 16:
        head = bytes((first, mask_bit | 126)) + size.to_bytes(2, "big")
    else:
        head = bytes((first, mask_bit | 127)) + size.to_bytes(8, "big")
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + mask_bytes(payload, key)


def close_payload(code: int, reason: bytes = b"") -> bytes:
    return code.to_bytes(2, "big") + reason


class Frame(NamedTuple):
    fin: bool
    opcode: int
    payload: bytes  # unmasked
    masked: bool


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    head = await reader.readexactly(2)
    size = head[1] & 0x7F
    if size == 126:
        size = int.from_bytes(await reader.readexactly(2), "big")
    elif size == 127:
        size = int.from_bytes(await reader.readexactly(8), "big")
    masked = bool(head[1] & 0x80)
    key = await reader.readexactly(4) if masked else b""
    payload = await reader.readexactly(size)
    if masked:
        payload = mask_bytes(payload, key)
    return Frame(bool(head[0] & 0x80), head[0] & 0x0F, payload, masked)


async def read_head(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes]]:
    """An HTTP head: its first line and its fields (lower-cased names)."""
    raw = await reader.readuntil(b"\r\n\r\n")
    first, *lines = raw[:-4].split(b"\r\n")
    fields = {}
    for line in lines:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    return first, fields


@dataclass
class Peer:
    """One upgraded connection, as a test drives it."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    request: dict[bytes, bytes] = field(default_factory=dict)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def frame(self) -> Frame:
        return await read_frame(self.reader)

    def abort(self) -> None:
        self.writer.transport.abort()

    def close(self) -> None:
        self.writer.close()


# Bytes a RawReplica writes with its 101, in the same write (so in the same packet on loopback),
# given the fields of the upgrade request.
First = Callable[[dict[bytes, bytes]], bytes]


class RawReplica:
    """A replica on 127.0.0.1 that answers each upgrade with a 101 (plus ``first``'s bytes in
    the same write) and queues the connection for the test."""

    def __init__(
        self, name: str = "r1", first: First | None = None, head: First | None = None
    ) -> None:
        self.name = name
        self.first = first
        self.head = head  # replaces the 101 head
        self.peers: asyncio.Queue[Peer] = asyncio.Queue()  # connections the test has yet to take
        self.accepted: list[Peer] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> RawReplica:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for peer in self.accepted:
            peer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, fields = await read_head(reader)
        head = (
            self.head(fields)
            if self.head is not None
            else (
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Accept: " + accept(fields[b"sec-websocket-key"]) + b"\r\n\r\n"
            )
        )
        extra = self.first(fields) if self.first is not None else b""
        writer.write(head + extra)
        peer = Peer(reader, writer, fields)
        self.accepted.append(peer)
        await self.peers.put(peer)


class Clients:
    """Client connections made by hand, closed together at the end of a test."""

    def __init__(self) -> None:
        self.opened: list[Peer] = []

    async def connect(self, url: str, path: str, *, pipelined: bytes = b"") -> tuple[Peer, bytes]:
        peer, status = await raw_client(url, path, pipelined=pipelined)
        self.opened.append(peer)
        return peer, status

    def close(self) -> None:
        for peer in self.opened:
            peer.close()


async def raw_client(url: str, path: str, *, pipelined: bytes = b"") -> tuple[Peer, bytes]:
    """An upgraded client connection to ``url`` (unless refused) and the status line of the
    answer; ``pipelined`` is written in the same write as the upgrade request."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    key = base64.b64encode(os.urandom(16))
    writer.write(
        b"GET " + path.encode() + b" HTTP/1.1\r\nHost: edge\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: "
        + key
        + b"\r\n\r\n"
        + pipelined
    )
    status, fields = await read_head(reader)
    if status.startswith(b"HTTP/1.1 101"):
        assert fields[b"sec-websocket-accept"] == accept(key)
    return Peer(reader, writer, fields), status
