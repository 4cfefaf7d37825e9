"""The simulator's catalogue in CI: every scenario that applies to local-dir and to leasefs
passes (none skipped; two at a time, each on its own fleet), and a short soak with deploys,
kills and partitions loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet_sim.sim import commands
from fleet_sim.sim.scenario import CATALOGUE

pytestmark = pytest.mark.slow
assert commands  # importing it registers the whole catalogue


def run_cli(*args: str, timeout: float) -> tuple[int, list[dict[str, object]], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "fleet_sim", *args], capture_output=True, text=True, timeout=timeout
    )
    run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("results: "))
    results = json.loads((run_dir / "results.json").read_text())
    return proc.returncode, results, proc.stdout + proc.stderr


def failures(results: list[dict[str, object]]) -> dict[str, object]:
    """Each failed scenario with its error and only its failed claims, errors in full (CI prints
    the assertion's first lines, which the passing claims' figures would fill)."""
    return {
        str(r["scenario"]): {
            "error": r.get("error"),
            "claims": {
                c["claim"]: c["errors"]
                for c in r["claims"]  # type: ignore[attr-defined]
                if c["verdict"] != "pass"
            },
        }
        for r in results
        if r["verdict"] != "pass"
    }


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "substrate", ["local-dir", pytest.param("leasefs", marks=pytest.mark.fuse)]
)
def test_matrix_passes_with_nothing_skipped(substrate: str, tmp_path: Path) -> None:
    code, results, output = run_cli(
        "matrix",
        "--substrate",
        substrate,
        "--quick",
        "--jobs",
        "2",
        "--results",
        str(tmp_path),
        timeout=1500,
    )
    expected = sorted(n for n, s in CATALOGUE.items() if substrate in s.substrates)
    assert sorted(str(r["scenario"]) for r in results) == expected
    assert not failures(results), failures(results)
    assert code == 0, output


@pytest.mark.fuse
@pytest.mark.timeout(900)
def test_a_short_soak_loses_nothing(tmp_path: Path) -> None:
    code, results, output = run_cli(
        "soak",
        "--duration",
        "60",
        "--sessions",
        "6",
        "--fault-every",
        "10",
        "--grant-ttl",
        "20",  # expires twice during the run: clients must renew theirs
        "--substrate",
        "leasefs",
        "--seed",
        "7",
        "--results",
        str(tmp_path),
        timeout=900,
    )
    (result,) = results
    assert result["verdict"] == "pass", output
    claims = {c["claim"]: c for c in result["claims"]}  # type: ignore[attr-defined]
    assert claims["no-acknowledged-turn-lost-or-duplicated"]["figures"]["lost"] == 0
    figures = claims["soak-completes"]["figures"]
    assert figures["turns_ok"] > 0
    assert figures["deploys"] >= 1
    assert figures["deploys"] + figures["kills"] + figures["partitions"] >= 3
    assert code == 0
