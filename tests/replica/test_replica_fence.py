"""A fenced owner in real replica processes over leasefs: two hosts mount one backing directory;
the owner's host is partitioned past its lease, another replica takes the session over, and once
the partition heals the old owner's next commit fails, its WebSocket client is told the session
was superseded and is closed, and nothing it wrote reaches the history."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import websockets

from fleet_sim.leasefs.mount import mount_leasefs
from replica.keyfiles import write_key_file
from replica.store import SessionStore
from tests.harness import eventually, fleet_at, post
from tests.replica.support import (
    Receiver,
    events,
    kind,
    new_sid,
    settled_messages,
    streamed_text,
    ws_session,
)
from wire.names import parse_session_id

pytestmark = [pytest.mark.fuse, pytest.mark.slow]
LEASE_S = 1.0


def test_partitioned_owner_is_fenced_and_told_so(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    sid = new_sid()
    with (
        mount_leasefs(str(backing), str(tmp_path / "hostA"), "hostA", LEASE_S) as host_a,
        mount_leasefs(str(backing), str(tmp_path / "hostB"), "hostB", LEASE_S) as host_b,
        fleet_at(tmp_path / "fleet") as fleet,
    ):
        a = fleet.replica("fa", {"a07-s1": Path(host_a.mountpoint)})
        b = fleet.replica("fb", {"a07-s1": Path(host_b.mountpoint)})
        grant = fleet.grant("acme", sid, sandbox=False)
        statuses: list[int] = []

        async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
            async with ws_session(a, sid, grant) as (ws, _):
                before = await ws.turn("before the partition")
                host_a.control.partition()
                with b.client() as client:

                    def taken() -> bool:
                        statuses.append(post(client, sid, grant, {"type": "get_state"}).status_code)
                        return statuses[-1] == 200

                    # Blocking calls are fine here: A's frames wait in its queue meanwhile.
                    eventually(taken, timeout=20, interval=0.2)
                    message = {"type": "prompt", "message": "after the takeover"}
                    assert post(client, sid, grant, message).status_code == 202
                    settled_messages(client, sid, grant)
                host_a.control.heal()
                await ws.send({"type": "prompt", "message": "late from A"})
                late = await ws.until(lambda f: f["type"] == "session_superseded")
                try:
                    await asyncio.wait_for(ws.ws.recv(), 10)
                    closed = False
                except websockets.ConnectionClosed:
                    closed = True
                return before, late, closed

        started = time.monotonic()
        before, late, closed = asyncio.run(scenario())
        assert time.monotonic() - started < 30
        assert kind(before[-1]) == "turn_ended" and before[-1]["event"]["outcome"] == "succeeded"
        assert statuses[0] == 503 and statuses[-1] == 200
        assert late[-1] == {"type": "session_superseded", "session_id": sid}
        assert "committed" not in [kind(f) for f in late]
        assert closed
        assert "agent_sessions_superseded_total 1.0" in a.scrape()
        assert "agent_sessions_superseded_total 0.0" in b.scrape()
        with a.client() as client:  # the fenced owner let go; the session is B's now
            assert post(client, sid, grant, {"type": "get_state"}).status_code == 503

    dek = fleet.dek("acme")
    history = SessionStore(backing).read("acme", parse_session_id(sid), dek)
    assert [m.content for m in history.transcript.messages if m.role == "user"] == [
        "before the partition",
        "after the takeover",
    ]
    first, second = history.segments
    assert (first.epoch, first.owner, second.epoch, second.owner) == (1, "fa", 2, "fb")
    assert first.bound == first.valid_end == first.size and first.ignored_bytes == 0
    assert first.batches == 2 and second.batches == 2
    dek_file = tmp_path / "acme.dek"
    write_key_file(dek_file, dek)
    verified = subprocess.run(
        [
            sys.executable,
            "-m",
            "replica",
            "store",
            "verify",
            str(backing / "acme" / "sessions" / sid),
            "--dek-file",
            str(dek_file),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert verified.returncode == 0, verified.stderr
    summary = json.loads(verified.stdout)
    assert [s["epoch"] for s in summary["segments"]] == [1, 2]
    assert summary["committed_messages"] == 4 and summary["leaf_id"] == history.transcript.leaf_id


def test_owner_fenced_mid_turn_still_reports_the_run_ended(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    sid = new_sid()
    receiver = Receiver().start()
    try:
        with (
            mount_leasefs(str(backing), str(tmp_path / "hostA"), "hostA", LEASE_S) as host_a,
            mount_leasefs(str(backing), str(tmp_path / "hostB"), "hostB", LEASE_S) as host_b,
            fleet_at(tmp_path / "fleet") as fleet,
        ):
            stub = "stub:ttft=20ms,per_token=40ms,tokens=50"
            a = fleet.replica(
                "fa",
                {"a07-s1": Path(host_a.mountpoint)},
                "--model",
                stub,
                "--lifecycle-url",
                receiver.url,
                # Past its probe's deadline a partitioned replica tells its readers to
                # reconnect (1013), which would race the fence this test is about: its own
                # probes must not call the mount hanging while the reply streams on.
                "--storage-probe-deadline",
                "120",
            )
            b = fleet.replica("fb", {"a07-s1": Path(host_b.mountpoint)})
            grant = fleet.grant("acme", sid, sandbox=False)

            async def scenario() -> list[dict[str, Any]]:
                async with ws_session(a, sid, grant) as (ws, _):
                    await ws.send({"type": "prompt", "message": "a long reply"})
                    frames = await ws.until(lambda f: kind(f) == "text_delta")
                    host_a.control.partition()  # the reply streams on; its commit cannot land
                    with b.client() as client:
                        eventually(
                            lambda: (
                                post(client, sid, grant, {"type": "get_state"}).status_code == 200
                            ),
                            timeout=20,
                            interval=0.2,
                        )
                    frames += await ws.until(lambda _: len(streamed_text(ws.frames).split()) >= 50)
                    host_a.control.heal()
                    frames += await ws.until(lambda f: f["type"] == "session_superseded")
                    with contextlib.suppress(websockets.ConnectionClosed):
                        await asyncio.wait_for(ws.ws.recv(), 10)
                        raise AssertionError("the fenced owner's client was not closed")
                    return frames

            frames = asyncio.run(scenario())
            run_id = events(frames, "turn_started")[0]["run_id"]
            assert "agent_sessions_superseded_total 1.0" in a.scrape()
            history = SessionStore(backing).read("acme", parse_session_id(sid), fleet.dek("acme"))
            assert [m.role for m in history.transcript.messages] == ["user"]
            assert [s.epoch for s in history.segments] == [1, 2]

            def phases() -> list[str]:
                return [e["phase"] for e in receiver.for_session(sid) if e.get("run_id") == run_id]

            assert eventually(phases, timeout=5)[0] == "started"
            try:
                ended = eventually(lambda: phases()[1:], timeout=3)
            except TimeoutError:
                raise AssertionError(
                    f"no run event after the owner was fenced: {phases()}"
                ) from None
            assert ended in (["failed"], ["aborted"])
    finally:
        receiver.stop()
