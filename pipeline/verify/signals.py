"""SIGINT and SIGTERM during verify: the run ends within seconds, worker processes
included, with one line and exit status 128 + the signal's number (130, 143).

* The parent (:func:`handled`) turns either signal into :class:`Interrupted`, which
  unwinds the stages (a stage cut short leaves nothing it would trust: its temporary
  files are removed, :mod:`pipeline.stages.runner`) and :func:`run_workers`.
* :func:`run_workers` waits for the workers in short slices; on :class:`Interrupted` it
  sends each live worker SIGTERM, waits :data:`GRACE_S` seconds, then SIGKILLs the
  rest, and re-raises. A terminal's Ctrl-C sends SIGINT to the whole process group, a
  ``kill -INT <pid>`` to the parent alone: either way the parent stops the workers.
* Each worker (:func:`quiet_worker`) ignores SIGINT (the parent decides; no
  ``KeyboardInterrupt`` traceback per rank), keeps SIGTERM's default action (it ends at
  once, silently) and asks the kernel for SIGTERM when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``, Linux), so a parent killed with SIGKILL leaves no
  worker running.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from pipeline.core.interrupts import SIGNALS as _SIGNALS
from pipeline.core.interrupts import Interrupted, handled

__all__ = ["GRACE_S", "Interrupted", "handled", "quiet_worker", "run_workers"]

#: Seconds a worker has to end after SIGTERM before it is killed.
GRACE_S = 3.0
#: How often (seconds) the parent looks up from waiting for its workers.
_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def quiet_worker(rank: int, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(rank, *args)`` in a worker process with the signal dispositions of the
    module docstring."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    fn(rank, *args)


def run_workers(fn: Callable[..., None], args: tuple, nprocs: int, start_method: str) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` joined in slices of
    :data:`_POLL_S` seconds, every worker stopped when :class:`Interrupted` arrives (or
    anything else unwinds the parent). A worker that fails raises as ``join`` does."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(quiet_worker, args=(fn, *args), nprocs=nprocs,
                             start_method=start_method, join=False)
    try:
        while not ctx.join(timeout=_POLL_S):
            pass
    except BaseException:
        ignored = {s: signal.signal(s, signal.SIG_IGN) for s in _SIGNALS}
        try:  # a second Ctrl-C does not cut the clean-up short
            stop(ctx.processes)
        finally:
            for s, handler in ignored.items():
                signal.signal(s, handler)
        raise


def stop(processes: list[Any]) -> None:
    """SIGTERM every live process, wait up to :data:`GRACE_S` seconds in all, SIGKILL
    those left, and reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()
