"""Interrupts of an exact solve: SIGTERM and SIGINT end it like an exception.

Python's default SIGTERM action ends the process at once: no ``finally`` runs, so a
solver child process (the CBC binary, pipeline/solvers/ilp/cbc.py) is re-parented and
keeps running, and temporary files (CBC's directory, HiGHS' ``.model.*.mps`` next to
``model.mps``) stay. :func:`signals_raise` turns SIGTERM into ``SystemExit(143)`` for its
block (SIGINT already raises ``KeyboardInterrupt``), so ``subprocess.run`` kills its
child and every ``finally`` / context manager removes its temp files.
:func:`die_with_parent` is the ``preexec_fn`` of a child that must not outlive this
process even when it is killed outright (``SIGKILL``; Linux ``PR_SET_PDEATHSIG``).
:func:`remove_stale_temps` removes the temp files an earlier, killed writer left.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

__all__ = ["TEMP_PATTERNS", "die_with_parent", "remove_stale_temps", "signals_raise"]

#: Temp files of the atomic writers in a stage directory: ``runtime.atomic_path``
#: (``.<name>.<random>.tmp``) and HiGHS' ``write_mps_highs`` (``.<stem>.<random>.mps``).
TEMP_PATTERNS: tuple[str, ...] = (".*.tmp", ".*.mps")

_PR_SET_PDEATHSIG = 1


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit(128 + SIGTERM)`` (exit status 143,
    as the signal's default action reports it) if the default action was in place.

    Only the main thread may set handlers; elsewhere, or when a handler was installed by
    the caller (e.g. the benchmark runner), the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def die_with_parent() -> None:
    """``preexec_fn`` of a solver child: the kernel sends it SIGTERM when this process
    dies (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing is done)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def remove_stale_temps(directory: Path | str) -> list[Path]:
    """Remove the temp files (:data:`TEMP_PATTERNS`) in ``directory``; call it only while
    holding the directory's stage lock (no other writer is running). Returns them."""
    directory = Path(directory)
    found = sorted({p for pat in TEMP_PATTERNS for p in directory.glob(pat) if p.is_file()})
    for p in found:
        p.unlink(missing_ok=True)
    return found
