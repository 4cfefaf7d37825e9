"""``fleet-sim up`` keeps its fleet up, and ``fleet-sim fault`` faults it, as a person types them:
the installed entry points, run from a directory of their own with their default ``--dir``
(./fleet-data) and ``--state``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.harness import eventually

pytestmark = pytest.mark.slow

FLEET_SIM = str(Path(sys.executable).parent / "fleet-sim")


@dataclass
class Up:
    """A running ``fleet-sim up`` and what a person at its terminal sees."""

    cwd: Path
    proc: subprocess.Popen[bytes]
    out: IO[bytes]

    @property
    def state_file(self) -> Path:
        return self.cwd / "fleet-data" / "state.json"  # up's default, and fault's

    def state(self) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(self.state_file.read_text())
        return found

    def printed(self) -> str:
        return (self.cwd / "up.out").read_text()

    def fault(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [FLEET_SIM, "fault", *args], cwd=self.cwd, capture_output=True, text=True, timeout=60
        )

    def status(self) -> dict[str, dict[str, str]]:
        done = self.fault("status")
        assert done.returncode == 0, done.stderr
        rows = [line.split() for line in done.stdout.splitlines()[1:]]
        return {r[0]: {"pid": r[1], "state": r[2], "restarts": r[3]} for r in rows}

    def replica(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = next(r for r in self.state()["replicas"] if r["name"] == name)
        return found

    def owner(self, session_id: str, other_than: str = "") -> tuple[str, int] | None:
        """The replica that owns ``session_id`` now (other than ``other_than``: a fenced owner
        may list it until it notices), and the epoch it holds it at."""
        for replica in self.state()["replicas"]:
            if replica["name"] == other_than:
                continue
            url = replica["metrics_url"].replace("/metrics", "/sessions")
            try:
                listed = httpx.get(url, timeout=2).json()
            except httpx.HTTPError:
                continue
            for session in listed["sessions"]:
                if session["session_id"] == session_id:
                    return replica["name"], int(session["epoch"])
        return None

    def chat(self, session_id: str, grant: str, message: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                FLEET_SIM,
                "chat",
                "--edge",
                self.state()["edge_url"],
                "--session",
                session_id,
                "--grant",
                grant,
                "--message",
                message,
            ],
            capture_output=True,
            text=True,
            timeout=150,
        )

    def session(self) -> tuple[str, str]:
        url = f"{self.state()['control_plane_url']}/v1/sessions"
        made = httpx.post(url, json={"tenant": "demo"}, timeout=10).json()
        return made["session_id"], made["grant"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(120)
        finally:
            self.out.close()


def start_up(cwd: Path, *extra: str) -> Up:
    cwd.mkdir(parents=True, exist_ok=True)
    out = open(cwd / "up.out", "wb")  # noqa: SIM115 - the child holds it; closed with the test
    proc = subprocess.Popen(
        [
            FLEET_SIM,
            "up",
            "--listen",
            "127.0.0.1:0",
            "--web-listen",
            "off",
            "--drain-grace",
            "5",
            *extra,
        ],
        cwd=cwd,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    up = Up(cwd, proc, out)
    try:
        eventually(lambda: proc.poll() is not None or "export GRANT=" in up.printed(), 120)
        assert proc.poll() is None, up.printed()
    except BaseException:
        up.stop()
        raise
    return up


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    running = start_up(tmp_path_factory.mktemp("up"))
    yield running
    assert running.stop() == 0
    assert not running.state_file.exists()  # no running fleet: a fault finds none


def _restarted(up: Up, name: str, count: int) -> bool:
    row = up.status()[name]
    return row["state"] == "up" and int(row["restarts"]) >= count


@pytest.mark.parametrize("name", ["r3", "edge", "control-plane", "sandbox", "model"])
def test_a_killed_process_is_reported_and_started_again_where_it_was(up: Up, name: str) -> None:
    before = up.state()
    old_pid = up.status()[name]["pid"]
    done = up.fault("kill", name)
    assert done.returncode == 0, done.stderr
    assert f"killed {name} (pid {old_pid}) with SIGKILL" in done.stdout
    eventually(lambda: _restarted(up, name, 1), 60)
    after = up.state()
    assert up.status()[name]["pid"] != old_pid
    assert f"{name} ({'replica' if name == 'r3' else name}) was killed by SIGKILL (log: " in (
        up.printed()
    )
    # Same address: nothing that names it (grants, the edge's config, replicas) has to change.
    for key in ("edge_url", "control_plane_url", "sandbox_url", "model_url"):
        assert after[key] == before[key]
    assert [r["url"] for r in after["replicas"]] == [r["url"] for r in before["replicas"]]
    pid_key = {"edge": "edge_pid", "control-plane": "control_plane_pid"}.get(name)
    if pid_key:
        assert after[pid_key] == int(up.status()[name]["pid"])
    # The fleet still serves a whole turn (model, sandbox and control plane included).
    session_id, grant = up.session()
    chat = up.chat(session_id, grant, "hi\nrun: echo still-serving")
    assert chat.returncode == 0, chat.stderr
    assert "[result] still-serving" in chat.stdout


def test_the_session_goes_on_after_its_owner_is_killed(up: Up) -> None:
    session_id, grant = up.session()
    assert up.chat(session_id, grant, "first").returncode == 0
    owner = eventually(lambda: up.owner(session_id), 10)
    done = up.fault("kill", owner[0])
    assert done.returncode == 0, done.stderr
    chat = up.chat(session_id, grant, "second\nrun: echo after-the-kill")
    assert chat.returncode == 0, chat.stderr
    assert "[result] after-the-kill" in chat.stdout
    # Whoever holds it now (a survivor, or the killed replica started again) holds it at a new
    # epoch: the killed owner's segment is sealed.
    eventually(lambda: (now := up.owner(session_id)) is not None and now[1] > owner[1], 10)


def test_freeze_thaw_and_drain(up: Up) -> None:
    pid = int(up.status()["r2"]["pid"])
    assert up.fault("freeze", "r2").returncode == 0
    assert up.status()["r2"]["state"] == "frozen"
    assert "State:\tT" in Path(f"/proc/{pid}/status").read_text()
    again = up.fault("freeze", "r2")
    assert again.returncode == 1 and "already frozen" in again.stderr
    assert up.fault("thaw", "r2").returncode == 0
    assert "State:\tT" not in Path(f"/proc/{pid}/status").read_text()
    restarts = int(up.status()["r2"]["restarts"])
    done = up.fault("drain", "r2")
    assert done.returncode == 0 and "SIGTERM" in done.stdout
    eventually(lambda: _restarted(up, "r2", restarts + 1), 60)
    assert "r2 (replica) exited with status 0" in up.printed()


def test_fault_refuses_what_it_cannot_do(up: Up, tmp_path: Path) -> None:
    unknown = up.fault("kill", "r99")
    assert unknown.returncode == 1
    assert "no process named 'r99'" in unknown.stderr and "r1" in unknown.stderr
    partition = up.fault("partition", "r1")
    assert partition.returncode == 1
    assert "not possible on local-dir" in partition.stderr
    of_edge = up.fault("hang", "edge")
    assert of_edge.returncode == 1 and "applies to a replica" in of_edge.stderr
    thaw = up.fault("thaw", "r1")
    assert thaw.returncode == 1 and "not frozen" in thaw.stderr
    verb = up.fault("explode", "r1")
    assert verb.returncode == 2 and "invalid choice" in verb.stderr
    target = up.fault("kill")
    assert target.returncode == 2 and "needs a TARGET" in target.stderr
    nobody = up.fault("kill", "r1", "--state", str(tmp_path / "none.json"))
    assert nobody.returncode == 1 and "no running fleet" in nobody.stderr
    assert up.status()["r1"]["state"] == "up"


def test_restart_never_leaves_a_dead_process_down_until_asked(tmp_path: Path) -> None:
    up = start_up(tmp_path, "--restart", "never")
    try:
        pid = up.status()["r1"]["pid"]
        assert up.fault("kill", "r1").returncode == 0
        eventually(lambda: up.status()["r1"]["state"] == "down", 30)
        assert "r1 (replica) was killed by SIGKILL" in up.printed()
        assert "left down (--restart never)" in up.printed()
        kill_again = up.fault("kill", "r1")
        assert kill_again.returncode == 1 and "not running (down)" in kill_again.stderr
        url = up.replica("r1")["url"]
        assert up.fault("restart", "r1").returncode == 0
        eventually(lambda: _restarted(up, "r1", 1), 60)
        assert up.status()["r1"]["pid"] != pid
        assert up.replica("r1")["url"] == url
        assert up.replica("r1")["pid"] == int(up.status()["r1"]["pid"])
        # restart of a running process: it drains, then starts at once (no backoff).
        assert up.fault("restart", "edge").returncode == 0
        eventually(lambda: _restarted(up, "edge", 1), 60)
    finally:
        assert up.stop() == 0


def test_a_process_that_cannot_stay_up_stops_the_fleet_with_the_reason(tmp_path: Path) -> None:
    up = start_up(tmp_path)
    blocker = socket.socket()
    try:
        model_port = urlsplit(up.state()["model_url"]).port
        assert model_port is not None
        assert up.fault("kill", "model").returncode == 0
        # Its address is taken before the first restart is due (0.5 s), so every start fails.
        eventually(lambda: _bind(blocker, model_port), 5, interval=0.005)
        assert up.proc.wait(90) == 1
        printed = up.printed()
        assert "model (model) failed to start" in printed
        assert "stopping the fleet: model (model) cannot stay up: 5 failed starts in 60 s" in (
            printed
        )
    finally:
        blocker.close()
        up.stop()


def _bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    sock.listen()
    return True


@pytest.mark.fuse
def test_up_on_leasefs_names_mounts_and_a_partitioned_owner_is_taken_over(tmp_path: Path) -> None:
    up = start_up(tmp_path, "--substrate", "leasefs")
    try:
        state = up.state()
        assert state["substrate"] == "leasefs"
        for replica in state["replicas"]:
            mount = Path(replica["mount"])
            mounts = Path("/proc/mounts").read_text().splitlines()
            assert any(line.split()[1] == str(mount) for line in mounts)
            assert all(Path(p).parent == mount for p in replica["shards"].values())
            assert replica["fs_pids"] and all(
                Path(f"/proc/{p}").exists() for p in replica["fs_pids"]
            )
        session_id, grant = up.session()
        assert up.chat(session_id, grant, "before").returncode == 0
        owner = eventually(lambda: up.owner(session_id), 10)
        done = up.fault("partition", owner[0])
        assert done.returncode == 0, done.stderr
        assert up.status()[owner[0]]["state"] == "up"  # the process runs on; its storage does not
        chat = up.chat(session_id, grant, "after\nrun: echo taken-over")
        assert chat.returncode == 0, chat.stderr
        assert "[result] taken-over" in chat.stdout
        moved = eventually(lambda: up.owner(session_id, other_than=owner[0]), 10)
        assert moved[1] > owner[1]
        assert up.fault("heal", owner[0]).returncode == 0
    finally:
        assert up.stop() == 0


@pytest.mark.juicefs
def test_up_on_juicefs_freezes_a_host_with_its_client_and_restarts_the_metadata(
    tmp_path: Path,
) -> None:
    up = start_up(tmp_path, "--substrate", "juicefs")
    try:
        replica = up.replica("r1")
        assert Path(replica["mount"]).is_dir() and len(replica["fs_pids"]) == 2
        frozen = up.fault("freeze", "r1")
        assert frozen.returncode == 0, frozen.stderr
        for pid in [replica["pid"], *replica["fs_pids"]]:
            assert "State:\tT" in Path(f"/proc/{pid}/status").read_text()
        assert up.fault("thaw", "r1").returncode == 0
        for pid in [replica["pid"], *replica["fs_pids"]]:
            assert "State:\tT" not in Path(f"/proc/{pid}/status").read_text()
        session_id, grant = up.session()
        assert up.chat(session_id, grant, "before").returncode == 0
        restarted = up.fault("metadata-restart", "metadata")
        assert restarted.returncode == 0, restarted.stderr
        chat = up.chat(session_id, grant, "after\nrun: echo metadata-back")
        assert chat.returncode == 0, chat.stderr
        assert "[result] metadata-back" in chat.stdout
        wrong = up.fault("metadata-restart", "r1")
        assert wrong.returncode == 1 and "takes the target `metadata`" in wrong.stderr
    finally:
        assert up.stop() == 0
    assert str(tmp_path) not in Path("/proc/mounts").read_text()
