from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from edge.cli import main
from edge.core.ring import Ring
from tests.edge.fakes import FakeReplica, ok
from tests.harness import eventually_async
from wire.names import MAX_REPLICA_NAME
from wire.ring_hash import ring_hash

# The installed entry point, as a person types it (not ``python -m edge`` from the repo).
FLEET_EDGE = shutil.which("fleet-edge", path=str(Path(sys.executable).parent))


def fleet_edge(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert FLEET_EDGE is not None, f"fleet-edge is not installed next to {sys.executable}"
    return subprocess.run(
        [FLEET_EDGE, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
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


def test_ring_places_replicas_named_by_address() -> None:
    names = ("10.0.4.17:9000", "10.0.4.18:9000", "[fd00::9]:9000", "r/../" + "x" * 250)
    ids = [f"a07-s1.{i:04d}" for i in range(50)]
    proc = fleet_edge("ring", *(arg for n in names for arg in ("--replica", n)), *ids)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    # Computed here from the contract: positions h("name#i"), the owner the first at or after
    # h(id), wrapping; the walk then takes each replica once, clockwise.
    points = sorted((ring_hash(f"{n}#{i}".encode()), n) for n in names for i in range(64))
    lines = proc.stdout.splitlines()
    assert len(lines) == len(ids)
    for sid, line in zip(ids, lines, strict=True):
        h = ring_hash(sid.encode())
        start = next((k for k, (pos, _) in enumerate(points) if pos >= h), 0)
        walk: list[str] = []
        for k in range(len(points)):
            name = points[(start + k) % len(points)][1]
            if name not in walk:
                walk.append(name)
        assert line == " ".join((sid, *walk))
        assert line == " ".join((sid, *Ring(names).walk(sid)))
    assert {line.split(" ")[1] for line in lines} == set(names)  # everyone owns something


def test_ring_two_host_port_replicas_as_in_the_issue() -> None:
    proc = fleet_edge(
        "ring", "--replica", "10.0.4.17:9000", "--replica", "10.0.4.18:9000", "SOMEID"
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout
        == f"SOMEID {' '.join(Ring(('10.0.4.17:9000', '10.0.4.18:9000')).walk('SOMEID'))}\n"
    )


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("r 1", "has ' ' at position 1"),
        ("r\t1", "has '\\t' at position 1"),
        ("r\u00e9", "has '\\xe9' at position 1"),
        (os.fsdecode(b"r\xe9"), "has '\\udce9' at position 1"),  # a byte that is not UTF-8
        ("r\x01", "has '\\x01' at position 1"),
        ("\x7f", "has '\\x7f' at position 0"),
        ("", "replica name is empty"),
        ("r" * (MAX_REPLICA_NAME + 1), "is 256 bytes long"),
    ],
)
def test_ring_refuses_a_replica_name_outside_the_rule(name: str, why: str) -> None:
    proc = fleet_edge("ring", "--replica", "r1", "--replica", name, "a07-s1.x")
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("fleet-edge ring: --replica: replica name ")
    assert why in line
    assert line.endswith(
        "a replica name is 1-255 bytes of printable ASCII without whitespace (0x21-0x7e), "
        "e.g. r1 or 10.0.4.17:9000"
    )


def test_ring_takes_a_name_of_255_bytes() -> None:
    longest = "r" * MAX_REPLICA_NAME
    proc = fleet_edge("ring", "--replica", longest, "a07-s1.x")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"a07-s1.x {longest}\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ring", "a07-s1.x"], "--replica"),
        (["ring", "--replica", "r1"], "SESSION_ID"),
        (["ring", "--replica", "r1", "--replica", "r1", "x.y"], "more than once"),
        (["ring", "--replica", "r1", "--vnodes", "0", "x.y"], "--vnodes"),
        (["ring", "--replica", "r1", "--vnodes", "lots", "x.y"], "--vnodes"),
        (["ring", "--replica", "r1", "a b"], "without spaces"),
        (["ring", "--replica", "r1", "a\tb"], "without spaces"),
        (["ring", "--replica", "r1", ""], "without spaces"),
        ([], "COMMAND"),
        (["route"], "invalid choice"),
        (["serve", "--config", "missing.toml", "--listen", "127.0.0.1:8080"], "cannot read config"),
        (["serve", "--config", "missing.toml", "--listen", "8080"], "--listen must be HOST:PORT"),
        (
            [
                "serve",
                "--config",
                "x.toml",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "0.0.0.0:9",
            ],
            "loopback only",
        ),
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
    flat = " ".join(ring_help.stdout.split())
    assert "printable ASCII without whitespace, 1-255 bytes" in flat
    assert "10.0.4.17:9000" in flat
    serve_help = fleet_edge("serve", "--help")
    assert serve_help.returncode == 0
    for flag in ("--config", "--listen", "--metrics-listen"):
        assert flag in serve_help.stdout


def test_a_bad_flag_exits_2_with_one_error_line(tmp_path: Path) -> None:
    proc = fleet_edge("ring", "--replica", "r1", "--bogus", "a07-s1.x", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["fleet-edge: error: unrecognized arguments: --bogus"], proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_main_returns_codes_instead_of_exiting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ring", "--replica", "r1", "a07-s1.x"]) == 0
    assert capsys.readouterr().out == "a07-s1.x r1\n"
    assert main(["ring", "--replica", "r1"]) == 2
    assert main(["--help"]) == 0


# --- fleet-edge serve as a real process ----------------------------------------------------------


def write_config(path: Path, replicas: list[FakeReplica]) -> None:
    entries = ", ".join(f'{{ name = "{r.name}", url = "{r.url}" }}' for r in replicas)
    path.write_text(
        f'[edge]\nretry_budget_s = 2\n\n[[slice]]\nname = "a07"\nreplicas = [{entries}]\n'
    )


async def owners(url: str, sids: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    async with aiohttp.ClientSession() as client:
        for sid in sids:
            async with client.post(f"{url}/_beyond/agent?session_id={sid}", data=b"{}") as resp:
                assert resp.status == 200
                found[sid] = (await resp.read()).decode()
    return found


async def said_until(stream: asyncio.StreamReader, text: str, wait_s: float) -> str:
    """What ``stream`` says up to and including the first line that holds ``text``."""
    lines: list[bytes] = []
    try:
        async with asyncio.timeout(wait_s):
            while not lines or text.encode() not in lines[-1]:
                line = await stream.readline()
                assert line, f"the stream ended before {text!r}: {b''.join(lines)!r}"
                lines.append(line)
    except TimeoutError:
        raise TimeoutError(f"no {text!r} in {wait_s} s: {b''.join(lines)[-2000:]!r}") from None
    return b"".join(lines).decode()


@pytest.mark.anyio
async def test_serve_reloads_on_sighup_and_drains_on_sigterm(tmp_path: Path) -> None:
    replicas = [FakeReplica(name, ok(name.encode())) for name in ("r1", "r2", "r3")]
    for replica in replicas:
        await replica.start()
    config = tmp_path / "edge.toml"
    write_config(config, replicas[:2])
    assert FLEET_EDGE is not None
    # Started as a person would, from the config's directory with a relative path: a reload
    # reads the same file.
    proc = await asyncio.create_subprocess_exec(
        FLEET_EDGE,
        "serve",
        "--config",
        "edge.toml",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        url = line.strip().rpartition(" ")[2]
        assert url.startswith("http://127.0.0.1:")
        sids = [f"a07-s1.proc{i}" for i in range(30)]
        before = await owners(url, sids)
        new_ring = Ring(("r1", "r2", "r3"))
        to_r3 = {s for s in sids if new_ring.owner(s) == "r3"}
        assert to_r3 and before == {s: Ring(("r1", "r2")).owner(s) for s in sids}

        write_config(config, replicas)
        proc.send_signal(signal.SIGHUP)
        probe = sorted(to_r3)[0]

        async def moved() -> bool:
            return (await owners(url, [probe]))[probe] == "r3"

        await eventually_async(moved, timeout=5.0, interval=0.05)
        after = await owners(url, sids)
        assert {s for s in sids if after[s] != before[s]} == to_r3
        assert after == {s: new_ring.owner(s) for s in sids}

        config.write_text("[edge]\nretry_budget = 5\n")  # a misspelt key: refused
        proc.send_signal(signal.SIGHUP)
        said = await said_until(proc.stderr, "config reload failed", 20)
        assert await owners(url, sids) == after

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        stderr = said + (await proc.stderr.read()).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for replica in replicas:
            await replica.close()
    assert "config reloaded" in stderr
    assert "config reload failed, still serving the previous config" in stderr
    assert "retry_budget" in stderr and "edge stopped" in stderr
    assert "session_id=" not in stderr and "Traceback" not in stderr
    # One access line per request, written in batches and flushed at shutdown.
    access = [line for line in stderr.splitlines() if " INFO edge.access: " in line]
    assert len(access) >= 90
    assert all(
        re.fullmatch(
            r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO edge\.access: POST /_beyond/agent 200 "
            r"kind=command lane=(fast|express) outcome=delivered replica=r[123] attempts=1 "
            r"ms=\d+\.\d",
            line,
        )
        for line in access
    ), access[:3]
