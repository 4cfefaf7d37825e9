"""Load generators and minimal protocol clients for the benchmarks, cheap enough per request or
frame that the server measured, not the client, sets the pace.

- :class:`WrkClient` drives ``wrk`` (Debian's package, installed by :func:`ensure_binary` when
  missing and running as root) with a Lua script: POST bodies, a grant header, a count bound per
  thread and the latency percentiles it records in C;
- :class:`PythonClient` is the stand-in when wrk cannot be had: keep-alive raw sockets on one
  event loop (slower, so its rates say as much about this process as about the server);
- :func:`interleaved` takes turns between several paths to one backend, one request at a time,
  for what each path adds in latency;
- :class:`RawWebSocket` and :class:`SseReader` read frames and events straight off a socket.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httptools

INSTALL_TIMEOUT_S: Final = 600.0
SOCKET_TIMEOUT_S: Final = 120.0


# --- tools ----------------------------------------------------------------------------------------


def find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for folder in ("/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"):
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def ensure_binary(name: str, package: str) -> tuple[str | None, str | None]:
    """``(path, None)`` once ``name`` is installed, installing Debian's ``package`` as root if
    needed; ``(None, reason)`` when it cannot be had."""
    found = find_binary(name)
    if found:
        return found, None
    if os.geteuid() != 0:
        return None, f"{name} is not installed and this is not root (apt-get install {package})"
    if find_binary("apt-get") is None:
        return None, f"{name} is not installed and there is no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", package]
    for step in ([install], [["apt-get", "update", "-qq"], install]):
        print(f"installing {package} ...", file=sys.stderr, flush=True)
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            for argv in step:
                subprocess.run(
                    argv, env=env, check=True, capture_output=True, timeout=INSTALL_TIMEOUT_S
                )
        found = find_binary(name)
        if found:
            return found, None
    return None, f"apt-get install {package} failed"


# --- POST load ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadResult:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int  # non-2xx answers and socket errors

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


# wrk reports its whole -d as the duration even when every thread stopped early at its count, so
# the wall time is taken here: from the first request sent to the last response, per thread.
_WRK_SCRIPT: Final = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct {{ long tv_sec; long tv_nsec; }} bench_timespec;
int clock_gettime(int clock, bench_timespec *ts);
]]
local ts = ffi.new("bench_timespec")
local function now_us()
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) * 1e6 + tonumber(ts.tv_nsec) / 1e3
end
wrk.method = "POST"
wrk.body = {body}
{headers}
local limit = {limit}
local vary = {vary}
local threads = {{}}
function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end
function init(args) seen = 0; bad = 0; first = 0; last = 0; sent = 0 end
function request()
  if first == 0 then first = now_us() end
  if vary == nil then return wrk.request() end
  sent = sent + 1
  wrk.headers[vary] = tid .. "-" .. sent
  return wrk.format()
end
function response(status, headers, body)
  seen = seen + 1
  last = now_us()
  if status < 200 or status > 299 then bad = bad + 1 end
  if seen >= limit then wrk.thread:stop() end
end
function done(summary, latency, requests)
  local bad_total, first_all, last_all = 0, math.huge, 0
  for _, t in ipairs(threads) do
    bad_total = bad_total + t:get("bad")
    if t:get("first") > 0 then first_all = math.min(first_all, t:get("first")) end
    last_all = math.max(last_all, t:get("last"))
  end
  local wall = first_all < math.huge and last_all - first_all or 0
  local e = summary.errors
  io.write(string.format(
    '{{"requests":%d,"wall_us":%d,"p50_us":%d,"p99_us":%d,"bad":%d,"socket_errors":%d}}\\n',
    summary.requests, wall, latency:percentile(50), latency:percentile(99),
    bad_total, e.connect + e.read + e.write + e.timeout))
end
"""


class WrkClient:
    name = "wrk"

    def __init__(self, binary: str, scratch: Path) -> None:
        self.binary = binary
        self.scratch = scratch

    def run(
        self,
        url: str,
        headers: dict[str, str],
        body: bytes,
        connections: int,
        count: int,
        seconds: int,
        vary: str | None = None,
    ) -> LoadResult:
        """POST ``body`` on ``connections`` keep-alive connections until ``count`` answers or
        ``seconds`` have passed (wrk itself always runs the whole ``seconds``). With ``vary``,
        each request carries that header with a value no other request has."""
        threads = min(2, connections)
        script = self.scratch / f"post-{connections}.lua"
        lines = [f"wrk.headers[{_lua(k)}] = {_lua(v)}" for k, v in headers.items()]
        script.write_text(
            _WRK_SCRIPT.format(
                body=_lua(body.decode()),
                headers="\n".join(lines),
                limit=math.ceil(count / threads),
                vary="nil" if vary is None else _lua(vary),
            )
        )
        argv = [self.binary, f"-t{threads}", f"-c{connections}", f"-d{seconds}s"]
        argv += ["--timeout", "10s", "-s", str(script), url]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=seconds + 30, check=False
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr[-500:]}")
        out = json.loads(lines[-1])
        if out["requests"] == 0 or out["wall_us"] <= 0:
            raise RuntimeError(f"wrk completed no request to {url}: {done.stdout[-500:]}")
        return LoadResult(
            out["requests"],
            out["wall_us"] / 1e6,
            out["p50_us"] / 1e3,
            out["p99_us"] / 1e3,
            out["bad"] + out["socket_errors"],
        )


def _lua(text: str) -> str:
    """A Lua string literal (JSON's escapes are a subset of Lua's for these ASCII values)."""
    if not text.isascii() or not text.isprintable():
        raise ValueError("wrk scripts here carry printable ASCII only")
    return json.dumps(text)


class PythonClient:
    """Keep-alive raw-socket clients on one event loop; slower than wrk, so rates through it are
    bounded by this process as much as by the server."""

    name = "python"

    def run(
        self,
        url: str,
        headers: dict[str, str],
        body: bytes,
        connections: int,
        count: int,
        seconds: int,
        vary: str | None = None,
    ) -> LoadResult:
        """As :meth:`WrkClient.run`."""
        return asyncio.run(self._run(url, headers, body, connections, count, seconds, vary))

    async def _run(
        self,
        url: str,
        headers: dict[str, str],
        body: bytes,
        connections: int,
        count: int,
        seconds: int,
        vary: str | None,
    ) -> LoadResult:
        host, port, target = split_url(url)
        sent = 0

        def request() -> bytes:
            nonlocal sent
            sent += 1
            fields = headers if vary is None else {**headers, vary: str(sent)}
            return _request_head("POST", target, f"{host}:{port}", fields, len(body)) + body

        same = request() if vary is None else None
        latencies: list[float] = []
        errors = 0
        deadline = time.perf_counter() + seconds
        remaining = [count]

        async def worker() -> None:
            nonlocal errors
            reader, writer = await asyncio.open_connection(host, port)
            try:
                while remaining[0] > 0 and time.perf_counter() < deadline:
                    remaining[0] -= 1
                    started = time.perf_counter()
                    writer.write(same or request())
                    head = await reader.readuntil(b"\r\n\r\n")
                    status, length = status_and_length(head)
                    await reader.readexactly(length)
                    latencies.append(time.perf_counter() - started)
                    if not 200 <= status < 300:
                        errors += 1
                    if b"\r\nconnection: close" in head.lower():
                        writer.close()
                        reader, writer = await asyncio.open_connection(host, port)
            finally:
                writer.close()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(connections)))
        wall = time.perf_counter() - started
        if not latencies:
            raise RuntimeError(f"no request to {url} completed")
        latencies.sort()
        return LoadResult(
            len(latencies),
            wall,
            statistics.median(latencies) * 1e3,
            latencies[max(0, math.ceil(len(latencies) * 0.99) - 1)] * 1e3,
            errors,
        )


LoadClient = WrkClient | PythonClient


def split_url(url: str) -> tuple[str, int, str]:
    match = re.fullmatch(r"http://([^/:]+):(\d+)(/.*)", url)
    if match is None:
        raise ValueError(f"not an http://host:port/path URL: {url}")
    return match.group(1), int(match.group(2)), match.group(3)


def _request_head(
    method: str, target: str, host: str, headers: dict[str, str], length: int | None
) -> bytes:
    fields = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if length is not None:
        fields += f"content-length: {length}\r\n"
    return f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n{fields}\r\n".encode()


def post_once(url: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
    """One POST on a fresh connection that the server closes: ``(status, whole answer)``."""
    host, port, target = split_url(url)
    head = _request_head(
        "POST", target, f"{host}:{port}", {**headers, "connection": "close"}, len(body)
    )
    with socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def status_and_length(head: bytes) -> tuple[int, int]:
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return status, int(value)
    raise RuntimeError("response without content-length")


class _KeptConnection:
    """One blocking keep-alive connection POSTing the same request, one at a time."""

    def __init__(self, url: str, headers: dict[str, str], body: bytes) -> None:
        host, port, target = split_url(url)
        self.address = (host, port)
        self.request = _request_head("POST", target, f"{host}:{port}", headers, len(body)) + body
        self.sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=SOCKET_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def exchange(self) -> tuple[int, float]:
        """Send the request and read the whole answer: its status and the seconds it took."""
        started = time.perf_counter()
        self.sock.sendall(self.request)
        data = b""
        need = -1
        while need < 0 or len(data) < need:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError(f"{self.address} closed the connection mid-answer")
            data += chunk
            end = data.find(b"\r\n\r\n")
            if need < 0 and end >= 0:
                status, length = status_and_length(data[: end + 4])
                need = end + 4 + length
        took = time.perf_counter() - started
        if b"\r\nconnection: close" in data[:need].lower():
            self.sock.close()
            self.sock = self._connect()
        return status, took

    def close(self) -> None:
        self.sock.close()


def interleaved(
    urls: dict[str, str], headers: dict[str, str], body: bytes, count: int, seconds: float
) -> dict[str, list[float]]:
    """One request at a time, taking turns between ``urls`` (one keep-alive connection each,
    the order rotating every round), until each has had ``count`` or ``seconds`` have passed:
    each one's latencies in seconds. A drift in the backend's own latency lands on every URL
    alike, so the difference between two medians is what one path adds over the other; the
    client's own cost is the same on every path and cancels out."""
    names = list(urls)
    connections = {name: _KeptConnection(url, headers, body) for name, url in urls.items()}
    latencies: dict[str, list[float]] = {name: [] for name in names}
    deadline = time.perf_counter() + seconds
    try:
        for turn in range(count):
            if time.perf_counter() >= deadline:
                break
            shift = turn % len(names)
            for name in names[shift:] + names[:shift]:
                status, took = connections[name].exchange()
                if not 200 <= status < 300:
                    raise RuntimeError(f"{urls[name]} answered {status}")
                latencies[name].append(took)
    finally:
        for connection in connections.values():
            connection.close()
    return latencies


# --- a minimal WebSocket client (blocking socket: cheap per frame) --------------------------------


class RawWebSocket:
    """Just enough of RFC 6455 to open a socket, send masked text frames and count what comes
    back; reading whole frames from a buffer costs far less per frame than a full client."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        host, port, target = split_url(url)
        self.sock = socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = base64.b64encode(os.urandom(16))
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.sock.sendall(
            (
                f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                f"Sec-WebSocket-Key: {key.decode()}\r\n{extra}\r\n"
            ).encode()
        )
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("closed during the WebSocket handshake")
            buffer += chunk
        head, _, rest = buffer.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101"):
            raise RuntimeError(f"WebSocket handshake refused: {head[:200]!r}")
        self.buffer = bytearray(rest)

    def send_text(self, payload: bytes) -> None:
        self.sock.sendall(client_frame(0x1, payload))

    def send_many(self, payload: bytes, count: int) -> None:
        self.sock.sendall(client_frame(0x1, payload) * count)

    def messages(self) -> Iterator[tuple[int, bytes]]:
        """Each frame as ``(opcode, payload)`` until the socket closes (server frames are
        never masked; the servers measured never fragment a message)."""
        buffer = self.buffer
        while True:
            while True:
                size = len(buffer)
                if size < 2:
                    break
                length = buffer[1] & 0x7F
                start = 2
                if length == 126:
                    if size < 4:
                        break
                    length = int.from_bytes(buffer[2:4], "big")
                    start = 4
                elif length == 127:
                    if size < 10:
                        break
                    length = int.from_bytes(buffer[2:10], "big")
                    start = 10
                end = start + length
                if size < end:
                    break
                opcode = buffer[0] & 0x0F
                payload = bytes(buffer[start:end])
                del buffer[:end]
                yield opcode, payload
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return
            buffer += chunk

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(client_frame(0x8, (1000).to_bytes(2, "big")))
        self.sock.close()


def client_frame(opcode: int, payload: bytes) -> bytes:
    """One final frame as a client must send it: masked, with a fresh key."""
    mask = os.urandom(4)
    length = len(payload)
    if length < 126:
        head = bytes([0x80 | opcode, 0x80 | length])
    elif length < 65536:
        head = bytes([0x80 | opcode, 0x80 | 126]) + length.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + length.to_bytes(8, "big")
    return head + mask + unmask(payload, mask)


def unmask(payload: bytes, mask: bytes) -> bytes:
    """XOR with the 4-byte mask, repeated (masking and unmasking are the same operation)."""
    if not payload:
        return b""
    length = len(payload)
    key = (mask * (length // 4 + 1))[:length]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(length, "big")


def server_frame(opcode: int, payload: bytes) -> bytes:
    """One final, unmasked frame, as a server sends it."""
    length = len(payload)
    if length < 126:
        return bytes([0x80 | opcode, length]) + payload
    if length < 65536:
        return bytes([0x80 | opcode, 126]) + length.to_bytes(2, "big") + payload
    return bytes([0x80 | opcode, 127]) + length.to_bytes(8, "big") + payload


# --- a minimal SSE client -------------------------------------------------------------------------


class SseReader:
    """A ``GET`` of an event stream; :meth:`events` yields each event's raw text as it arrives
    (llhttp undoes the chunked framing; events end at a blank line, CRLF or LF)."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        host, port, target = split_url(url)
        self.sock = socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_S)
        self._pending = bytearray()
        self._ready: list[bytes] = []
        self._parser = httptools.HttpResponseParser(self)
        fields = {"accept": "text/event-stream", **headers}
        self.sock.sendall(_request_head("GET", target, f"{host}:{port}", fields, None))

    @property
    def status(self) -> int:
        return int(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        pending = self._pending
        pending.extend(body)
        while True:
            # sse-starlette ends lines with CRLF; a plain LF stream is just as valid.
            found = [(i, len(s)) for s in (b"\r\n\r\n", b"\n\n") if (i := pending.find(s)) >= 0]
            if not found:
                return
            end, size = min(found)
            self._ready.append(bytes(pending[:end]))
            del pending[: end + size]

    def events(self) -> Iterator[bytes]:
        while True:
            ready = self._ready
            if ready:
                self._ready = []
                yield from ready
                continue
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return
            self._parser.feed_data(chunk)

    def close(self) -> None:
        self.sock.close()
