"""Raw HTTP/1.1 on a socket, for the edge's wire tests: client libraries normalise headers and
framing, these helpers send and read exactly the bytes."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator


async def send_raw(port: int, data: bytes) -> tuple[int, bytes]:
    """One request on its own connection, as bytes: client libraries normalise headers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        status = int(head.split(b" ", 2)[1])
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        body = await reader.readexactly(int(length.group(1))) if length else b""
        return status, body
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    fields: dict[bytes, bytes] = {}
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.rstrip(b"\r\n").partition(b":")
        fields[name.strip().lower()] = value.strip()
    if b"content-length" in fields:
        body = await reader.readexactly(int(fields[b"content-length"]))
    elif fields.get(b"transfer-encoding") == b"chunked":
        parts = []
        while (size := int((await reader.readline()).strip(), 16)) > 0:
            parts.append(await reader.readexactly(size))
            await reader.readline()
        await reader.readline()
        body = b"".join(parts)
    else:
        body = await reader.read()
    return status, fields, body


@contextlib.asynccontextmanager
async def connected(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
