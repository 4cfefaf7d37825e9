"""The simulator on the juicefs substrate in CI: every scenario that applies to it passes, none
skipped, and nothing it started is left running or mounted; and a short soak with every fault
kind of the substrate (deploys, kills, metadata partitions, host freezes, a metadata restart)
loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet_sim.sim import commands
from fleet_sim.sim.scenario import CATALOGUE

pytestmark = [pytest.mark.slow, pytest.mark.juicefs]
assert commands  # importing it registers the whole catalogue


def _mounted_under(root: Path) -> list[str]:
    with open("/proc/mounts", encoding="utf-8") as mounts:
        return [line.split()[1] for line in mounts if line.split()[1].startswith(str(root))]


def _fleet_sim(*args: str, timeout: float) -> tuple[int, list[dict[str, Any]], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "fleet_sim", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("results: "))
    results = json.loads((run_dir / "results.json").read_text())
    return proc.returncode, results, proc.stdout + proc.stderr


@pytest.mark.timeout(2400)
def test_the_juicefs_matrix_passes_with_nothing_skipped(tmp_path: Path) -> None:
    code, results, output = _fleet_sim(
        "matrix",
        "--substrate",
        "juicefs",
        "--quick",
        "--jobs",
        "2",
        "--results",
        str(tmp_path),
        timeout=2400,
    )
    expected = sorted(n for n, s in CATALOGUE.items() if "juicefs" in s.substrates)
    assert sorted(str(r["scenario"]) for r in results) == expected
    failed = {
        r["scenario"]: r.get("error") or [c["claim"] for c in r["claims"] if c["verdict"] != "pass"]
        for r in results
        if r["verdict"] != "pass"
    }
    assert not failed, failed
    assert code == 0, output
    assert _mounted_under(tmp_path) == []


@pytest.mark.timeout(900)
def test_a_short_juicefs_soak_with_every_fault_kind_loses_nothing(tmp_path: Path) -> None:
    code, results, output = _fleet_sim(
        "soak",
        "--duration",
        "150",
        "--sessions",
        "8",
        "--fault-every",
        "20",  # about one deck of six kinds
        "--substrate",
        "juicefs",
        "--seed",
        "3",
        "--results",
        str(tmp_path),
        timeout=900,
    )
    (result,) = results
    failed = {c["claim"]: c["errors"] for c in result["claims"] if c["verdict"] != "pass"}
    assert result["verdict"] == "pass", (result.get("error"), failed)
    claims = {c["claim"]: c for c in result["claims"]}
    assert claims["no-acknowledged-turn-lost-or-duplicated"]["figures"]["lost"] == 0
    figures = claims["soak-completes"]["figures"]
    assert figures["turns_ok"] > 0
    kinds = ("deploys", "kills", "partitions", "freezes", "metadata_restarts")
    assert sum(figures[k] for k in kinds) >= 4, figures
    assert code == 0, output
    assert _mounted_under(tmp_path) == []
