"""The pinned installs (``requirements/``, written by ``scripts/lock``) against pyproject.toml and
against the environment the suite runs in.

- Each lock is complete and closed: every requirement of pyproject.toml (the runtime ones for
  ``lock.txt``; those plus the dev and lint extras for ``lock-dev.txt``), and every requirement
  of a locked package in turn, is locked at a version its range admits, and nothing else is
  locked; so ``pip install --require-hashes --no-deps`` of a lock installs a working set.
- Every locked release carries sha256 hashes, and the runtime lock agrees with the dev lock.
- The locked versions are the ones installed here: a venv that drifted from the lock (or a lock
  refreshed without reinstalling and rerunning the suite) fails.
- scripts/bootstrap, the Dockerfile (and its build context) install from the locks.
- Every runtime dependency is imported somewhere: one nothing imports is not declared.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock.txt"
LOCK_DEV = ROOT / "requirements" / "lock-dev.txt"
DEV_EXTRAS = ("dev", "lint")
SOURCES = ("edge", "replica", "fleet_sim", "wire", "bench", "fuzz", "tests")
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True, slots=True)
class Pin:
    version: Version
    hashes: frozenset[str]


@cache
def read_lock(path: Path) -> dict[NormalizedName, Pin]:
    """``name -> Pin`` of a lock file, refusing anything but ``name==version --hash=...``."""
    logical = re.sub(r"\\\n", " ", path.read_text())
    pins: dict[NormalizedName, Pin] = {}
    for line in logical.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        head, *options = line.split()
        match = _PIN.fullmatch(head)
        assert match, f"{path.name}: not an exact pin: {line[:80]}"
        name = canonicalize_name(match.group(1))
        hashes = set()
        for option in options:
            hashed = _HASH.fullmatch(option)
            assert hashed, f"{path.name}: {name}: {option!r} is not a sha256 hash"
            hashes.add(hashed.group(1))
        assert hashes, f"{path.name}: {name} has no hash"
        assert name not in pins, f"{path.name}: {name} is locked twice"
        pins[name] = Pin(Version(match.group(2)), frozenset(hashes))
    assert pins, f"{path.name} locks nothing"
    return pins


def project() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        table = tomllib.load(f)["project"]
    assert isinstance(table, dict)
    return table


def declared(extras: tuple[str, ...] = ()) -> list[Requirement]:
    table = project()
    deps = table["dependencies"]
    assert isinstance(deps, list)
    optional = table.get("optional-dependencies", {})
    assert isinstance(optional, dict)
    for extra in extras:
        deps = deps + optional[extra]
    return [Requirement(str(dep)) for dep in deps]


def applies(req: Requirement, extras: frozenset[str]) -> bool:
    if req.marker is None:
        return True
    marker: Marker = req.marker
    return any(marker.evaluate({"extra": extra}) for extra in extras | {""})


def closure(roots: list[Requirement]) -> dict[NormalizedName, list[Requirement]]:
    """Every distribution the roots need (with the requirements that reach it), following the
    installed distributions' own metadata."""
    needed: dict[NormalizedName, list[Requirement]] = {}
    extras_seen: dict[NormalizedName, set[str]] = {}
    todo = [r for r in roots if applies(r, frozenset())]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        needed.setdefault(name, []).append(req)
        new_extras = set(req.extras) - extras_seen.get(name, set())
        if name in extras_seen and not new_extras:
            continue
        extras_seen.setdefault(name, set()).update(req.extras)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # reported by the caller: it is not installed at the locked version
        extras = frozenset(extras_seen[name])
        todo.extend(r for r in map(Requirement, requires) if applies(r, extras))
    return needed


LOCKS = [
    pytest.param(LOCK, (), id="lock.txt"),
    pytest.param(LOCK_DEV, DEV_EXTRAS, id="lock-dev.txt"),
]


@pytest.mark.parametrize(("path", "extras"), LOCKS)
def test_lock_is_hashed_and_pinned(path: Path, extras: tuple[str, ...]) -> None:
    read_lock(path)  # the assertions are in the reader


@pytest.mark.parametrize(("path", "extras"), LOCKS)
def test_lock_holds_exactly_what_pyproject_needs(path: Path, extras: tuple[str, ...]) -> None:
    pins = read_lock(path)
    needed = closure(declared(extras))
    missing = sorted(set(needed) - set(pins))
    assert not missing, f"{path.name} lacks {missing}: run scripts/lock"
    stray = sorted(set(pins) - set(needed))
    assert not stray, f"{path.name} locks what nothing requires: {stray}: run scripts/lock"
    for name, reqs in needed.items():
        for req in reqs:
            assert req.specifier.contains(pins[name].version, prereleases=True), (
                f"{path.name}: {name}=={pins[name].version} is outside {req} : run scripts/lock"
            )


def test_runtime_lock_agrees_with_dev_lock() -> None:
    dev = read_lock(LOCK_DEV)
    for name, pin in read_lock(LOCK).items():
        assert dev.get(name) == pin, f"{name}: lock.txt and lock-dev.txt differ: run scripts/lock"


def test_locked_versions_are_installed() -> None:
    drift = []
    for name, pin in read_lock(LOCK_DEV).items():
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            drift.append(f"{name}: locked {pin.version}, not installed")
            continue
        if installed != pin.version:
            drift.append(f"{name}: locked {pin.version}, installed {installed}")
    assert not drift, "the environment is not the lock (scripts/bootstrap installs it): " + (
        "; ".join(drift)
    )


def test_installs_use_the_locks() -> None:
    bootstrap = (ROOT / "scripts" / "bootstrap").read_text()
    assert "lock=requirements/lock-dev.txt\n" in bootstrap
    assert '--require-hashes -r "$lock"' in bootstrap
    assert '[ "$lock" -nt "$stamp" ]' in bootstrap  # a refreshed lock is installed again
    assert "--no-deps -e" in bootstrap
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "--require-hashes -r requirements/lock.txt" in dockerfile
    assert "--no-deps ." in dockerfile
    assert "COPY requirements/lock.txt" in dockerfile
    assert "!requirements/lock.txt" in (ROOT / ".dockerignore").read_text().splitlines()
    assert os.access(ROOT / "scripts" / "lock", os.X_OK)


def imported_modules() -> set[str]:
    names: set[str] = set()
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
    return names


def test_every_runtime_dependency_is_imported() -> None:
    provides: dict[NormalizedName, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(canonicalize_name(dist), set()).add(module)
    imported = imported_modules()
    unused = [
        str(req)
        for req in declared()
        if not provides.get(canonicalize_name(req.name), set()) & imported
    ]
    assert not unused, f"declared and imported nowhere: {unused}"
