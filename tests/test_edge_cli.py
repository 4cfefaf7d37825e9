from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from edge.cli import main
from edge.ring import Ring
from tests.edge_fakes import FakeReplica, ok

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
    serve_help = fleet_edge("serve", "--help")
    assert serve_help.returncode == 0
    for flag in ("--config", "--listen", "--metrics-listen"):
        assert flag in serve_help.stdout


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


@pytest.mark.anyio
async def test_serve_reloads_on_sighup_and_drains_on_sigterm(tmp_path: Path) -> None:
    replicas = [FakeReplica(name, ok(name.encode())) for name in ("r1", "r2", "r3")]
    for replica in replicas:
        await replica.start()
    config = tmp_path / "edge.toml"
    write_config(config, replicas[:2])
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "edge",
        "serve",
        "--config",
        str(config),
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        cwd=ROOT,
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
        for _ in range(100):
            if (await owners(url, [probe]))[probe] == "r3":
                break
            await asyncio.sleep(0.05)
        after = await owners(url, sids)
        assert {s for s in sids if after[s] != before[s]} == to_r3
        assert after == {s: new_ring.owner(s) for s in sids}

        config.write_text("[edge]\nretry_budget = 5\n")  # a misspelt key: refused
        proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.5)
        assert await owners(url, sids) == after

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        stderr = (await proc.stderr.read()).decode()
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
            r"kind=command outcome=delivered replica=r[123] attempts=1 ms=\d+\.\d",
            line,
        )
        for line in access
    ), access[:3]
