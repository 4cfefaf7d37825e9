"""A WebSocket handshake still in progress when a draining replica stops is answered 503 +
Retry-After (the edge walks on), not 500 (which reached a client in a soak)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import websockets

from replica.store import LOCK_FILE, SessionStore
from tests.harness import eventually_async, fleet_at, post
from wire.names import parse_session_id

pytestmark = pytest.mark.slow


def holds_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has a descriptor open on ``path``."""
    target = str(path.resolve())
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == target:
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def test_handshake_caught_by_shutdown_is_503(tmp_path: Path) -> None:
    with fleet_at(tmp_path) as fleet:
        shard = tmp_path / "s1"
        holder = fleet.replica("holder", {"a07-s1": shard})
        stopping = fleet.replica("stopping", {"a07-s1": shard}, "--drain-grace", "0")
        sid = "a07-s1.handshake"
        grant = fleet.grant("acme", sid, sandbox=False)
        with holder.client() as client:
            assert post(client, sid, grant, {"type": "get_state"}).status_code == 200

        lock = SessionStore(shard).directory("acme", parse_session_id(sid)) / LOCK_FILE

        async def handshake() -> tuple[int, str | None, bytes]:
            # The stopping replica waits up to 0.25 s for the holder's lock (with the lock file
            # open while it does): stop it meanwhile.
            url = stopping.url.replace("http", "ws") + f"/_beyond/agent?session_id={sid}"
            connect = websockets.connect(url, additional_headers={"x-beyond-grant": grant})
            attempt = asyncio.ensure_future(connect.__aenter__())
            await eventually_async(
                lambda: holds_open(stopping.proc.proc.pid, lock),
                timeout=10,
                interval=0.005,
                message="the stopping replica never waited for the session's lock",
            )
            stopping.proc.signal(signal.SIGTERM)
            try:
                await attempt
            except websockets.InvalidStatus as exc:
                body = bytes(exc.response.body or b"")
                return exc.response.status_code, exc.response.headers.get("retry-after"), body
            raise AssertionError("the stopping replica upgraded the connection")

        status, retry_after, body = asyncio.run(handshake())
        assert (status, retry_after) == (503, "1"), body
        assert stopping.proc.wait(20) == 0
