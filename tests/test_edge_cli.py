from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from edge.cli import main
from edge.ring import Ring

ROOT = Path(__file__).resolve().parent.parent


def fleet_edge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edge", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_ring_prints_id_then_walk_order() -> None:
    ids = ["a07-s1.abc", "a07-s1.def", "a07-s2.0123456789", "b2-x.y"]
    proc = fleet_edge("ring", "--replica", "r1", "--replica", "r2", "--replica", "r3", *ids)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    ring = Ring(("r1", "r2", "r3"))
    assert proc.stdout == "".join(f"{sid} {' '.join(ring.walk(sid))}\n" for sid in ids)
    for line in proc.stdout.splitlines():
        sid, *walk = line.split(" ")
        assert sorted(walk) == ["r1", "r2", "r3"] and walk[0] == ring.owner(sid)


def test_ring_vnodes_changes_the_layout() -> None:
    ids = [f"a07-s1.{i:04d}" for i in range(40)]
    args = ["ring", "--replica", "r1", "--replica", "r2", "--replica", "r3", "--vnodes", "2"]
    proc = fleet_edge(*args, *ids)
    assert proc.returncode == 0, proc.stderr
    ring = Ring(("r1", "r2", "r3"), vnodes=2)
    assert proc.stdout.splitlines() == [" ".join((sid, *ring.walk(sid))) for sid in ids]
    assert proc.stdout != fleet_edge(*args[:-2], *ids).stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ring", "a07-s1.x"], "--replica"),
        (["ring", "--replica", "r1"], "SESSION_ID"),
        (["ring", "--replica", "r1", "--replica", "r1", "x.y"], "more than once"),
        (["ring", "--replica", "bad/name", "x.y"], "replica name must be"),
        (["ring", "--replica", "r1", "--vnodes", "0", "x.y"], "--vnodes"),
        (["ring", "--replica", "r1", "--vnodes", "lots", "x.y"], "--vnodes"),
        (["ring", "--replica", "r1", "a b"], "without spaces"),
        (["ring", "--replica", "r1", "a\tb"], "without spaces"),
        (["ring", "--replica", "r1", ""], "without spaces"),
        ([], "COMMAND"),
        (["route"], "invalid choice"),
        (["serve", "--config", "edge.toml", "--listen", "127.0.0.1:8080"], "not implemented"),
    ],
)
def test_bad_input_exits_2_without_traceback(args: list[str], message: str) -> None:
    proc = fleet_edge(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_describes_the_commands() -> None:
    proc = fleet_edge("--help")
    assert proc.returncode == 0
    assert "ring" in proc.stdout and "serve" in proc.stdout
    ring_help = fleet_edge("ring", "--help")
    assert ring_help.returncode == 0
    assert "--replica NAME" in ring_help.stdout and "--vnodes" in ring_help.stdout
    serve_help = fleet_edge("serve", "--help")
    assert serve_help.returncode == 0
    for flag in ("--config", "--listen", "--metrics-listen"):
        assert flag in serve_help.stdout


def test_main_returns_codes_instead_of_exiting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ring", "--replica", "r1", "a07-s1.x"]) == 0
    assert capsys.readouterr().out == "a07-s1.x r1\n"
    assert main(["ring", "--replica", "r1"]) == 2
    assert main(["--help"]) == 0
