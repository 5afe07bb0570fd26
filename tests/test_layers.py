"""The package's import structure as README.md's Layout section draws it: entry points -> jobs -> dispatch ->
harness -> engines / metrics / matrix / store -> types, no import running against that direction
(function-level imports included) and no import cycle between modules; and the tests own their
oracles (``tests/oracles``): nothing under tests/ imports ``benchmarks``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "evalsvc"
TESTS = Path(__file__).resolve().parent

# each module's floor (the longest prefix decides): a module may import its own floor and below
FLOORS = {
    "evalsvc": 0, "evalsvc.types": 0, "evalsvc.paths": 0, "evalsvc.settings": 0,
    "evalsvc.logs": 0, "evalsvc.validation": 0, "evalsvc.children": 0, "evalsvc.tls": 0,
    "evalsvc.engines": 1, "evalsvc.metrics": 1, "evalsvc.matrix": 1, "evalsvc.store": 1,
    "evalsvc.builds": 1, "evalsvc.workloads": 1, "evalsvc.tokenization": 1,
    "evalsvc.thresholds": 1, "evalsvc.judging": 1, "evalsvc.model_catalog": 1,
    "evalsvc.harness": 2, "evalsvc.scenarios": 2,
    "evalsvc.dispatch": 3,
    "evalsvc.jobs": 4, "evalsvc.bisect": 4, "evalsvc.verdicts": 4, "evalsvc.alerts": 4,
    "evalsvc.nightly": 4, "evalsvc.evaluate": 4, "evalsvc.counters": 4,
    "evalsvc.cli": 5, "evalsvc.demo": 5, "evalsvc.app": 5, "evalsvc.api": 5,
    "evalsvc.dashboard": 5, "evalsvc.web": 5, "evalsvc.__main__": 5,
}
NAMES = ("entry points", "jobs", "dispatch", "harness", "engines / metrics / matrix / store",
         "types")[::-1]


def floor(module: str) -> int:
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[best]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str, bool]]:
    """(line, imported module, at the top level) for every evalsvc import in the file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("evalsvc") and name != module:
                out.append((node.lineno, name, id(node) in top))
    return out


def test_no_import_runs_against_the_direction():
    known = modules()
    against = [f"{path.relative_to(PACKAGE.parent)}:{line}: {mod} ({NAMES[floor(mod)]}) imports "
               f"{name} ({NAMES[floor(name)]})"
               for mod, path in known.items() for line, name, _ in imports(mod, path, known)
               if floor(name) > floor(mod)]
    assert not against, "\n".join(against)


def test_every_module_has_a_floor():
    # a new top-level module must be placed in FLOORS, not fall to the package's own floor
    unplaced = [m for m in modules() if m.count(".") == 1 and not any(
        m == p or m.startswith(p + ".") for p in FLOORS if p != "evalsvc")]
    assert not unplaced, f"place these in FLOORS: {unplaced}"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("lazy", [False, True], ids=["top-level", "function-level too"])
def test_no_import_cycle(lazy: bool):
    known = modules()
    edges = {m: {n for _, n, top in imports(m, p, known) if top or lazy}
             for m, p in known.items()}
    assert not cycles(edges)


def test_no_test_imports_benchmarks():
    """Benchmarks may import from ``evalsvc`` and ``tests.oracles``; tests never from
    ``benchmarks`` (function-level imports included)."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(TESTS.parent)}:{node.lineno}: {name}" for name in names
                      if name == "benchmarks" or name.startswith("benchmarks.")]
    assert not found, "\n".join(found)
