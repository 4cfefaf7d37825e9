"""The POST load clients of ``bench.loadgen`` against a real HTTP/1.1 server on loopback: what
they send, and that ``vary`` makes every request's head different."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench.loadgen import LoadClient, PythonClient, WrkClient, ensure_binary, interleaved

BODY = b'{"type":"get_state"}'


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.ids: list[str | None] = []
        self.bodies: set[bytes] = set()
        self.status = 200
        self.order: list[int] | None = None  # shared between servers: who served each request

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/_beyond/agent?session_id=a07-s1.x"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Recorder

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.ids.append(self.headers.get("x-request-id"))
            self.server.bodies.add(body)
            if self.server.order is not None:
                self.server.order.append(self.server.server_address[1])
        self.send_response(self.server.status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def running() -> Iterator[Recorder]:
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    with running() as server:
        yield server


def _clients(tmp_path: Path) -> list[LoadClient]:
    wrk, missing = ensure_binary("wrk", "wrk")
    assert wrk is not None, missing  # the test command installs it; CI must have it
    return [PythonClient(), WrkClient(wrk, tmp_path)]


@pytest.mark.parametrize("which", [0, 1], ids=["python", "wrk"])
def test_each_request_carries_its_own_value_of_the_varied_header(
    which: int, recorder: Recorder, tmp_path: Path
) -> None:
    client = _clients(tmp_path)[which]
    result = client.run(recorder.url, {"x-beyond-grant": "g"}, BODY, 2, 60, 2, "x-request-id")
    assert result.errors == 0 and result.requests >= 60
    assert recorder.bodies == {BODY}
    assert None not in recorder.ids
    assert len(set(recorder.ids)) == len(recorder.ids) >= 60


@pytest.mark.parametrize("which", [0, 1], ids=["python", "wrk"])
def test_without_vary_every_request_is_the_same(
    which: int, recorder: Recorder, tmp_path: Path
) -> None:
    client = _clients(tmp_path)[which]
    result = client.run(recorder.url, {"x-beyond-grant": "g"}, BODY, 2, 60, 2)
    assert result.errors == 0 and result.requests >= 60
    assert recorder.bodies == {BODY} and set(recorder.ids) == {None}


def test_interleaved_requests_take_turns_in_a_rotating_order() -> None:
    order: list[int] = []
    with running() as a, running() as b, running() as c:
        for server in (a, b, c):
            server.order = order
        urls = {"a": a.url, "b": b.url, "c": c.url}
        latencies = interleaved(urls, {"x-beyond-grant": "g"}, BODY, 4, 30)
        ports = [s.server_address[1] for s in (a, b, c)]
    assert {name: len(values) for name, values in latencies.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(0 < value < 30 for values in latencies.values() for value in values)
    a_, b_, c_ = ports
    assert order == [a_, b_, c_, b_, c_, a_, c_, a_, b_, a_, b_, c_]


def test_interleaved_stops_at_its_time_bound_and_refuses_a_failed_answer() -> None:
    with running() as a, running() as b:
        latencies = interleaved({"a": a.url, "b": b.url}, {}, BODY, 10**9, 0.5)
        assert 0 < len(latencies["a"]) < 10**9 and len(latencies["a"]) == len(latencies["b"])
        b.status = 503
        with pytest.raises(RuntimeError, match="answered 503"):
            interleaved({"a": a.url, "b": b.url}, {}, BODY, 3, 30)
