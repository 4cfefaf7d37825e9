"""The attached substrate end to end: deploy/attached-local/up.sh starts a fleet of its own (each
replica in a network namespace of its own, here on bind mounts since CI has no kernel NFS), and
``fleet-sim matrix --substrate attached`` drives it from outside through fault.sh.

It needs root (namespaces, mounts, a system user). CI runs as root and must run it: with ``CI``
set, a machine that cannot is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet_sim.ports import free_port

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "deploy" / "attached-local"
NET = "10.232.7"  # not the harness's default, so a fleet started by hand is not touched


def _cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, mounts)"
    missing = [c for c in ("ip", "nsenter", "unshare", "setpriv", "socat") if not shutil.which(c)]
    if missing:
        return f"missing commands: {', '.join(missing)} (scripts/bootstrap installs them)"
    if Path("/run/netns/fa-r1").exists():
        return "another attached-local fleet is running here (fa-r1 exists): down.sh it first"
    return None


@pytest.fixture(scope="module")
def attached() -> Iterator[dict[str, str]]:
    reason = _cannot_run()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the attached-local test: {reason}")
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="fleet-attached-", dir="/tmp"))
    root.chmod(0o755)  # the fleet runs as its own user and must reach its files
    env = {
        **os.environ,
        "ATTACHED_ROOT": str(root),
        "ATTACHED_STORAGE": "bind",
        "ATTACHED_NET": NET,
        "ATTACHED_EDGE_PORT": str(free_port()),
        "ATTACHED_DRAIN_GRACE_S": "5",
        "ATTACHED_FLEET_BIN": str(Path(sys.executable).parent),
    }
    try:
        up = subprocess.run(
            [str(HARNESS / "up.sh")], env=env, capture_output=True, text=True, timeout=240
        )
        assert up.returncode == 0, up.stdout + up.stderr
        yield env
    finally:
        subprocess.run(
            [str(HARNESS / "down.sh"), "--purge"], env=env, capture_output=True, timeout=240
        )
        shutil.rmtree(root, ignore_errors=True)


def test_the_state_file_describes_the_fleet_the_matrix_reads(attached: dict[str, str]) -> None:
    state = json.loads((Path(attached["ATTACHED_ROOT"]) / "state.json").read_text())
    assert (state["substrate"], state["storage"]) == ("attached-local", "bind")
    assert sorted(state["shards"]) == ["a07-s1", "a07-s2", "a08-s1", "a08-s2"]
    assert [r["name"] for r in state["replicas"]] == ["r1", "r2", "r3", "r4", "r5", "r6"]
    assert all(r["url"].startswith(f"http://{NET}.") for r in state["replicas"])


def test_matrix_on_an_attached_fleet(attached: dict[str, str], tmp_path: Path) -> None:
    chosen = [
        "takeover-after-hard-kill",  # kills a replica: the runner must restore it afterwards
        "unmounted-shard-is-misdirected",  # ... or this one, next, meets a refused connection
        "owner-refuses-non-owner",
        "one-tenant-cannot-read-another",
        "fenced-owner-stops-and-says-so",  # a partition: bind mounts cannot, fault.sh exits 3
    ]
    state = Path(attached["ATTACHED_ROOT"]) / "state.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleet_sim",
            "matrix",
            "--substrate",
            "attached",
            "--state",
            str(state),
            "--fault-cmd",
            str(HARNESS / "fault.sh"),
            "--quick",
            "--results",
            str(tmp_path),
            *(arg for name in chosen for arg in ("--only", name)),
        ],
        env=attached,
        capture_output=True,
        text=True,
        timeout=420,
    )
    output = proc.stdout + proc.stderr
    run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("results: "))
    results = {r["scenario"]: r for r in json.loads((run_dir / "results.json").read_text())}
    assert sorted(results) == sorted(chosen), output
    for name in chosen[:-1]:
        assert results[name]["verdict"] == "pass", (name, results[name])
    assert results["takeover-after-hard-kill"]["restarted_after"] == [
        results["takeover-after-hard-kill"]["notes"]["takeover"]["victim"]
    ]
    skipped = results["fenced-owner-stops-and-says-so"]
    assert skipped["verdict"] == "skipped"
    assert "needs NFS storage" in skipped["error"]
    assert proc.returncode == 0, output


def test_attached_flags_are_checked_before_anything_runs(tmp_path: Path) -> None:
    def matrix(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fleet_sim", "matrix", "--results", str(tmp_path), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    missing = matrix("--substrate", "attached")
    assert missing.returncode == 2
    assert "needs --state FILE" in missing.stderr
    (tmp_path / "state.json").write_text('{"edge_url": "http://127.0.0.1:1"}')
    bad = matrix(
        "--substrate",
        "attached",
        "--state",
        str(tmp_path / "state.json"),
        "--fault-cmd",
        str(HARNESS / "fault.sh"),
    )
    assert bad.returncode == 2
    assert "not an attached fleet's state" in bad.stderr
    stray = matrix("--substrate", "local-dir", "--state", str(tmp_path / "state.json"))
    assert stray.returncode == 2
    assert "go with --substrate attached" in stray.stderr
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # nothing ran, no run directory
