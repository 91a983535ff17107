"""Process-level helpers shared by every stage: atomic writes, timing, peak
memory, environment and revision records.

Artifacts are written to a temporary file in the destination directory and
renamed into place (``os.replace`` is atomic on POSIX), so a reader never sees
a half-written file and a failed stage leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.core.errors import WriteError

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class AtomicGroup:
    """Files written together: each goes to its temporary file, and all are renamed into
    place only when the group ends without an error, in the order they were written (a
    sentinel written last is renamed last); on an error every temporary file is removed
    and the files already in place are untouched. Renames within one directory need no
    space, so an OS error while writing (no space left, a size limit) leaves the old set
    whole. Use :func:`atomic_group`."""

    def __init__(self) -> None:
        self.pending: list[tuple[Path, Path]] = []

    def _commit(self) -> None:
        while self.pending:
            tmp, final = self.pending[0]
            try:
                os.replace(tmp, final)
            except OSError as err:
                raise _write_error(final, err) from None
            self.pending.pop(0)

    def _discard(self) -> None:
        for tmp, _ in self.pending:
            tmp.unlink(missing_ok=True)
        self.pending.clear()


@contextlib.contextmanager
def atomic_group() -> Iterator[AtomicGroup]:
    """A group of atomic writes (:class:`AtomicGroup`): pass it as ``group=`` to
    :func:`atomic_path`, :func:`write_json` or :func:`write_parquet`."""
    group = AtomicGroup()
    try:
        yield group
        group._commit()
    finally:
        group._discard()


def _write_error(path: Path, err: OSError) -> Exception:
    return err if isinstance(err, WriteError) else WriteError.of(err.filename or path, err)


@contextlib.contextmanager
def atomic_path(final: Path | str, group: AtomicGroup | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``final``; rename it to ``final`` on success (with
    ``group``: when the group ends, :class:`AtomicGroup`).

    On an exception the temporary file is removed and ``final`` is untouched. An OS
    error (no space left, permission denied, a read-only file system, a file size
    limit) raises :class:`pipeline.core.errors.WriteError`: one line naming the file
    and the error.
    """
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        os.close(fd)
    except OSError as err:
        raise _write_error(final, err) from None
    tmp_path = Path(tmp)
    try:
        try:
            yield tmp_path
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp makes 0600; artifacts are shared
            if group is not None:
                group.pending.append((tmp_path, final))
                return
            os.replace(tmp_path, final)
        except OSError as err:
            raise _write_error(final, err) from None
    finally:
        if (group is None or (tmp_path, final) not in group.pending) and tmp_path.exists():
            tmp_path.unlink()


def write_json(path: Path | str, obj: Any, group: AtomicGroup | None = None) -> None:
    """Write ``obj`` as indented JSON with sorted keys, atomically."""
    with atomic_path(path, group) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def write_parquet(path: Path | str, table: Any, metadata: dict[str, Any] | None = None,
                  group: AtomicGroup | None = None) -> None:
    """Write a ``pyarrow.Table`` to Parquet atomically (with ``group``: with the others of
    the group); ``metadata`` goes in the schema metadata as JSON under the key
    ``pipeline``."""
    import pyarrow.parquet as pq

    if metadata is not None:
        meta = dict(table.schema.metadata or {})
        meta[b"pipeline"] = json.dumps(metadata, sort_keys=True, default=_json_default).encode()
        table = table.replace_schema_metadata(meta)
    with atomic_path(path, group) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_parquet(path: Path | str, columns: list[str] | None = None) -> Any:
    """Read one Parquet file as a ``pyarrow.Table`` (schema metadata kept).

    ``pyarrow.parquet.ParquetFile`` reads the file directly; ``pq.read_table`` would go
    through ``pyarrow.dataset``, whose import pulls in pandas (0.6 s of every run's start,
    for the same table)."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as f:
        return f.read(columns=columns)


def peak_rss_bytes() -> dict[str, int]:
    """Peak resident set size of this process and of its waited-for children (bytes).

    ``ru_maxrss`` is in KiB on Linux (getrusage(2)); macOS reports bytes.
    """
    scale = 1 if sys.platform == "darwin" else 1024
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale
    return {"self": int(own), "children": int(kids), "max": int(max(own, kids))}


class PhaseTimer:
    """Accumulates wall time per phase name (seconds), e.g. ``trace``, ``solve``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def release_free_memory() -> None:
    """Return the C heap's free pages to the operating system (glibc ``malloc_trim``;
    nothing elsewhere). Numpy arrays below glibc's mmap threshold live on that heap,
    and a freed one keeps its pages resident until this is called."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:  # noqa: BLE001 - a missing optional package is reported as None
        return None


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux) or platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded in every run record."""
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "pulp": _version("pulp"),
        "highspy": _version("highspy"),
        "snakemake": _version("snakemake"),
        "hydra_core": _version("hydra-core"),
        "numpy": _version("numpy"),
        "pyarrow": _version("pyarrow"),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
    }


def git_revision(root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """``{"revision": sha or None, "dirty": bool or None}`` of the project checkout.

    Read-only: ``GIT_OPTIONAL_LOCKS=0`` keeps ``git status`` from refreshing the index
    (which takes ``index.lock``: a run cut short by a signal or a file size limit would
    leave the lock behind, and git commands in the checkout would then fail)."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True, timeout=10, env=env).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=root, capture_output=True, text=True, check=True,
                                timeout=10, env=env).stdout
        return {"revision": rev, "dirty": bool(status.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None}
