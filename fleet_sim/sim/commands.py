"""``fleet-sim list | run | matrix | soak``: the scenario catalogue on the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import fleet_sim.sim.scenarios_jobs  # noqa: F401 - registers the job-end scenarios
from fleet_sim.sim import scenarios_core  # noqa: F401 - registers the catalogue
from fleet_sim.sim.scenario import (
    CATALOGUE,
    SUBSTRATES,
    Scenario,
    new_run_dir,
    run_scenario,
    write_summary,
)
from fleet_sim.sim.soak import soak


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _sessions(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 2 <= value <= 1000:
        raise argparse.ArgumentTypeError(
            f"must be within 2-1000 (one per slice at least), got {value}"
        )
    return value


def _results_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--results",
        type=Path,
        default=Path("results"),
        metavar="DIR",
        help="where each run writes results/<run>/ (default: ./results)",
    )
    parser.add_argument("--quick", action="store_true", help="shorter workloads (CI)")
    parser.add_argument("--seed", type=int, default=0)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    listing = subparsers.add_parser("list", help="name every scenario, its claims and substrates")
    listing.set_defaults(handler=_list)

    run = subparsers.add_parser("run", help="run one scenario on a fresh fleet")
    run.add_argument("scenario", metavar="SCENARIO", choices=sorted(CATALOGUE))
    run.add_argument("--substrate", default="local-dir", choices=SUBSTRATES[:2])
    _results_arg(run)
    run.set_defaults(handler=_run)

    matrix = subparsers.add_parser("matrix", help="run every scenario that applies to a substrate")
    matrix.add_argument("--substrate", required=True, choices=SUBSTRATES)
    matrix.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SCENARIO",
        help="run just these (repeatable)",
    )
    matrix.add_argument("--state", type=Path, help="attached: the fleet's state JSON")
    matrix.add_argument("--fault-cmd", help="attached: the command that injects faults")
    _results_arg(matrix)
    matrix.set_defaults(handler=_matrix)

    soak_parser = subparsers.add_parser("soak", help="a long run with deploys, kills, partitions")
    soak_parser.add_argument("--duration", type=_positive, default=300.0, metavar="S")
    soak_parser.add_argument("--sessions", type=_sessions, default=20, metavar="N")
    soak_parser.add_argument(
        "--fault-every",
        type=_positive,
        default=None,
        metavar="S",
        help="seconds between faults, jittered by a third (default: an eighth of the duration)",
    )
    soak_parser.add_argument("--substrate", default="local-dir", choices=SUBSTRATES[:2])
    _results_arg(soak_parser)
    soak_parser.set_defaults(handler=_soak)


def _list(args: argparse.Namespace) -> int:
    for name, item in sorted(CATALOGUE.items()):
        print(
            f"{name}\n    {item.description}\n    substrates: {', '.join(item.substrates)}"
            f"\n    claims: {', '.join(item.claims)}"
        )
    return 0


def _report(run_dir: Path, results: list[dict[str, object]]) -> int:
    print(write_summary(run_dir, results))
    print(f"results: {run_dir}")
    return 1 if any(r["verdict"] == "fail" for r in results) else 0


def _run(args: argparse.Namespace) -> int:
    item = CATALOGUE[args.scenario]
    if args.substrate not in item.substrates:
        print(
            f"fleet-sim run: {item.name} does not run on {args.substrate} "
            f"(it needs {', '.join(item.substrates)})",
            file=sys.stderr,
        )
        return 2
    run_dir = new_run_dir(args.results, item.name)
    result = run_scenario(item, args.substrate, run_dir, quick=args.quick, seed=args.seed)
    return _report(run_dir, [result])


def _matrix(args: argparse.Namespace) -> int:
    if args.substrate == "attached":
        print(
            "fleet-sim matrix: --substrate attached drives an external fleet; this build "
            "runs the catalogue on local-dir and leasefs (see deploy/attached-local)",
            file=sys.stderr,
        )
        return 2
    unknown = [n for n in args.only if n not in CATALOGUE]
    if unknown:
        print(f"fleet-sim matrix: unknown scenarios: {', '.join(unknown)}", file=sys.stderr)
        return 2
    chosen = [CATALOGUE[n] for n in (args.only or sorted(CATALOGUE))]
    run_dir = new_run_dir(args.results, f"matrix-{args.substrate}")
    results = []
    for item in chosen:
        if args.substrate not in item.substrates:
            continue
        result = run_scenario(item, args.substrate, run_dir, quick=args.quick, seed=args.seed)
        print(f"{item.name}: {result['verdict']} ({result['seconds']}s)", flush=True)
        results.append(result)
    return _report(run_dir, results)


def _soak(args: argparse.Namespace) -> int:
    item = Scenario(
        "soak",
        ("soak-completes",),
        ("local-dir", "leasefs"),
        "many sessions, rolling deploys, kills and partitions",
        lambda ctx: soak(
            ctx,
            duration_s=args.duration,
            sessions=args.sessions,
            fault_every_s=args.fault_every,
        ),
        {"retry_budget_s": 120.0},
    )
    run_dir = new_run_dir(args.results, "soak")
    result = run_scenario(item, args.substrate, run_dir, seed=args.seed)
    return _report(run_dir, [result])
