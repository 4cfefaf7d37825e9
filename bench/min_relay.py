"""The least a Python relay can do per request: the floor the edge is measured against.

``python -m bench.min_relay --listen 127.0.0.1:0 --upstream http://127.0.0.1:PORT`` relays
HTTP/1.1 keep-alive requests framed by ``Content-Length`` to one upstream, on uvloop, with one
upstream connection per client connection and no parsing beyond finding where each message
ends: no routing, no header checks, no retries, no metrics, no logs. It prints its URL once
listening. It is a benchmark peer, not a proxy anyone should run: it trusts both sides to send
well-formed, length-framed messages (the benchmark's do).

What the edge costs per request above this relay is what its routing, checks, placement,
metrics and access log cost, in the same language on the same event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import cast
from urllib.parse import urlsplit

import uvloop


def message_end(buffer: bytearray) -> int:
    """Where the first whole message in ``buffer`` ends, or -1 while it is incomplete."""
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return -1
    length = 0
    at = buffer.lower().find(b"\r\ncontent-length:", 0, head_end)
    if at >= 0:
        line_end = buffer.find(b"\r\n", at + 2, head_end + 2)
        length = int(buffer[at + 17 : line_end])
    end = head_end + 4 + length
    return end if len(buffer) >= end else -1


class _Upstream(asyncio.Protocol):
    def __init__(self, client: _Client) -> None:
        self.client = client
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := message_end(self.buffer)) >= 0:
            self.client.send(bytes(self.buffer[:end]))
            del self.buffer[:end]

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Client(asyncio.Protocol):
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self.waiting: list[bytes] = []  # requests read before the upstream connection is up
        self._connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_task(self._connect(loop))

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            _, upstream = await loop.create_connection(
                lambda: _Upstream(self), self.host, self.port
            )
        except OSError:
            self.close()
            return
        self.upstream = upstream
        for request in self.waiting:
            self._forward(request)
        self.waiting.clear()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := message_end(self.buffer)) >= 0:
            request = bytes(self.buffer[:end])
            del self.buffer[:end]
            if self.upstream is None:
                self.waiting.append(request)
            else:
                self._forward(request)

    def _forward(self, request: bytes) -> None:
        assert self.upstream is not None and self.upstream.transport is not None
        self.upstream.transport.write(request)

    def send(self, response: bytes) -> None:
        if self.transport is not None:
            self.transport.write(response)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()


async def _serve(listen: str, upstream: str) -> None:
    host, _, port = listen.rpartition(":")
    target = urlsplit(upstream)
    if target.hostname is None or target.port is None:
        raise SystemExit(f"--upstream must be http://HOST:PORT, got {upstream!r}")
    up_host, up_port = target.hostname, target.port
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(up_host, up_port), host, int(port))
    print(f"http://{host}:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A minimal keep-alive relay (benchmark peer).")
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    parser.add_argument("--upstream", required=True, metavar="http://HOST:PORT")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(_serve(args.listen, args.upstream))
    return 0


if __name__ == "__main__":
    sys.exit(main())
