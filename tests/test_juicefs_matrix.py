"""The simulator's catalogue on the juicefs substrate in CI: every scenario that applies to it
passes, none skipped, and nothing it started is left running or mounted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet_sim.sim import commands
from fleet_sim.sim.scenario import CATALOGUE

pytestmark = [pytest.mark.slow, pytest.mark.juicefs]
assert commands  # importing it registers the whole catalogue


def _mounted_under(root: Path) -> list[str]:
    with open("/proc/mounts", encoding="utf-8") as mounts:
        return [line.split()[1] for line in mounts if line.split()[1].startswith(str(root))]


@pytest.mark.timeout(1500)
def test_the_juicefs_matrix_passes_with_nothing_skipped(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleet_sim",
            "matrix",
            "--substrate",
            "juicefs",
            "--quick",
            "--results",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    output = proc.stdout + proc.stderr
    run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("results: "))
    results = json.loads((run_dir / "results.json").read_text())
    expected = sorted(n for n, s in CATALOGUE.items() if "juicefs" in s.substrates)
    assert sorted(str(r["scenario"]) for r in results) == expected
    failed = {
        r["scenario"]: r.get("error") or [c["claim"] for c in r["claims"] if c["verdict"] != "pass"]
        for r in results
        if r["verdict"] != "pass"
    }
    assert not failed, failed
    assert proc.returncode == 0, output
    assert _mounted_under(tmp_path) == []
