"""``fleet-sim list | run | matrix | soak``: the scenario catalogue on the command line."""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.queues
import os
import shutil
import signal
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import fleet_sim.sim.scenarios_callbacks  # registers the callback (E1-E7) scenarios
import fleet_sim.sim.scenarios_jobs  # registers the job-end scenarios
import fleet_sim.sim.scenarios_storage  # noqa: F401 - frozen hosts, metadata, stale clients
from fleet_sim.control_plane import GRANT_TTL_S, grant_ttl_arg
from fleet_sim.ports import confine
from fleet_sim.sim import scenarios_core  # noqa: F401 - registers the catalogue
from fleet_sim.sim.fleets import AttachedError, AttachedFleet
from fleet_sim.sim.scenario import (
    CATALOGUE,
    SUBSTRATES,
    AttachedTarget,
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


def _jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 1 <= value <= 16:
        raise argparse.ArgumentTypeError(f"must be within 1-16, got {value}")
    return value


def _absolute(text: str) -> Path:
    # Made absolute here, against the directory the command is typed in: the fleet's processes
    # are handed these paths and do not share our working directory.
    return Path(os.path.abspath(os.path.expanduser(text)))


def _fault_command(text: str) -> str:
    """A command name is left for PATH; a relative path to an existing file is made absolute."""
    path = os.path.expanduser(text)
    if os.sep in path and Path(path).is_file():
        return str(_absolute(path))
    return text


def _attached_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state", type=_absolute, metavar="FILE", help="attached: the external fleet's state JSON"
    )
    parser.add_argument(
        "--fault-cmd",
        type=_fault_command,
        metavar="CMD",
        help="attached: the command run as `CMD VERB REPLICA` to inject faults "
        "(e.g. deploy/attached-local/fault.sh)",
    )


def _attached_target(args: argparse.Namespace, command: str) -> AttachedTarget | int | None:
    """The attached fleet the flags name; None for a local substrate; 2 after a message."""
    if args.substrate != "attached":
        if args.state or args.fault_cmd:
            print(
                f"fleet-sim {command}: --state and --fault-cmd go with --substrate attached",
                file=sys.stderr,
            )
            return 2
        return None
    if not args.state or not args.fault_cmd:
        print(
            f"fleet-sim {command}: --substrate attached needs --state FILE (the fleet's state "
            "JSON) and --fault-cmd CMD (see deploy/attached-local)",
            file=sys.stderr,
        )
        return 2
    if not args.state.is_file():
        print(f"fleet-sim {command}: no state file at {args.state}", file=sys.stderr)
        return 2
    fault_cmd = shutil.which(args.fault_cmd)
    if fault_cmd is None:
        print(
            f"fleet-sim {command}: the fault command {args.fault_cmd} is not an executable",
            file=sys.stderr,
        )
        return 2
    try:
        AttachedFleet.load(args.state)
    except AttachedError as exc:
        print(f"fleet-sim {command}: {exc}", file=sys.stderr)
        return 2
    return AttachedTarget(args.state, os.path.abspath(fault_cmd))


def _results_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--results",
        type=_absolute,
        default="results",  # a string, so argparse makes it absolute like a given value
        metavar="DIR",
        help="where each run writes DIR/<run>/ (default: ./results, in the current directory)",
    )
    parser.add_argument("--quick", action="store_true", help="shorter workloads (CI)")
    parser.add_argument("--seed", type=int, default=0)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    listing = subparsers.add_parser("list", help="name every scenario, its claims and substrates")
    listing.set_defaults(handler=_list)

    run = subparsers.add_parser("run", help="run one scenario on a fresh fleet")
    run.add_argument("scenario", metavar="SCENARIO", choices=sorted(CATALOGUE))
    run.add_argument("--substrate", default="local-dir", choices=SUBSTRATES)
    _attached_args(run)
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
    matrix.add_argument(
        "--jobs",
        type=_jobs,
        default=1,
        metavar="N",
        help="run N scenarios at a time, each on its own fleet in its own process (default 1; "
        "on a small machine more than 2 can slow a scenario past what it measures)",
    )
    _attached_args(matrix)
    _results_arg(matrix)
    matrix.set_defaults(handler=_matrix)

    soak_parser = subparsers.add_parser(
        "soak",
        help="a long run with deploys, kills, partitions, freezes",
        description="Many sessions prompting through the edge for --duration seconds while "
        "faults are injected on random replicas: rolling deploys and kill -9 in proportion "
        "2:1; on leasefs, storage partitions (1); on juicefs, partitions of a host from the "
        "metadata engine, host freezes (the replica and its JuiceFS client stopped, the "
        "replica taken out of the edge's ring) and restarts of the engine (1 each). Graded "
        "like any scenario, with turns, faults and takeover times per fault kind in "
        "results/<run>/.",
    )
    soak_parser.add_argument(
        "--duration", type=_positive, default=300.0, metavar="S", help="seconds of workload"
    )
    soak_parser.add_argument(
        "--sessions",
        type=_sessions,
        default=20,
        metavar="N",
        help="sessions, half on each slice, each with one client prompting back to back",
    )
    soak_parser.add_argument(
        "--fault-every",
        type=_positive,
        default=None,
        metavar="S",
        help="seconds between faults, jittered by a third (default: an eighth of the duration)",
    )
    soak_parser.add_argument(
        "--grant-ttl",
        type=grant_ttl_arg,
        default=GRANT_TTL_S,
        metavar="S",
        help="lifetime of the grants the control plane mints (default 3600); clients renew "
        "theirs at half of it, as long-lived clients must",
    )
    soak_parser.add_argument("--substrate", default="local-dir", choices=SUBSTRATES[:3])
    _results_arg(soak_parser)
    soak_parser.set_defaults(handler=_soak)


def _stop_on_sigterm() -> None:
    """A run stopped with SIGTERM (a CI timeout, ``kill``) tears its fleet down as Ctrl-C does:
    the exit unwinds through the scenario's ``finally``, which stops the processes and unmounts
    the substrate, instead of leaving them running with nobody to stop them."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


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
    _stop_on_sigterm()
    item = CATALOGUE[args.scenario]
    if args.substrate not in item.substrates:
        print(
            f"fleet-sim run: {item.name} does not run on {args.substrate} "
            f"(it needs {', '.join(item.substrates)})",
            file=sys.stderr,
        )
        return 2
    target = _attached_target(args, "run")
    if isinstance(target, int):
        return target
    run_dir = new_run_dir(args.results, item.name)
    result = run_scenario(
        item, args.substrate, run_dir, quick=args.quick, seed=args.seed, attached=target
    )
    return _report(run_dir, [result])


def _matrix(args: argparse.Namespace) -> int:
    _stop_on_sigterm()
    target = _attached_target(args, "matrix")
    if isinstance(target, int):
        return target
    unknown = [n for n in args.only if n not in CATALOGUE]
    if unknown:
        print(f"fleet-sim matrix: unknown scenarios: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if target is not None and args.jobs > 1:
        print("fleet-sim matrix: an attached fleet runs one scenario at a time", file=sys.stderr)
        return 2
    chosen = [
        name
        for name in (args.only or sorted(CATALOGUE))
        if args.substrate in CATALOGUE[name].substrates
    ]
    run_dir = new_run_dir(args.results, f"matrix-{args.substrate}")
    if args.jobs == 1:
        results = []
        for name in chosen:
            result = run_scenario(
                CATALOGUE[name],
                args.substrate,
                run_dir,
                quick=args.quick,
                seed=args.seed,
                attached=target,
            )
            print(f"{name}: {result['verdict']} ({result['seconds']}s)", flush=True)
            results.append(result)
    else:
        results = _side_by_side(chosen, args, run_dir)
    return _report(run_dir, results)


def _side_by_side(
    names: list[str], args: argparse.Namespace, run_dir: Path
) -> list[dict[str, Any]]:
    """The scenarios ``args.jobs`` at a time, each in a process of its own (its fleet, its
    substrate and its faults are its own already; a process keeps their signals and threads
    apart too). Results in the order of ``names``. Stopped (Ctrl-C, SIGTERM), it stops the
    scenarios running, which tear their fleets down as a lone one does."""
    context = multiprocessing.get_context("spawn")
    done: dict[str, dict[str, Any]] = {}
    shares = context.Queue()
    for index in range(args.jobs):
        shares.put(index)
    with ProcessPoolExecutor(
        args.jobs, mp_context=context, initializer=_worker_setup, initargs=(shares, args.jobs)
    ) as pool:
        futures = {
            pool.submit(_run_named, name, args.substrate, run_dir, args.quick, args.seed): name
            for name in names
        }
        try:
            for future in as_completed(futures):
                result = future.result()
                done[futures[future]] = result
                print(
                    f"{result['scenario']}: {result['verdict']} ({result['seconds']}s)", flush=True
                )
        except BaseException:
            for future in futures:
                future.cancel()
            for child in multiprocessing.active_children():
                child.terminate()  # SIGTERM: the scenario's teardown runs
            raise
    return [done[name] for name in names]


def _worker_setup(shares: multiprocessing.queues.Queue[int], jobs: int) -> None:
    """A matrix worker: stopped by SIGTERM as a lone run is, and choosing its fleets' ports
    from a share of the range no other worker uses (each knows only the ports it chose)."""
    _stop_on_sigterm()
    confine(shares.get(timeout=30), jobs)


def _run_named(name: str, substrate: str, run_dir: Path, quick: bool, seed: int) -> dict[str, Any]:
    """One scenario by name, in a worker process (the catalogue is registered by importing this
    module)."""
    return run_scenario(CATALOGUE[name], substrate, run_dir, quick=quick, seed=seed)


def _soak(args: argparse.Namespace) -> int:
    _stop_on_sigterm()
    item = Scenario(
        "soak",
        ("soak-completes",),
        SUBSTRATES[:3],
        "many sessions, rolling deploys, kills, partitions, freezes, metadata restarts",
        lambda ctx: soak(
            ctx,
            duration_s=args.duration,
            sessions=args.sessions,
            fault_every_s=args.fault_every,
        ),
        {"retry_budget_s": 120.0, "grant_ttl_s": args.grant_ttl},
    )
    run_dir = new_run_dir(args.results, "soak")
    result = run_scenario(item, args.substrate, run_dir, seed=args.seed)
    return _report(run_dir, [result])
