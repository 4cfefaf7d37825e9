"""Run every fuzz harness for a bounded number of inputs or seconds, one subprocess each.

    python -m fuzz.run [--runs N] [--seconds S] [--only TARGET ...] [--jobs J] [--strict]

``--runs`` bounds the inputs of each harness; ``--seconds`` bounds the whole run's wall-clock
time, shared evenly between harnesses (with ``--jobs J``, J harnesses run side by side). Each
harness starts from ``tests/corpus/<target>/`` and writes what it discovers to a scratch
directory, so the committed seeds never change. Prints one line per harness (engine, inputs run,
seconds, outcome) and exits non-zero if any harness crashed, hung or reported no count.
``--save-crashes`` copies crashing inputs into ``tests/corpus/<target>/crash-<sha1>``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FUZZ_DIR = REPO / "fuzz"
CORPUS_DIR = REPO / "tests" / "corpus"
# Per-input limit: an input that takes this long is a hang, reported as a crash.
INPUT_TIMEOUT_S = 30
# Without --seconds, a harness that has not finished its runs by then is a hang.
DEFAULT_HARNESS_TIMEOUT_S = 900.0
_DONE = re.compile(r"^Done (\d+)", re.MULTILINE)
_PROGRESS = re.compile(r"^#(\d+)\s", re.MULTILINE)
_KNOWN = re.compile(r"^KNOWN (\S+):", re.MULTILINE)
_ARTIFACT = re.compile(r"Test unit written to (\S+)")


@dataclass(frozen=True, slots=True)
class Result:
    target: str
    returncode: int | None  # None: killed at the deadline
    runs: int | None
    seconds: float
    known: tuple[str, ...] = ()
    crash_input: Path | None = None
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.runs is not None


@dataclass(frozen=True, slots=True)
class Plan:
    runs: int | None
    seconds_each: float | None
    timeout_s: float
    engine: str
    strict: bool
    scratch: Path
    corpus_root: Path = CORPUS_DIR


def harness_paths(only: Sequence[str] = (), extra: Sequence[Path] = ()) -> list[Path]:
    paths = sorted(FUZZ_DIR.glob("fuzz_*.py")) + [p.resolve() for p in extra]
    if only:
        wanted = set(only)
        unknown = wanted - {target_of(p) for p in paths}
        if unknown:
            raise SystemExit(f"no harness for: {', '.join(sorted(unknown))}")
        paths = [p for p in paths if target_of(p) in wanted]
    return paths


def target_of(path: Path) -> str:
    return path.stem.removeprefix("fuzz_")


def command(path: Path, plan: Plan, work: Path, artifacts: Path) -> list[str]:
    argv = [sys.executable, str(path), f"-timeout={INPUT_TIMEOUT_S}"]
    if plan.runs is not None:
        argv.append(f"-atheris_runs={plan.runs}")
    if plan.seconds_each is not None:
        argv.append(f"-max_total_time={max(1, int(plan.seconds_each))}")
    argv += [f"-artifact_prefix={artifacts}/", str(work), str(plan.corpus_root / target_of(path))]
    return argv


def run_one(path: Path, plan: Plan) -> Result:
    target = target_of(path)
    work = plan.scratch / target / "corpus"
    artifacts = plan.scratch / target / "artifacts"
    work.mkdir(parents=True)
    artifacts.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env["FUZZ_STRICT"] = "1" if plan.strict else env.get("FUZZ_STRICT", "")
    if plan.engine != "auto":
        env["FUZZ_ENGINE"] = plan.engine
    started = time.monotonic()
    log = plan.scratch / target / "log.txt"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            command(path, plan, work, artifacts),
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env=env,
        )
        try:
            returncode: int | None = proc.wait(plan.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = None
    elapsed = time.monotonic() - started
    text = log.read_text("utf-8", "replace")
    done = _DONE.findall(text)
    progress = _PROGRESS.findall(text)
    runs = int(done[-1]) if done else None
    if runs is None and returncode != 0 and progress:
        runs = int(progress[-1])
    artifact = _ARTIFACT.findall(text)
    return Result(
        target=target,
        returncode=returncode,
        runs=runs,
        seconds=elapsed,
        known=tuple(dict.fromkeys(_KNOWN.findall(text))),
        crash_input=Path(artifact[-1]) if artifact else None,
        log_tail="" if returncode == 0 else text[-4000:],
    )


def engine() -> str:
    from fuzz.common import engine_name

    return engine_name()


def report(result: Result) -> str:
    runs = "?" if result.runs is None else f"{result.runs:,}"
    if result.ok:
        outcome = "ok"
    elif result.returncode is None:
        outcome = "HUNG (killed at the deadline)"
    elif result.returncode == 0:
        outcome = "NO COUNT"
    else:
        outcome = f"CRASH (exit {result.returncode})"
    known = f"  known bugs hit: {', '.join(result.known)}" if result.known else ""
    return f"{result.target:<14} {runs:>12} inputs {result.seconds:7.1f} s  {outcome}{known}"


def save_crash(result: Result, corpus_root: Path) -> Path | None:
    if result.crash_input is None or not result.crash_input.is_file():
        return None
    name = result.crash_input.name
    directory = corpus_root / result.target
    directory.mkdir(parents=True, exist_ok=True)
    destination = directory / (name if name.startswith("crash-") else f"crash-{name}")
    shutil.copyfile(result.crash_input, destination)
    return destination


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.run", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, help="inputs per harness")
    parser.add_argument("--seconds", type=float, help="wall-clock budget for the whole run")
    parser.add_argument("--only", nargs="+", default=[], metavar="TARGET", help="these harnesses")
    parser.add_argument("--jobs", type=int, default=1, help="harnesses run side by side")
    parser.add_argument("--engine", choices=("auto", "atheris", "python"), default="auto")
    parser.add_argument("--strict", action="store_true", help="known bugs count as crashes")
    parser.add_argument("--save-crashes", action="store_true", help="copy crashes into the corpus")
    parser.add_argument("--keep", type=Path, help="keep logs, corpora and artifacts here")
    parser.add_argument(
        "--harness", type=Path, action="append", default=[], help="also run this harness file"
    )
    parser.add_argument(
        "--corpus", type=Path, default=CORPUS_DIR, help="seed root (default tests/corpus)"
    )
    args = parser.parse_args(argv)
    if args.runs is None and args.seconds is None:
        parser.error("give --runs, --seconds or both: every run is bounded")
    if (args.runs is not None and args.runs < 1) or (
        args.seconds is not None and args.seconds <= 0
    ):
        parser.error("--runs and --seconds must be positive")
    jobs = max(1, args.jobs)
    paths = harness_paths(args.only, args.harness)
    seconds_each = None
    if args.seconds is not None:
        seconds_each = args.seconds * min(jobs, len(paths)) / len(paths)
    timeout = DEFAULT_HARNESS_TIMEOUT_S if seconds_each is None else seconds_each + 120.0
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="fuzz-run-"))
    scratch.mkdir(parents=True, exist_ok=True)
    plan = Plan(
        args.runs, seconds_each, timeout, args.engine, args.strict, scratch, args.corpus.resolve()
    )
    name = engine() if args.engine == "auto" else args.engine
    print(f"fuzz: {len(paths)} harnesses, engine {name}, scratch {scratch}", flush=True)
    started = time.monotonic()
    results: list[Result] = []
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for result in pool.map(lambda p: run_one(p, plan), paths):
                results.append(result)
                print(report(result), flush=True)
                if not result.ok:
                    print(result.log_tail, flush=True)
                    saved = save_crash(result, args.corpus) if args.save_crashes else None
                    where = saved or result.crash_input
                    if where is not None:
                        print(f"  crashing input: {where}", flush=True)
    finally:
        # Kept when something failed: the logs and crashing inputs are the evidence.
        if args.keep is None and all(r.ok for r in results) and len(results) == len(paths):
            shutil.rmtree(scratch, ignore_errors=True)
    total = sum(r.runs or 0 for r in results)
    failed = [r.target for r in results if not r.ok]
    elapsed = time.monotonic() - started
    print(f"fuzz: {total:,} inputs in {elapsed:.0f} s; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
