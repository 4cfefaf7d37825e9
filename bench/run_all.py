"""Every benchmark of the project in one run, one after the other, into one results file.

    python -m bench.run_all [--quick] [--out FILE]

Each benchmark runs as its own process (so one's threads, caches and children never colour the
next) with ``--json``; their figures are gathered with a description of the machine and the
date into ``FILE`` (default ``bench/results/latest.json``) and a readable ``FILE`` with ``.md``.
The replica benchmark runs before the edge's, which takes the replica's CPU per turn from it.
``--quick`` uses small counts everywhere: it shows every figure is produced, in a few minutes.

Benchmarks run in sequence, never at once: on a small machine two of them would only measure
each other. A benchmark that fails is recorded as failed (with the end of its error output), the
others still run, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

REPO: Final = Path(__file__).resolve().parents[1]
DEFAULT_OUT: Final = REPO / "bench" / "results" / "latest.json"
_RING_LINE: Final = re.compile(r"^\s*(\w+):\s+([0-9.]+) ns per lookup\s*$")


@dataclass(frozen=True, slots=True)
class Bench:
    name: str
    module: str
    quick_args: tuple[str, ...]
    full_args: tuple[str, ...]
    timeout_quick_s: float
    timeout_full_s: float


BENCHES: Final = (
    Bench("store", "bench.store_bench", ("--turns", "50", "--replays", "5"), (), 60, 900),
    Bench("replica", "bench.replica_bench", ("--quick",), (), 120, 1800),
    Bench("edge", "bench.edge_bench", ("--quick",), (), 150, 1800),
    Bench("ring_lookup", "bench.ring_lookup", ("--ids", "20000"), (), 60, 600),
    Bench("stream", "bench.stream_bench", ("--quick",), (), 240, 1200),
    # Quick: one kill on a local directory; full: kill, partition and freeze, three runs each,
    # on every substrate (about a quarter of an hour).
    Bench(
        "takeover",
        "bench.takeover_bench",
        ("--substrate", "local-dir", "--repeat", "1"),
        (),
        240,
        3600,
    ),
)


def machine() -> dict[str, Any]:
    """What the figures were measured on: they mean little without it."""
    info: dict[str, Any] = {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "system": platform.system(),
        "machine": platform.machine(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def load_average() -> list[float]:
    """Other work on the machine shows here: a busy box lowers every rate measured."""
    return [round(x, 2) for x in os.getloadavg()]


def ring_figures(stdout: str) -> dict[str, Any]:
    """``bench.ring_lookup`` prints ``NAME: N ns per lookup`` lines; it has no ``--json``."""
    figures: dict[str, Any] = {}
    for line in stdout.splitlines():
        match = _RING_LINE.match(line)
        if match:
            figures[f"{match.group(1)}_ns_per_lookup"] = float(match.group(2))
    return figures


def run_bench(bench: Bench, quick: bool, scratch: Path, extra: tuple[str, ...]) -> dict[str, Any]:
    """Run one benchmark; its figures, or why there are none."""
    out_json = scratch / f"{bench.name}.json"
    argv = [sys.executable, "-m", bench.module, *(bench.quick_args if quick else bench.full_args)]
    parses_stdout = bench.name == "ring_lookup" and not _accepts_json(bench.module)
    if not parses_stdout:
        argv += ["--json", str(out_json), *extra]
    timeout = bench.timeout_quick_s if quick else bench.timeout_full_s
    print(f"== {bench.name}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    # Scratch paths mean nothing once the run is over: the command is shown with bare names.
    shown = " ".join(["python", *argv[1:]]).replace(f"{scratch}{os.sep}", "")
    record: dict[str, Any] = {"command": shown, "status": "ok"}
    try:
        done = subprocess.run(
            argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        record.update(status="failed", error=f"timed out after {timeout:g} s: {_tail(exc.stderr)}")
        return record
    finally:
        record["seconds"] = round(time.perf_counter() - started, 1)
    sys.stderr.write(done.stdout)
    if done.returncode != 0:
        record.update(status="failed", error=f"exit {done.returncode}: {_tail(done.stderr)}")
        return record
    figures = ring_figures(done.stdout) if parses_stdout else json.loads(out_json.read_text())
    if not figures:
        record.update(status="failed", error="no figures")
    record["figures"] = figures
    return record


def _accepts_json(module: str) -> bool:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True
    )
    return "--json" in done.stdout


def _tail(text: str | bytes | None, chars: int = 1500) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return text[-chars:]


def run_all(quick: bool, scratch: Path) -> dict[str, Any]:
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "quick" if quick else "full",
        "command": "python -m bench.run_all" + (" --quick" if quick else ""),
        "machine": machine(),
        "load_average_before": load_average(),
        "benches": {},
    }
    for bench in BENCHES:
        extra: tuple[str, ...] = ()
        replica = results["benches"].get("replica", {})
        if bench.name == "edge" and replica.get("status") == "ok":
            extra = ("--replica-json", str(scratch / "replica.json"))
        results["benches"][bench.name] = run_bench(bench, quick, scratch, extra)
    results["load_average_after"] = load_average()
    return results


# --- the readable copy ----------------------------------------------------------------------------


def _is_table(value: Any) -> bool:
    """A list of rows (dicts), as ``bench.takeover_bench`` reports its figures."""
    return isinstance(value, list) and bool(value) and all(isinstance(r, dict) for r in value)


def _cell(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            return f"{value:.5f}"
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"# Benchmark results ({results['mode']})",
        "",
        f"- date: {results['date']}",
        f"- command: `{results['command']}`",
        f"- machine: {m.get('nproc')} CPUs ({m.get('cpu_model', 'unknown CPU')}), "
        f"{m.get('memory_gib', '?')} GiB, Linux {m.get('kernel')}, Python {m.get('python')}",
        f"- commit: {m.get('commit')}",
        f"- load average before / after: {results['load_average_before']} / "
        f"{results['load_average_after']}",
        "",
    ]
    for name, record in results["benches"].items():
        lines += [f"## {name}", "", f"`{record['command']}` ({record['seconds']} s)", ""]
        if record["status"] != "ok":
            lines += ["**failed**:", "", "```", record.get("error", ""), "```", ""]
            continue
        figures = record["figures"]
        rows = figures.get("targets")
        if rows:
            lines += ["| target | figure | measured | met |", "|---|---|---:|---|"]
            for row in rows:
                lines.append(
                    f"| {row['target']} | `{row['figure']}` | {_cell(row['measured'])} "
                    f"| {_cell(row['met'])} |"
                )
            lines.append("")
        scalars = {k: v for k, v in figures.items() if k != "targets" and not _is_table(v)}
        lines += ["| figure | value |", "|---|---:|"]
        lines += [f"| `{k}` | {_cell(v)} |" for k, v in scalars.items()]
        lines.append("")
        for key, rows_of in figures.items():
            if key != "targets" and _is_table(rows_of):
                columns = [c for c in rows_of[0] if not isinstance(rows_of[0][c], list | dict)]
                lines += [f"`{key}`:", "", "| " + " | ".join(columns) + " |"]
                lines.append("|" + "---|" * len(columns))
                for row in rows_of:
                    lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
                lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every benchmark into one results file.")
    parser.add_argument("--quick", action="store_true", help="small counts, a few minutes")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    out: Path = args.out
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        results = run_all(args.quick, Path(tmp))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    readable = out.with_suffix(".md")
    readable.write_text(markdown(results))
    failed = [n for n, r in results["benches"].items() if r["status"] != "ok"]
    print(f"results: {out} and {readable}", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
