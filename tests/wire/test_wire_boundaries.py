"""The package boundaries: ``edge`` and ``replica`` share only ``wire``, and the contract's
literals are spelt in ``wire`` alone.

Read from the source with ``ast``, so an import inside a function counts as much as one at the
top, and a literal counts wherever it is used as a value (docstrings and comments may name it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("edge", "replica", "wire")
# Who may not import whom. Production code never imports the simulator either.
FORBIDDEN = {
    "edge": ("replica", "fleet_sim"),
    "replica": ("edge", "fleet_sim"),
    "wire": ("edge", "replica", "fleet_sim"),
}
# Spelt once, in wire; compared case-insensitively.
WIRE_LITERALS = ("x-beyond-grant", "bjn_v1.", "/_beyond/agent", "x-session-id")


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imported(path: Path, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import in the file, wherever it is."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            yield node.lineno, module
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def top_package(module: str) -> str:
    return module.partition(".")[0]


def docstrings(tree: ast.Module) -> set[int]:
    """The ``id`` of every docstring node in the tree."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                found.add(id(body[0].value))
    return found


def literals(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every string or bytes constant that is not a docstring; the
    constant parts of f-strings included."""
    skip = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in skip:
            if isinstance(node.value, str):
                yield node.lineno, node.value
            elif isinstance(node.value, bytes):
                yield node.lineno, node.value.decode("latin-1")


@pytest.mark.parametrize("package", PACKAGES)
def test_the_packages_are_where_the_test_looks(package: str) -> None:
    assert ROOT / package / "__init__.py" in modules(package)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_imports_across_the_wire(package: str) -> None:
    crossings = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in modules(package)
        for line, module in imported(path, parse(path))
        if top_package(module) in FORBIDDEN[package]
    ]
    assert crossings == []


def test_the_import_check_sees_function_level_and_relative_imports() -> None:
    source = "def f():\n    from replica.errors import ReplicaError\n    import edge.core.ring\n"
    source += "from . import sibling\nimportlib.import_module('fleet_sim.cli')\n"
    path = ROOT / "edge" / "example.py"  # never written: only its name places it in edge
    found = sorted(m for _, m in imported(path, ast.parse(source)))
    assert found == ["edge", "edge.core.ring", "fleet_sim.cli", "replica.errors"]


def test_wire_literals_are_spelt_only_in_wire() -> None:
    strays = [
        f"{path.relative_to(ROOT)}:{line} spells {literal!r}"
        for package in ("edge", "replica")
        for path in modules(package)
        for line, text in literals(parse(path))
        for literal in WIRE_LITERALS
        if literal in text.lower()
    ]
    assert strays == []


def test_wire_spells_every_literal_it_owns() -> None:
    spelt = {
        literal
        for path in modules("wire")
        for _, text in literals(parse(path))
        for literal in WIRE_LITERALS
        if literal in text.lower()
    }
    assert spelt == set(WIRE_LITERALS)


def test_the_literal_check_skips_docstrings_and_reads_f_strings() -> None:
    source = '"""Send ``x-beyond-grant``."""\n\ndef f(p):\n    """bjn_v1. tokens."""\n'
    source += '    return f"POST /_beyond/agent?{p}", b"X-Session-Id"\n'
    assert sorted(text for _, text in literals(ast.parse(source))) == [
        "POST /_beyond/agent?",
        "X-Session-Id",
    ]
