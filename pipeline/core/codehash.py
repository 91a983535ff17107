"""The code hash of a stage: the source of every project module the stage imports.

A stage's artifacts are reused while its *code hash* is unchanged (the stamp's ``code``
field, the Snakemake rule's ``params.code``), so the hash must move whenever code that
the stage runs changes, and only then. It is derived from the imports, not from a
hand-kept list of files:

1. start from the stage's entry modules (:data:`pipeline.config.paths.STAGE_ENTRIES`);
2. parse each module (``ast``, nothing is imported) and collect every ``import
   pipeline...`` / ``from pipeline... import ...`` / relative import, at module level
   *and* inside functions (a stage's lazy imports run as surely as its top-level ones);
3. resolve each to a module file of this checkout (``from pipeline.x import y`` is the
   module ``pipeline.x.y`` when that exists, else the package ``pipeline.x``), adding
   the ``__init__`` of every enclosing package (Python runs it first);
   a module loaded by name (``importlib.import_module``) is not seen: name it among the
   entries (the trace stage's model families, :data:`pipeline.config.paths.STAGE_ENTRIES`);
4. repeat until no new module appears, then hash the sorted relative paths and contents.

Modules outside ``pipeline`` (torch, numpy) are pinned by ``pyproject.toml`` and recorded
in every run record's environment; they do not enter the hash.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path

__all__ = ["imported_modules", "module_file", "source_hash"]

_PACKAGE = "pipeline"


def module_file(name: str, root: Path) -> Path | None:
    """The source file of module ``name`` under ``root`` (a module or a package's
    ``__init__.py``), or None when ``name`` is not a module of the checkout."""
    parts = name.split(".")
    base = root.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, root: Path) -> set[str]:
    """Project modules ``name`` (at ``path``) imports anywhere in its body."""
    st = path.stat()
    return set(_imports_cached(name, path, root, st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=4096)
def _imports_cached(name: str, path: Path, root: Path, mtime_ns: int, size: int
                    ) -> frozenset[str]:
    tree = ast.parse(path.read_bytes(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == _PACKAGE or alias.name.startswith(_PACKAGE + "."):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if not _is_package(path):
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == _PACKAGE or target.startswith(_PACKAGE + ".")):
                continue
            found.add(target)
            for alias in node.names:  # ``from pipeline.x import y``: y may be a module
                if module_file(f"{target}.{alias.name}", root) is not None:
                    found.add(f"{target}.{alias.name}")
    closed: set[str] = set()
    for mod in found:  # a module's enclosing packages run their __init__ first
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):
            closed.add(".".join(parts[:i]))
    return frozenset(m for m in closed if module_file(m, root) is not None)


def imported_modules(entries: Iterable[str], root: Path) -> dict[str, Path]:
    """Every project module reachable from ``entries`` through imports, with its file."""
    todo = list(entries)
    seen: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = module_file(name, root)
        if path is None:
            raise ValueError(f"{name}: not a module under {root}")
        seen[name] = path
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(_imports(name, path, root) - seen.keys())
    return seen


@functools.lru_cache(maxsize=64)
def _cached_hash(entries: tuple[str, ...], root: Path, stamp: tuple) -> str:
    files = sorted(imported_modules(entries, root).values())
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def source_hash(entries: Iterable[str], root: Path) -> str:
    """SHA-256 (16 hex digits) over the paths and contents of the modules that
    ``entries`` import, transitively (see the module docstring)."""
    entries = tuple(sorted(entries))
    # keyed by the files' mtimes and sizes too, so an edit in a long-lived process
    # (a test) is seen; the walk itself is ~20 ms for a stage
    files = imported_modules(entries, root).values()
    stamp = tuple(sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files))
    return _cached_hash(entries, root, stamp)
