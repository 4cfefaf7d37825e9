"""``fleet-sim list | run | matrix | soak`` as a person types them: the installed entry point, run
from a directory of their own, with the defaults. Every path the commands hand to the fleet's
processes is made absolute when the flags are parsed, so the default ``--results`` (``results``,
relative) works wherever the command is started."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleet_sim.sim import commands
from tests.harness import eventually

BIN = Path(sys.executable).parent
FLEET_SIM = shutil.which("fleet-sim", path=str(BIN))


def fleet_sim(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    assert FLEET_SIM is not None, f"fleet-sim is not installed next to {sys.executable}"
    return subprocess.run(
        [FLEET_SIM, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def run_results(proc: subprocess.CompletedProcess[str]) -> tuple[Path, list[dict[str, object]]]:
    """The run directory the command printed last, and the results it wrote there."""
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("results: "), proc.stdout + proc.stderr
    run_dir = Path(last.removeprefix("results: "))
    return run_dir, json.loads((run_dir / "results.json").read_text())


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleet-sim")
    commands.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


# --- the paths, as parsed ------------------------------------------------------------------------


def test_default_results_is_absolute_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for argv in (
        ("run", "owner-refuses-non-owner"),
        ("matrix", "--substrate", "local-dir"),
        ("soak",),
    ):
        assert parse(*argv).results == Path.cwd() / "results"
    assert parse("soak", "--results", "out/../runs").results == Path.cwd() / "runs"
    assert parse("soak", "--results", "/abs/runs").results == Path("/abs/runs")


def test_attached_paths_are_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "fault.sh").write_text("#!/bin/sh\n")
    args = parse(
        "run", "owner-refuses-non-owner", "--substrate", "attached",
        "--state", "state.json", "--fault-cmd", "bin/fault.sh",
    )  # fmt: skip
    assert args.state == Path.cwd() / "state.json"
    assert args.fault_cmd == str(Path.cwd() / "bin" / "fault.sh")
    # A bare name is a command looked up on PATH, as a shell would; a path to nothing is left
    # as typed, so the refusal names what was typed.
    assert parse("matrix", "--substrate", "attached", "--fault-cmd", "fault.sh").fault_cmd == (
        "fault.sh"
    )
    missing = parse("matrix", "--substrate", "attached", "--fault-cmd", "bin/nothing.sh")
    assert missing.fault_cmd == "bin/nothing.sh"


def test_a_relative_state_file_is_found_from_another_directory(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text('{"edge_url": "http://127.0.0.1:1"}')
    fault = tmp_path / "fault.sh"
    fault.write_text("#!/bin/sh\nexit 0\n")
    fault.chmod(0o755)
    proc = fleet_sim(
        tmp_path, "matrix", "--substrate", "attached", "--state", "state.json",
        "--fault-cmd", "./fault.sh",
    )  # fmt: skip
    # The file was found and read (as the wrong kind of file), not reported missing.
    assert proc.returncode == 2, proc.stderr
    assert "not an attached fleet's state" in proc.stderr
    assert "no state file" not in proc.stderr and "not an executable" not in proc.stderr
    assert not (tmp_path / "results").exists()  # refused before anything ran


# --- the installed entry point ---------------------------------------------------------------


def test_help_and_a_bad_flag(tmp_path: Path) -> None:
    helped = fleet_sim(tmp_path, "--help")
    assert helped.returncode == 0 and helped.stderr == ""
    for command in ("list", "run", "matrix", "soak", "up", "keys", "grant"):
        assert command in helped.stdout
    run_help = fleet_sim(tmp_path, "run", "--help")
    assert run_help.returncode == 0 and "--results DIR" in run_help.stdout
    bad = fleet_sim(tmp_path, "list", "--bogus")
    assert bad.returncode == 2 and bad.stdout == ""
    errors = [line for line in bad.stderr.splitlines() if "error:" in line]
    assert errors == ["fleet-sim: error: unrecognized arguments: --bogus"], bad.stderr
    assert "Traceback" not in bad.stderr
    assert list(tmp_path.iterdir()) == []


def test_list_names_the_catalogue(tmp_path: Path) -> None:
    listed = fleet_sim(tmp_path, "list")
    assert listed.returncode == 0, listed.stderr
    assert "owner-refuses-non-owner\n" in listed.stdout
    assert "substrates: local-dir" in listed.stdout


@pytest.mark.slow
def test_run_with_its_defaults_from_another_directory(tmp_path: Path) -> None:
    proc = fleet_sim(tmp_path, "run", "owner-refuses-non-owner", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, results = run_results(proc)
    assert run_dir.is_absolute() and run_dir.parent == tmp_path / "results"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    (result,) = results
    assert (result["scenario"], result["substrate"]) == ("owner-refuses-non-owner", "local-dir")
    assert result["verdict"] == "pass", result
    # The fleet's own files (keys, logs, shards) are in the run directory too.
    root = run_dir / "owner-refuses-non-owner.local-dir"
    assert (root / "fleet").is_dir() and (root / "shards").is_dir()
    assert json.loads((run_dir / "owner-refuses-non-owner.local-dir.json").read_text()) == result


@pytest.mark.slow
def test_matrix_with_a_relative_results_directory(tmp_path: Path) -> None:
    proc = fleet_sim(
        tmp_path, "matrix", "--substrate", "local-dir", "--only", "owner-refuses-non-owner",
        "--quick", "--results", "runs",
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "owner-refuses-non-owner: pass" in proc.stdout
    run_dir, results = run_results(proc)
    assert run_dir.parent == tmp_path / "runs"
    assert [r["verdict"] for r in results] == ["pass"], results


@pytest.mark.slow
def test_a_short_soak_from_another_directory(tmp_path: Path) -> None:
    env_dir = tmp_path / "work"
    env_dir.mkdir()
    proc = fleet_sim(env_dir, "soak", "--duration", "2", "--sessions", "2", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, results = run_results(proc)
    assert run_dir.parent == env_dir / "results"
    (result,) = results
    assert result["verdict"] == "pass", result
    assert os.listdir(env_dir) == ["results"]


def test_jobs_must_be_a_small_count() -> None:
    assert parse("matrix", "--substrate", "local-dir", "--jobs", "3").jobs == 3
    assert parse("matrix", "--substrate", "local-dir").jobs == 1
    for bad in ("0", "17", "two"):
        with pytest.raises(SystemExit):
            parse("matrix", "--substrate", "local-dir", "--jobs", bad)


def _marked(mark: str) -> list[str]:
    """Command lines of the live processes whose environment carries ``mark``."""
    found = []
    needle = f"FLEET_SIM_TEST_MARK={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if "State:\tZ" in (entry / "status").read_text():
                continue
            found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue  # gone meanwhile
    return found


@pytest.mark.slow
def test_matrix_side_by_side_runs_and_stops_whole_on_sigterm(tmp_path: Path) -> None:
    """Two scenarios at a time, each in a worker of its own; SIGTERM to the command stops both
    mid-run, and each tears its fleet down: no worker, replica, edge or helper is left."""
    assert FLEET_SIM is not None
    env = {**os.environ, "FLEET_SIM_TEST_MARK": str(tmp_path)}
    scenarios = ("takeover-after-hard-kill", "rolling-deploy-refuses-nobody")
    matrix = subprocess.Popen(
        [FLEET_SIM, "matrix", "--substrate", "local-dir", "--quick", "--jobs", "2",
         "--only", scenarios[0], "--only", scenarios[1], "--results", str(tmp_path)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        def both_prompting() -> bool:
            journals = [
                next(tmp_path.glob(f"*/{s}.local-dir/journal.jsonl"), None) for s in scenarios
            ]
            return all(j is not None and j.stat().st_size > 0 for j in journals)

        eventually(both_prompting, 120, 0.2, message="both scenarios' workloads started")
        # Two workers, each with a fleet of its own (six replicas, an edge, a control plane...).
        assert len(_marked(str(tmp_path))) > 2 * 6
        matrix.terminate()
        out, err = matrix.communicate(timeout=120)
    finally:
        if matrix.poll() is None:
            matrix.kill()
            matrix.wait(10)
    assert matrix.returncode == 128 + 15, out + err
    # Stopped, not waited for: neither scenario got as far as writing its result.
    assert list(tmp_path.glob("*/*.local-dir.json")) == [], out
    eventually(lambda: not _marked(str(tmp_path)), 30, 0.5, message="a process outlived it")
