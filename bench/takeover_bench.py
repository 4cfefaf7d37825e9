"""Takeover times per storage substrate and fault kind: how long a session is unavailable to its
client after its owner is killed, cut off from storage, or its host frozen.

    python -m bench.takeover_bench [--substrate NAME ...] [--repeat N] [--json FILE]

Each figure is the simulator's own scenario (``takeover-after-hard-kill``,
``takeover-after-partition`` / ``takeover-after-metadata-partition``,
``takeover-after-host-freeze``) run ``--repeat`` times with different seeds on a fresh fleet,
graded as ``fleet-sim run`` grades it: a run whose claims do not all pass is reported as failed
and its figures are left out. A sample is one affected session: from the fault to the end of its
first acknowledged turn after it. The table quotes, per substrate and fault, the median and the
largest per-run median and the largest single sample, beside what the substrate lets a stopped
owner keep its locks for (leasefs's lease; five heartbeats of a JuiceFS client; a killed
owner's locks go at once, its descriptors closed by the kernel).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import fleet_sim.sim.scenarios_callbacks  # the whole catalogue registered, as fleet-sim loads it
import fleet_sim.sim.scenarios_jobs
import fleet_sim.sim.scenarios_storage  # noqa: F401
from fleet_sim.sim import scenarios_core  # noqa: F401
from fleet_sim.sim.scenario import CATALOGUE, run_scenario

SUBSTRATES: Final = ("local-dir", "leasefs", "juicefs")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    scenarios: dict[str, str]  # substrate -> the scenario that measures this fault there


FAULTS: Final = (
    Fault("kill", {s: "takeover-after-hard-kill" for s in SUBSTRATES}),
    Fault(
        "partition",
        {"leasefs": "takeover-after-partition", "juicefs": "takeover-after-metadata-partition"},
    ),
    Fault("freeze", {s: "takeover-after-host-freeze" for s in ("leasefs", "juicefs")}),
)


def _figures(result: dict[str, Any]) -> dict[str, Any]:
    for claim in result.get("claims", ()):
        if claim["claim"] == "survivor-takes-over-inside-budget":
            return dict(claim["figures"])
    return {}


def measure(substrate: str, fault: Fault, repeat: int, out: Path) -> dict[str, Any]:
    item = CATALOGUE[fault.scenarios[substrate]]
    runs: list[dict[str, Any]] = []
    for seed in range(repeat):
        result = run_scenario(item, substrate, out / f"{fault.kind}-{seed}", seed=seed)
        figures = _figures(result)
        runs.append(
            {
                "seed": seed,
                "verdict": result["verdict"],
                "median_s": figures.get("takeover_median_s"),
                "max_s": figures.get("takeover_max_s"),
                "sessions": figures.get("takeover_count", 0),
                "storage_expiry_s": figures.get("storage_expiry_s"),
                **({"error": result["error"]} if "error" in result else {}),
            }
        )
        print(
            f"  {substrate} {fault.kind} seed {seed}: {result['verdict']}, "
            f"median {figures.get('takeover_median_s')} s",
            flush=True,
        )
    good = [r for r in runs if r["verdict"] == "pass" and r["median_s"] is not None]
    medians = [r["median_s"] for r in good]
    return {
        "substrate": substrate,
        "fault": fault.kind,
        "scenario": item.name,
        "runs": runs,
        "passed": len(good),
        "median_s": round(statistics.median(medians), 3) if medians else None,
        "worst_run_median_s": max(medians, default=None),
        "max_s": max((r["max_s"] for r in good), default=None),
        "storage_expiry_s": next((r["storage_expiry_s"] for r in good), None),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| substrate | fault | runs passed | median | worst run's median | largest | locks kept |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f} s"

        lines.append(
            f"| {r['substrate']} | {r['fault']} | {r['passed']}/{len(r['runs'])} "
            f"| {s(r['median_s'])} | {s(r['worst_run_median_s'])} | {s(r['max_s'])} "
            f"| {'at once' if r['fault'] == 'kill' else s(r['storage_expiry_s'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.takeover_bench", description=__doc__)
    parser.add_argument(
        "--substrate", action="append", choices=SUBSTRATES, help="repeatable; default all three"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per substrate and fault")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="takeover-bench-") as tmp:
        for substrate in args.substrate or SUBSTRATES:
            for fault in FAULTS:
                if substrate in fault.scenarios:
                    rows.append(measure(substrate, fault, args.repeat, Path(tmp) / substrate))
    print(table(rows))
    if args.json is not None:
        command = " ".join(["python -m bench.takeover_bench", *(argv or sys.argv[1:])])
        document = {"command": command.replace(f" --json {args.json}", ""), "takeover": rows}
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0 if all(r["passed"] == len(r["runs"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
