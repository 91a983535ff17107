"""The layering contract of the package (:data:`pipeline.LAYERS`), read from the source.

Every project import of every module under ``pipeline/`` (at module level and inside
functions, absolute and relative; ``from pipeline.x import y`` is the module
``pipeline.x.y`` when that exists, else ``pipeline.x``) must point to the importer's own
unit, a unit below it in its lane, or a lower layer; lanes of one layer are independent.
The modules form no import cycle; ``pipeline.config`` and ``pipeline.core`` run without
torch; no module is longer than :data:`MAX_LINES` lines. Nothing here imports the modules
it checks except in the torch-free subprocesses.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline import LAYERS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "pipeline"
MAX_LINES = 600


@dataclass(frozen=True)
class Import:
    """One project import: ``importer`` imports ``imported`` at ``line``."""

    importer: str
    imported: str
    line: int


@dataclass(frozen=True)
class Unit:
    """Where a unit of :data:`pipeline.LAYERS` sits: layer, lane and rank in the lane."""

    name: str
    layer: int
    lane: int
    rank: int

    def __str__(self) -> str:
        return f"{self.name} (layer {self.layer + 1})"


def package_modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` by dotted name (a package by its
    ``__init__.py``)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_project(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _existing(name: str, modules: dict[str, Path]) -> str:
    """``name`` if it is a module, else its longest enclosing name that is."""
    parts = name.split(".")
    while len(parts) > 1 and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The project imports of module ``name`` anywhere in its body."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if _is_project(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not _is_project(source):
                continue
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                       for a in node.names]
        else:
            continue
        found.extend(Import(name, _existing(t, modules), node.lineno) for t in set(targets))
    return sorted(found, key=lambda i: (i.line, i.imported))


def import_graph(root: Path) -> dict[str, list[Import]]:
    """Every module's project imports."""
    modules = package_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def units(layers: tuple = LAYERS) -> dict[str, Unit]:
    """The units of ``layers`` by name (relative to the package)."""
    out = {}
    for layer, lanes in enumerate(layers):
        for lane, names in enumerate(lanes):
            for rank, unit in enumerate(names):
                out[unit] = Unit(unit, layer, lane, rank)
    return out


def unit_of(module: str, table: dict[str, Unit]) -> Unit | None:
    """The unit a module belongs to (longest prefix), None for the package root or a
    module no unit covers."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        hit = table.get(".".join(parts[:n]))
        if hit is not None:
            return hit
    return None


def layering_violations(graph: dict[str, list[Import]], layers: tuple = LAYERS) -> list[str]:
    """One line per import that points to a higher unit or an independent lane."""
    table = units(layers)
    out = []
    for module, imports in sorted(graph.items()):
        here = unit_of(module, table)
        for imp in imports:
            if imp.imported == imp.importer:
                continue
            if module == PACKAGE:
                out.append(f"{module}:{imp.line} (the package root) imports {imp.imported}: "
                           f"the root imports nothing from the package")
                continue
            there = unit_of(imp.imported, table)
            if here is None or there is None:
                continue  # reported by test_every_module_has_a_layer
            where = f"{module}:{imp.line} ({here}) imports {imp.imported} ({there})"
            if there.layer > here.layer:
                out.append(f"{where}: upward import")
            elif there.layer == here.layer and there.lane != here.lane:
                out.append(f"{where}: independent units of one layer")
            elif there.layer == here.layer and there.rank > here.rank:
                out.append(f"{where}: upward import within the layer")
    return out


def import_cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one
    module (Tarjan's algorithm, iterative; then a shortest cycle through the component's
    first module by breadth-first search inside the component)."""
    edges = {m: sorted({i.imported for i in imps if i.imported != m and i.imported in graph})
             for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            succ = edges[node]
            if child < len(succ):
                work.append((node, child + 1))
                nxt = succ[child]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    cycles = []
    for comp in components:
        members, first = set(comp), comp[0]
        came: dict[str, str] = {}
        frontier = [first]
        while frontier and first not in came:
            nxt_frontier = []
            for node in frontier:
                for nxt in edges[node]:
                    if nxt in members and nxt not in came:
                        came[nxt] = node
                        nxt_frontier.append(nxt)
            frontier = nxt_frontier
        cycle = [first]
        node = came[first]
        while node != first:
            cycle.append(node)
            node = came[node]
        cycle.append(first)
        cycles.append(cycle[::-1])
    return sorted(cycles)


def long_modules(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``module: N lines`` for each module over ``limit`` lines."""
    out = []
    for name, path in package_modules(root).items():
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{name}: {n} lines (at most {limit})")
    return out


def _torch_free(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- the contract


def test_every_module_has_a_layer() -> None:
    table = units()
    loose = [m for m in package_modules(ROOT) if m != PACKAGE and unit_of(m, table) is None]
    assert not loose, ("modules in no unit of pipeline.LAYERS (declare their unit there): "
                       + ", ".join(loose))


def test_imports_point_down() -> None:
    bad = layering_violations(import_graph(ROOT))
    assert not bad, f"{len(bad)} imports break pipeline.LAYERS:\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    cycles = import_cycles(import_graph(ROOT))
    assert not cycles, f"{len(cycles)} import cycles:\n" + "\n".join(
        " -> ".join(c) for c in cycles)


def test_config_imports_no_torch() -> None:
    proc = _torch_free("import sys, pipeline.config; "
                       "assert 'torch' not in sys.modules, 'pipeline.config imported torch'")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_core_imports_no_torch() -> None:
    names = sorted(m for m in package_modules(ROOT) if m.startswith(f"{PACKAGE}.core"))
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {names!r}:
            importlib.import_module(name)
            assert 'torch' not in sys.modules, name + ' imported torch'
    """)
    proc = _torch_free(code)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_modules_are_short() -> None:
    long = long_modules(ROOT)
    assert not long, "\n".join(long)


# --------------------------------------------------------------------------- the checker


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_checker_catches_planted_violations(tmp_path: Path) -> None:
    """A made-up package with an upward import inside a function, a relative import
    between independent lanes, a cycle and a long module: each is reported, naming both
    modules and both units."""
    _plant(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/a.py": """
            def late():
                from pipeline.stages.trace import stage
                return stage
        """,
        "core/b.py": "from . import c\n",
        "core/c.py": "from pipeline.core import b\n",
        "dtensor/__init__.py": "",
        "dtensor/glue.py": "from ..solvers import mrf\n",
        "solvers/__init__.py": "",
        "solvers/mrf.py": "from pipeline.core.a import late\n",
        "stages/__init__.py": "",
        "stages/trace/__init__.py": "",
        "stages/trace/stage.py": "x = 1\n" * (MAX_LINES + 1),
    })
    graph = import_graph(tmp_path)
    bad = layering_violations(graph)
    assert bad == [
        "pipeline.core.a:3 (core (layer 1)) imports pipeline.stages.trace.stage "
        "(stages.trace (layer 6)): upward import",
        "pipeline.dtensor.glue:1 (dtensor (layer 2)) imports pipeline.solvers.mrf "
        "(solvers (layer 2)): independent units of one layer",
    ]
    assert import_cycles(graph) == [["pipeline.core.b", "pipeline.core.c", "pipeline.core.b"]]
    assert long_modules(tmp_path) == [f"pipeline.stages.trace.stage: {MAX_LINES + 1} lines "
                                      f"(at most {MAX_LINES})"]


def test_checker_allows_own_lane_downward(tmp_path: Path) -> None:
    _plant(tmp_path, {
        "__init__.py": "",
        "memory/__init__.py": "",
        "memory/m.py": "from pipeline.core import x\n",
        "costmodel/__init__.py": "",
        "costmodel/c.py": "from pipeline.memory import m\nimport pipeline.costmodel\n",
        "core/__init__.py": "",
        "core/x.py": "",
        "stages/__init__.py": "",
        "stages/solve/__init__.py": "",
        "stages/solve/stage.py": "from pipeline.stages.trace import stage\n",
        "stages/trace/__init__.py": "",
        "stages/trace/stage.py": "from pipeline.stages.solve import stage\n",
    })
    graph = import_graph(tmp_path)
    assert layering_violations(graph) == [
        "pipeline.stages.trace.stage:1 (stages.trace (layer 6)) imports "
        "pipeline.stages.solve.stage (stages.solve (layer 6)): upward import within the layer"]


@pytest.mark.parametrize("module", ["pipeline.stages.trace.stamp", "pipeline.tools.bench.cli",
                                    "pipeline.calibrate", "pipeline.tools.calibrate.run",
                                    "pipeline.costmodel.profile"])
def test_every_real_module_maps_to_a_unit(module: str) -> None:
    assert unit_of(module, units()) is not None
