"""What the edge benchmark puts beside or behind the edge: a tiny backend and nginx.

The tiny backend (``python -m bench.edge_backend --listen 127.0.0.1:0``, prints one JSON line
with its URL once listening) answers as fast as a server can, so that a proxy in front of it
shows its own limits rather than the replica's:

- HTTP/1.1 keep-alive: any request gets ``FAST_BODY`` at once;
- an upgrade to WebSocket (any path): a text frame ``burst N`` is answered with N small frames
  then ``done``; any other data frame is echoed.

nginx (Debian's) runs with one worker and ``hash $arg_session_id consistent;`` upstreams over
the same replica and the same tiny backend, keep-alive on both sides, access log off: nginx at
its best is the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast

from bench.loadgen import server_frame, unmask
from bench.replica_bench import cpu_seconds
from fleet_sim.ports import free_port

START_TIMEOUT_S: Final = 20.0
# About the size of a replica's get_state answer.
FAST_BODY: Final = (
    b'{"type":"response","id":"c1","command":"get_state","success":true,'
    b'"data":{"session_id":"a08-s1.fast","leaf_id":null,"messages":0,"running":false}}'
)
# One frame of a burst: shaped like a text delta.
BURST_PAYLOAD: Final = (
    b'{"type":"event","event":{"kind":"text_delta","run_id":"r1","text":"word "}}'
)
BURST_BATCH: Final = 512
_WS_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class _Backend(asyncio.Protocol):
    """HTTP/1.1 keep-alive: a POST gets ``FAST_BODY`` at once; an upgrade becomes a WebSocket
    that answers ``burst N`` with N small frames then ``done``, and echoes anything else."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.websocket = False
        self.can_write: asyncio.Event = asyncio.Event()
        self.can_write.set()
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.websocket:
            self._frames()
        else:
            self._requests()

    def _requests(self) -> None:
        assert self.transport is not None
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).decode("latin-1")
            fields = {}
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip()
            body_length = int(fields.get("content-length", "0"))
            if len(self.buffer) < end + 4 + body_length:
                return
            del self.buffer[: end + 4 + body_length]
            if "websocket" in fields.get("upgrade", "").lower():
                key = fields["sec-websocket-key"].encode()
                accept = base64.b64encode(
                    hashlib.sha1(key + _WS_GUID, usedforsecurity=False).digest()
                ).decode()
                self.transport.write(
                    (
                        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                        f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
                    ).encode()
                )
                self.websocket = True
                self._frames()
                return
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(FAST_BODY)).encode() + b"\r\n\r\n" + FAST_BODY
            )

    def _frames(self) -> None:
        assert self.transport is not None
        buffer = self.buffer
        out: list[bytes] = []
        while len(buffer) >= 2:
            length = buffer[1] & 0x7F
            start = 2
            if length == 126:
                if len(buffer) < 4:
                    break
                length, start = int.from_bytes(buffer[2:4], "big"), 4
            elif length == 127:
                if len(buffer) < 10:
                    break
                length, start = int.from_bytes(buffer[2:10], "big"), 10
            masked = buffer[1] & 0x80
            if masked:
                start += 4
            if len(buffer) < start + length:
                break
            opcode = buffer[0] & 0x0F
            payload = bytes(buffer[start : start + length])
            if masked:
                payload = unmask(payload, bytes(buffer[start - 4 : start]))
            del buffer[: start + length]
            if opcode == 0x8:
                self.transport.write(b"".join(out) + server_frame(0x8, payload[:2]))
                self.transport.close()
                return
            if opcode == 0x9:
                out.append(server_frame(0xA, payload))
            elif opcode in (0x1, 0x2) and payload.startswith(b"burst "):
                task = asyncio.get_running_loop().create_task(self._burst(int(payload[6:])))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif opcode in (0x1, 0x2):
                out.append(server_frame(opcode, payload))
        if out:
            self.transport.write(b"".join(out))

    async def _burst(self, count: int) -> None:
        assert self.transport is not None
        frame = server_frame(0x1, BURST_PAYLOAD)
        sent = 0
        while sent < count and not self.transport.is_closing():
            n = min(BURST_BATCH, count - sent)
            await self.can_write.wait()
            self.transport.write(frame * n)
            sent += n
        self.transport.write(server_frame(0x1, b"done"))


async def _serve_backend(listen: str) -> None:
    host, _, port = listen.rpartition(":")
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Backend, host, int(port))
    bound = server.sockets[0].getsockname()
    print(json.dumps({"url": f"http://{bound[0]}:{bound[1]}"}), flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A tiny HTTP and WebSocket backend.")
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    listen: str = parser.parse_args(argv).listen
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_backend(listen))
    return 0


# --- nginx ----------------------------------------------------------------------------------------


_NGINX_CONF: Final = """
{user}worker_processes 1;
daemon off;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  # The default (1000) closes a client connection every thousand requests; the edge never does.
  keepalive_requests 1000000;
  client_body_temp_path {root}/body;
  proxy_temp_path {root}/proxy;
  fastcgi_temp_path {root}/fastcgi;
  uwsgi_temp_path {root}/uwsgi;
  scgi_temp_path {root}/scgi;
  upstream replica {{
    hash $arg_session_id consistent;
    server {replica};
    keepalive 64;
  }}
  upstream fast {{
    hash $arg_session_id consistent;
    server {fast};
    keepalive 64;
  }}
  server {{
    listen 127.0.0.1:{replica_port};
    location / {{
      proxy_pass http://replica;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
  server {{
    listen 127.0.0.1:{fast_port};
    location / {{
      proxy_pass http://fast;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
}}
"""


@dataclass
class Nginx:
    proc: subprocess.Popen[bytes]
    replica_url: str
    fast_url: str
    version: str

    def cpu_seconds(self) -> float:
        """The worker's CPU (plus the master's, which is idle while serving)."""
        pid = self.proc.pid
        total = cpu_seconds(pid)
        children = Path(f"/proc/{pid}/task/{pid}/children")
        with contextlib.suppress(OSError):
            for child in children.read_text().split():
                with contextlib.suppress(OSError):
                    total += cpu_seconds(int(child))
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_nginx(binary: str, root: Path, replica_url: str, fast_url: str) -> Nginx:
    root.mkdir(parents=True, exist_ok=True)
    replica_port, fast_port = free_port(), free_port()
    conf = root / "nginx.conf"
    conf.write_text(
        _NGINX_CONF.format(
            # As root the workers would otherwise drop to a user who cannot enter this directory.
            user="user root;\n" if os.geteuid() == 0 else "",
            root=root,
            replica=replica_url.removeprefix("http://"),
            fast=fast_url.removeprefix("http://"),
            replica_port=replica_port,
            fast_port=fast_port,
        )
    )
    version = (
        subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
        .stderr.strip()
        .removeprefix("nginx version: ")
    )
    proc = subprocess.Popen(
        [binary, "-p", str(root), "-c", str(conf), "-e", str(root / "error.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    nginx = Nginx(
        proc, f"http://127.0.0.1:{replica_port}", f"http://127.0.0.1:{fast_port}", version
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = root / "error.log"
            raise RuntimeError(f"nginx exited: {log.read_text()[-1000:] if log.exists() else ''}")
        try:
            for port in (replica_port, fast_port):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return nginx
        except OSError:
            time.sleep(0.05)
    nginx.stop()
    raise TimeoutError("nginx did not listen in time")


if __name__ == "__main__":
    raise SystemExit(main())
