"""The juicefs substrate's relay: a cut drops, never closes; a heal delivers what was held.

Real relay processes in front of a tiny echo server; no JuiceFS or Redis needed. A check that
something does *not* arrive waits a short, fixed time: absence has no event to wait for.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet_sim.juicefs import RelayFailed, RelayProcess
from fleet_sim.juicefs.procs import alive
from fleet_sim.ports import free_port

SILENCE_S = 0.5  # how long "no answer" is watched for


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65_536):
            self.request.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def echo() -> Iterator[_Server]:
    server = _Server(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def relay(echo: _Server, tmp_path: Path) -> Iterator[RelayProcess]:
    process = RelayProcess(echo.server_address[1], tmp_path / "relay.log", budget_s=5.0)
    process.start()
    pid = process.pid
    assert pid is not None
    yield process
    process.stop()
    assert not alive(pid)


def _connect(relay: RelayProcess) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
    conn.settimeout(5)
    return conn


def _silent(conn: socket.socket) -> bool:
    """Nothing arrives, and the connection is not closed either."""
    conn.settimeout(SILENCE_S)
    try:
        data = conn.recv(1024)
    except TimeoutError:
        return True
    finally:
        conn.settimeout(5)
    raise AssertionError(f"expected silence, got {data!r}")


def _read(conn: socket.socket, size: int) -> bytes:
    got = b""
    while len(got) < size:
        chunk = conn.recv(size - len(got))
        if not chunk:
            break
        got += chunk
    return got


def test_relay_forwards_both_ways(relay: RelayProcess) -> None:
    with _connect(relay) as conn:
        conn.sendall(b"ping")
        assert _read(conn, 4) == b"ping"
        payload = bytes(range(256)) * 2048  # past any one read or socket buffer
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        assert _read(conn, len(payload)) == payload
        sender.join(timeout=5)


def test_a_cut_holds_connections_open_unanswered_and_a_heal_delivers(
    relay: RelayProcess,
) -> None:
    with _connect(relay) as old:
        old.sendall(b"before")
        assert _read(old, 6) == b"before"
        relay.partition()
        old.sendall(b"during")
        assert _silent(old)
        # A new connection is accepted, and then nothing: no answer, no close.
        with _connect(relay) as new:
            new.sendall(b"fresh")
            assert _silent(new)
            relay.heal()
            assert _read(old, 6) == b"during"
            assert _read(new, 5) == b"fresh"
        old.sendall(b"after")
        assert _read(old, 5) == b"after"


def test_an_unreachable_target_closes_the_client(tmp_path: Path) -> None:
    process = RelayProcess(free_port(), tmp_path / "relay.log", budget_s=5.0)
    process.start()
    try:
        with _connect(process) as conn:
            assert conn.recv(16) == b""  # as a refused connection would end
    finally:
        process.stop()


def test_a_dead_relay_is_an_error_naming_its_log(relay: RelayProcess, tmp_path: Path) -> None:
    assert relay._proc is not None
    relay._proc.kill()
    relay._proc.wait(timeout=5)
    with pytest.raises(RelayFailed, match=str(tmp_path / "relay.log")):
        relay.partition()
