"""The fuzz suite as CI runs it: every harness for a bounded number of inputs, the committed
corpus replayed, and the driver's own crash detection."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.common import Harness, _Guard
from fuzz.known import KNOWN_BUGS, Mismatch, known_bug
from fuzz.run import harness_paths, target_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "corpus"
CI_RUNS = 2000
TARGETS = [target_of(p) for p in harness_paths()]
_LINE = re.compile(r"^(\w+)\s+([\d,?]+) inputs\s+[\d.]+ s  (\S+)", re.MULTILINE)


def _harness(target: str) -> Harness:
    harness: Harness = importlib.import_module(f"fuzz.fuzz_{target}").HARNESS
    return harness


def _driver(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fuzz.run", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_every_harness_runs_its_inputs_without_a_crash() -> None:
    result = _driver("--runs", str(CI_RUNS), "--jobs", "2")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    lines = {m[0]: (m[1], m[2]) for m in _LINE.findall(result.stdout)}
    assert set(lines) == set(TARGETS) and len(TARGETS) == 12
    for target, (runs, outcome) in lines.items():
        assert (runs, outcome) == (f"{CI_RUNS:,}", "ok"), (target, runs, outcome)


def _corpus(prefix: str) -> list[tuple[str, Path]]:
    return sorted((d.name, f) for d in CORPUS.iterdir() if d.is_dir() for f in d.glob(f"{prefix}*"))


def test_every_target_has_seeds_and_every_corpus_a_harness() -> None:
    seeded = {target for target, _ in _corpus("seed-")}
    assert seeded == set(TARGETS)
    assert {d.name for d in CORPUS.iterdir() if d.is_dir()} == set(TARGETS)


def _ids(cases: list[tuple[str, Path]]) -> list[str]:
    return [f"{target}/{path.name}" for target, path in cases]


@pytest.mark.parametrize(("target", "path"), _corpus("seed-"), ids=_ids(_corpus("seed-")))
def test_seeds_pass_their_harness(target: str, path: Path) -> None:
    _harness(target).test(path.read_bytes())


_KEYS = {bug.key for bug in KNOWN_BUGS}


@pytest.mark.parametrize(("target", "path"), _corpus("crash-"), ids=_ids(_corpus("crash-")))
def test_saved_crash_is_a_known_bug_until_fixed(target: str, path: Path) -> None:
    # crash-<known bug key>-<sha1>: the input a harness crashed on, kept until the bug is fixed.
    key = path.name.removeprefix("crash-").rpartition("-")[0]
    assert key in _KEYS, f"{path.name} names no entry of fuzz/known.py"
    try:
        _harness(target).test(path.read_bytes())
    except Exception as exc:
        bug = known_bug(target, exc)
        assert bug is not None and bug.key == key, f"{path.name} now fails otherwise: {exc!r}"
        pytest.xfail(f"known bug {key}: {bug.summary}")
    pytest.fail(f"{key} no longer reproduces: drop it from fuzz/known.py, rename {path.name}")


def test_every_known_bug_has_a_saved_input() -> None:
    saved = {p.name.removeprefix("crash-").rpartition("-")[0] for _, p in _corpus("crash-")}
    assert saved == _KEYS


def test_a_known_bug_is_counted_unless_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    def empty_key(data: bytes) -> None:
        raise Mismatch("query-values-empty-key", "x")

    def other(data: bytes) -> None:
        raise Mismatch("query-values", "x")

    guard = _Guard(Harness("query", empty_key), "/nonexistent/")
    guard(b"a")
    guard(b"b")
    assert guard.seen == {"query-empty-key": 2}
    with pytest.raises(Mismatch):
        _Guard(Harness("query", other), "/nonexistent/")(b"a")
    with pytest.raises(Mismatch):
        _Guard(Harness("names", empty_key), "/nonexistent/")(b"a")
    monkeypatch.setenv("FUZZ_STRICT", "1")
    with pytest.raises(Mismatch):
        _Guard(Harness("query", empty_key), "/nonexistent/")(b"a")


BOOM = """
from fuzz.common import Harness, main


def check(data: bytes) -> None:
    if data.startswith(b"BOOM"):
        raise RuntimeError("boom")


if __name__ == "__main__":
    main(Harness("boom", check))
"""


def _engines() -> list[str]:
    engines = ["python"]
    try:
        importlib.import_module("atheris")
    except ImportError:
        return engines
    return [*engines, "atheris"]


@pytest.mark.parametrize("engine", _engines())
def test_the_driver_fails_on_a_crash_and_keeps_the_input(tmp_path: Path, engine: str) -> None:
    harness = tmp_path / "fuzz_boom.py"
    harness.write_text(BOOM)
    (tmp_path / "corpus" / "boom").mkdir(parents=True)
    (tmp_path / "corpus" / "boom" / "seed").write_bytes(b"BOOM!")
    for target in TARGETS:
        (tmp_path / "corpus" / target).mkdir()
    keep = tmp_path / "run"
    result = _driver(
        *("--only", "boom", "names", "--harness", str(harness), "--runs", "200"),
        *("--engine", engine, "--corpus", str(tmp_path / "corpus"), "--keep", str(keep)),
    )
    assert result.returncode == 1, result.stdout
    assert re.search(r"^boom .* CRASH \(exit 77\)", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^names\s+200 inputs .* ok", result.stdout, re.MULTILINE), result.stdout
    crashes = list((keep / "boom" / "artifacts").glob("crash-*"))
    assert [c.read_bytes()[:4] for c in crashes] == [b"BOOM"]


def test_the_driver_refuses_an_unbounded_run() -> None:
    result = _driver("--only", "names")
    assert result.returncode == 2 and "bounded" in result.stderr
