"""No request byte that could be a credential reaches a log, whatever shape the request has.

A fleet runs with ``--log-level debug`` on the edge and the replicas. Each malformed request
below carries its own secret in a credential's place (a grant, a cookie, a bearer token, a
callback token) and goes to the edge and straight to a replica, over a raw socket so nothing
tidies it first. After the fleet has stopped (every log flushed), no log line holds any secret.
"""

from __future__ import annotations

import re
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from fleet_sim.up import LocalFleet
from tests.system.support import local_fleet
from wire.auth import NOTIFY_TOKEN_PREFIX
from wire.http import AGENT_PATH, GRANT_HEADER

pytestmark = pytest.mark.slow


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    secret: str
    request: bytes


def _secret() -> str:
    return "S3CRET" + secrets.token_hex(10)


def _shapes(session_id: str) -> list[Shape]:
    target = f"{AGENT_PATH}?session_id={session_id}".encode()
    shapes: list[Shape] = []

    def add(name: str, build: object) -> None:
        secret = _secret()
        assert callable(build)
        shapes.append(Shape(name, secret, build(secret.encode())))

    head = b"POST " + target + b" HTTP/1.1\r\nHost: edge\r\nConnection: close\r\n"
    body = b'{"type":"get_messages"}'
    sized = b"Content-Length: %d\r\n\r\n" % len(body) + body
    add("DEL after a cookie name", lambda s: head + b"Cookie\x7f: sid=" + s + b"\r\n" + sized)
    add(
        "grant continued on a folded line",
        lambda s: head + GRANT_HEADER.encode() + b": bjn\r\n " + s + b"\r\n" + sized,
    )
    add(
        "NUL inside a bearer value",
        lambda s: head + b"Authorization: Bearer " + s + b"\x00x\r\n" + sized,
    )
    add(
        "control byte in a header name",
        lambda s: head + b"X-To\x01ken: " + s + b"\r\n" + sized,
    )
    add(
        "20 KiB head",
        lambda s: (
            head + b"Authorization: Bearer " + s + b"\r\nX-Pad: " + b"a" * 20480 + b"\r\n" + sized
        ),
    )
    add(
        "truncated chunked body",
        lambda s: (
            head
            + GRANT_HEADER.encode()
            + b": "
            + s
            + b"\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"
        ),
    )
    add(
        "two bearer tokens",
        lambda s: (
            head
            + b"Authorization: Bearer "
            + NOTIFY_TOKEN_PREFIX.encode()
            + s
            + b"\r\nAuthorization: Bearer x\r\n"
            + sized
        ),
    )
    add(
        "a callback token with a tab",
        lambda s: (
            head + b"Authorization: Bearer\t" + NOTIFY_TOKEN_PREFIX.encode() + s + b"\r\n" + sized
        ),
    )
    add(
        "a look-alike token prefix",
        lambda s: head + b"Authorization: bearer bjn_v9." + s + b"\r\n" + sized,
    )
    add("a bad grant", lambda s: head + GRANT_HEADER.encode() + b": " + s + b"\r\n" + sized)
    add(
        "a cookie on a bad request line",
        lambda s: b"GET /_beyond/agent HTTP/1.1 extra\r\nCookie: " + s + b"\r\n\r\n",
    )
    add(
        "a WebSocket handshake with a bad grant",
        lambda s: (
            b"GET " + target + b" HTTP/1.1\r\nHost: edge\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            + GRANT_HEADER.encode()
            + b": "
            + s
            + b"\r\nCookie: c="
            + s
            + b"\r\n\r\n"
        ),
    )
    return shapes


def _send(url: str, request: bytes, *, half_close: bool) -> bytes:
    """Send ``request`` as is and read what comes back until the peer closes or goes quiet."""
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1" and parts.port is not None
    answer = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        sock.sendall(request)
        if half_close:
            sock.shutdown(socket.SHUT_WR)  # a truncated body stays truncated
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if len(answer) > 1 << 20:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    return answer


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    with local_fleet(tmp_path_factory.mktemp("log-hygiene"), "mock", log_level="debug") as local:
        yield local


def test_no_credential_shape_reaches_a_log(fleet: LocalFleet) -> None:
    made = fleet.new_session("acme")
    replica = next(r for _, r in fleet.replicas.values())
    shapes = _shapes(made["session_id"])
    answered: dict[str, bytes] = {}
    for shape in shapes:
        for where, url in (
            ("edge", fleet.edge.url),
            ("replica", replica.url),
            ("the edge's metrics listener", fleet.edge.metrics_url),
            ("a replica's metrics listener", replica.metrics_url),
        ):
            assert url is not None
            answer = _send(url, shape.request, half_close=shape.name == "truncated chunked body")
            answered[f"{shape.name} via {where}"] = answer.partition(b"\r\n")[0]
    # Every shape was refused (or, cut off mid-body, dropped): none is a request to serve.
    served = {
        name: line
        for name, line in answered.items()
        if line and not re.fullmatch(rb"HTTP/1\.[01] 4\d\d .*", line)
    }
    assert served == {}
    fleet.stop(drain_timeout_s=10)  # every process flushes and closes its log
    logs = sorted(Path(fleet.config.state_dir).rglob("*.log"))
    assert any(p.name == "edge.log" for p in logs) and len(logs) >= 3
    text = "\n".join(p.read_text(errors="replace") for p in logs)
    assert text.count("bad request from 127.0.0.1") >= 5  # the edge logged the ones it refused
    leaked = [s.name for s in shapes if s.secret in text]
    assert leaked == [], f"secrets of these shapes reached a log: {leaked}"
