"""What every harness shares: the engine (atheris, or a pure-Python mutator), instrumentation, and
the rule that a target may raise only its documented errors.

A harness is a function of one input (``bytes``) that calls its target and raises on anything
the target must not do: an error outside its documented types, or a broken invariant. The engine
feeds it inputs:

* **atheris** (libFuzzer, coverage-guided), when the ``atheris`` package imports and
  ``FUZZ_ENGINE`` is not ``python``. Arguments are libFuzzer's: ``-atheris_runs=N``,
  ``-max_total_time=S``, ``-artifact_prefix=DIR/``, corpus directories (new inputs are written to
  the first one; pass a scratch directory first and the seeds second).
* **python**, the fallback: seeds from the corpus directories mutated at random (bit flips, byte
  edits, splices, dictionary tokens) plus random bytes; no coverage feedback. It takes the same
  arguments, so the driver runs either.

Both end with ``Done N runs in S second(s)`` on stderr, and on a crash print the traceback, write
the input to ``<artifact_prefix>crash-<sha1>`` and exit non-zero. Inputs that hit a bug listed in
:mod:`fuzz.known` are counted and reported (``KNOWN <key>``), not treated as crashes, unless
``FUZZ_STRICT=1``.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuzz.known import known_bug

EXIT_CRASH = 77  # atheris' own code for an uncaught Python exception
DEFAULT_MAX_LEN = 4096
RANDOM_MAX_LEN = 512


def _atheris() -> Any | None:
    if os.environ.get("FUZZ_ENGINE", "auto") == "python":
        return None
    try:
        return importlib.import_module("atheris")
    except ImportError:
        return None


def engine_name() -> str:
    return "atheris" if _atheris() is not None else "python"


def instrument(*modules: str) -> None:
    """Instrument ``modules`` (and their submodules) when they are imported from here on; a no-op
    without atheris. Call it before importing the targets: atheris rewrites bytecode as modules
    load. Name only what the target runs: instrumenting costs seconds of start-up per package.
    """
    atheris = _atheris()
    if atheris is None:
        return
    # Not the "RegEx" hook: its pattern proxy breaks pattern.match(text, pos), which json uses.
    atheris.enabled_hooks.add("str")
    # Left entered on purpose: it must cover every import of the harness module that follows.
    atheris.instrument_imports(include=list(modules)).__enter__()


@dataclass(frozen=True, slots=True)
class Harness:
    """One fuzz target: ``test`` raises only on a real failure of the code under test."""

    target: str
    test: Callable[[bytes], None]
    tokens: tuple[bytes, ...] = ()
    max_len: int = DEFAULT_MAX_LEN


def strict() -> bool:
    return os.environ.get("FUZZ_STRICT", "") not in ("", "0")


class _Guard:
    """Runs one input; turns a known, reported bug into a count instead of a crash."""

    def __init__(self, harness: Harness, artifact_prefix: str) -> None:
        self.harness = harness
        self.artifact_prefix = artifact_prefix
        self.seen: dict[str, int] = {}
        self.strict = strict()

    def __call__(self, data: bytes) -> None:
        try:
            self.harness.test(data)
        except Exception as exc:
            bug = None if self.strict else known_bug(self.harness.target, exc)
            if bug is None:
                raise
            count = self.seen.get(bug.key, 0)
            self.seen[bug.key] = count + 1
            if count == 0:
                path = _write_artifact(self.artifact_prefix, f"known-{bug.key}-", data)
                print(f"KNOWN {bug.key}: {type(exc).__name__} (input: {path})", file=sys.stderr)


def _write_artifact(prefix: str, kind: str, data: bytes) -> str:
    path = f"{prefix}{kind}{hashlib.sha1(data).hexdigest()}"  # noqa: S324 - a name, not a MAC
    try:
        Path(path).write_bytes(data)
    except OSError:
        return "(not written)"
    return path


# --- arguments (libFuzzer's spelling, so the driver is the same for both engines) ---


@dataclass(frozen=True, slots=True)
class Options:
    runs: int | None
    seconds: float | None
    artifact_prefix: str
    corpus: tuple[Path, ...]
    seed: int | None
    dictionary: Path | None


def parse_options(argv: Sequence[str]) -> Options:
    flags: dict[str, str] = {}
    corpus: list[Path] = []
    for arg in argv:
        if arg.startswith("-") and "=" in arg:
            name, _, value = arg.lstrip("-").partition("=")
            flags[name] = value
        elif not arg.startswith("-"):
            corpus.append(Path(arg))
    runs = flags.get("atheris_runs") or flags.get("runs")
    seconds = flags.get("max_total_time")
    seed = flags.get("seed")
    dictionary = flags.get("dict")
    return Options(
        runs=int(runs) if runs and int(runs) >= 0 else None,
        seconds=float(seconds) if seconds and float(seconds) > 0 else None,
        artifact_prefix=flags.get("artifact_prefix", "./"),
        corpus=tuple(corpus),
        seed=int(seed) if seed else None,
        dictionary=Path(dictionary) if dictionary else None,
    )


def corpus_files(directories: Sequence[Path]) -> Iterator[Path]:
    for directory in directories:
        if directory.is_dir():
            yield from sorted(p for p in directory.iterdir() if p.is_file())


def _dictionary_file(harness: Harness) -> str | None:
    if not harness.tokens:
        return None
    lines = ['"' + "".join(f"\\x{b:02x}" for b in token) + '"' for token in harness.tokens]
    # Same name and content for every run of a harness: concurrent writers agree.
    path = Path(tempfile.gettempdir()) / f"fuzz-{harness.target}.dict"
    try:
        path.write_text("\n".join(lines) + "\n")
    except OSError:
        return None
    return str(path)


def main(harness: Harness, argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python fuzz/fuzz_<target>.py [libFuzzer args] [corpus dirs]``."""
    args = list(sys.argv if argv is None else argv)
    options = parse_options(args[1:])
    guard = _Guard(harness, options.artifact_prefix)
    atheris = _atheris()
    if atheris is None:
        sys.exit(_fallback(harness, guard, options))
    if not any(a.startswith("-max_len=") for a in args):
        args.append(f"-max_len={harness.max_len}")
    if options.dictionary is None:
        dictionary = _dictionary_file(harness)
        if dictionary:
            args.append(f"-dict={dictionary}")
    atheris.Setup(args, guard)
    atheris.Fuzz()


# --- the pure-Python engine ---


class Mutator:
    """Random structure-blind mutations of seeds, in the spirit of libFuzzer's."""

    def __init__(self, rng: random.Random, seeds: list[bytes], tokens: Sequence[bytes]) -> None:
        self.rng = rng
        self.seeds = seeds or [b""]
        self.tokens = list(tokens) or [b"\0", b"\xff", b"{", b"}"]

    def next(self, max_len: int) -> bytes:
        rng = self.rng
        if rng.random() < 0.05:
            return rng.randbytes(rng.randrange(RANDOM_MAX_LEN))
        data = bytearray(rng.choice(self.seeds))
        for _ in range(rng.choice((1, 1, 2, 3, 4, 8))):
            self._mutate(data)
        return bytes(data[:max_len])

    def _mutate(self, data: bytearray) -> None:
        rng = self.rng
        where = rng.randrange(len(data) + 1)
        op = rng.randrange(8)
        if op == 0 and data:
            at = min(where, len(data) - 1)
            data[at] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            data[min(where, len(data) - 1)] = rng.choice((0, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif op == 2:
            data[where:where] = rng.randbytes(rng.randrange(1, 9))
        elif op == 3 and data:
            del data[where : where + rng.randrange(1, 17)]
        elif op == 4:
            data[where:where] = rng.choice(self.tokens)
        elif op == 5 and data:
            start = rng.randrange(len(data))
            chunk = data[start : start + rng.randrange(1, 33)]
            data[where:where] = chunk * rng.choice((1, 2, 16, 300))
        elif op == 6:
            other = rng.choice(self.seeds)
            start = rng.randrange(len(other) + 1)
            data[where:] = other[start:]
        elif data:
            digit = rng.choice(b"0123456789-.eE")
            data[min(where, len(data) - 1)] = digit


def _fallback(harness: Harness, guard: _Guard, options: Options) -> int:
    seeds = [p.read_bytes()[: harness.max_len] for p in corpus_files(options.corpus)]
    seed = options.seed if options.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"INFO: pure-Python engine, seed {seed}, {len(seeds)} corpus files", file=sys.stderr)
    mutator = Mutator(random.Random(seed), seeds, harness.tokens)
    started = time.monotonic()
    deadline = None if options.seconds is None else started + options.seconds
    limit = options.runs
    runs = 0
    # The corpus first, exactly as libFuzzer replays it, then mutations.
    pending = list(seeds)
    while True:
        if limit is not None and runs >= limit:
            break
        if deadline is not None and time.monotonic() >= deadline:
            break
        if limit is None and deadline is None and not pending:
            break
        data = pending.pop(0) if pending else mutator.next(harness.max_len)
        runs += 1
        try:
            guard(data)
        except Exception:
            traceback.print_exc()
            path = _write_artifact(options.artifact_prefix, "crash-", data)
            print(f"#{runs}\tCRASH; Test unit written to {path}", file=sys.stderr)
            return EXIT_CRASH
    elapsed = time.monotonic() - started
    print(f"#{runs}\tDONE", file=sys.stderr)
    print(f"Done {runs} runs in {int(elapsed)} second(s)", file=sys.stderr)
    return 0
