"""``fleet-sim up`` as a person runs it: a whole fleet, a session through the edge, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import eventually

pytestmark = pytest.mark.slow


def test_up_serves_a_session_through_the_edge_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    out = open(tmp_path / "up.out", "w")  # noqa: SIM115
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleet_sim",
            "up",
            "--dir",
            str(tmp_path / "data"),
            "--listen",
            "127.0.0.1:0",
            "--state",
            str(state),
            "--drain-grace",
            "5",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        eventually(lambda: "export GRANT=" in (tmp_path / "up.out").read_text(), timeout=90)
        info = json.loads(state.read_text())
        assert len(info["replicas"]) == 6
        assert {r["slice"] for r in info["replicas"]} == {"a07", "a08"}
        printed = (tmp_path / "up.out").read_text()
        sid = printed.split("export SID=")[1].split()[0]
        grant = printed.split("export GRANT=")[1].split()[0]
        assert f'curl -N -H "x-beyond-grant: $GRANT" "{info["edge_url"]}' in printed
        chat = subprocess.run(
            [
                sys.executable,
                "-m",
                "fleet_sim",
                "chat",
                "--edge",
                info["edge_url"],
                "--session",
                sid,
                "--grant",
                grant,
                "--message",
                "hi\nrun: echo up-and-running",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert chat.returncode == 0, chat.stderr
        assert "[result] up-and-running" in chat.stdout
        assert "[turn succeeded (stop)]" in chat.stdout
        up.send_signal(signal.SIGINT)
        assert up.wait(90) == 0
        for pid in [r["pid"] for r in info["replicas"]] + [info["edge_pid"]]:
            assert (
                not Path(f"/proc/{pid}").exists()
                or "zombie" in Path(f"/proc/{pid}/status").read_text()
            )
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        out.close()
    shard = sid.partition(".")[0]
    session_dir = tmp_path / "data" / "shards" / shard / "demo" / "sessions" / sid
    assert any(p.name.endswith(".seg") for p in session_dir.iterdir())  # the data stays
