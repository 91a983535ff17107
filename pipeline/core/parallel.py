"""Run independent parts of a stage in forked worker processes (``workers`` config key).

The phases whose parts do not depend on each other (the DTensor strategies of distinct
op signatures in the topology stage, the pairwise group factors of the costs) are split
into *chunks*, one per worker. :func:`map_chunks` runs the first chunk in the calling
process and every other chunk in a child made by ``fork``: the child inherits the
caller's state (the cost model, the caches built so far) without pickling it, and sends
back only its chunk's result (pickled, through a pipe). Results come back in chunk
order, and each part's value is computed by the same code whichever process runs it,
so the outcome is the same as running the chunks one after another (tests compare
them bit for bit).

``fork`` copies the process lazily (copy on write); each child's own growth shows in
the run record's ``peak_rss_bytes.children`` (``getrusage(RUSAGE_CHILDREN)``: the
largest child). Where ``fork`` is not available (not Linux/macOS) the chunks run one
after another in the caller.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["WorkerError", "balanced_chunks", "map_chunks", "resolve_workers"]

T = TypeVar("T")
R = TypeVar("R")


class WorkerError(RuntimeError):
    """A worker process failed without an exception the caller can re-raise (killed,
    out of memory, or an exception that cannot be pickled); the message says which."""


def resolve_workers(setting: int) -> int:
    """The number of processes for a ``workers`` setting: ``0`` = one per CPU this
    process may run on (``os.sched_getaffinity``, else ``os.cpu_count``), ``n >= 1`` =
    ``n``."""
    if setting < 0:
        raise ValueError(f"workers={setting}: allowed 0 (one per available CPU) or a "
                         "positive number of processes")
    if setting:
        return int(setting)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def balanced_chunks(weights: Sequence[float], parts: int) -> list[list[int]]:
    """Indices ``0..len(weights)-1`` split into at most ``parts`` chunks of about equal
    total weight: longest-processing-time-first (each index, heaviest first, to the
    lightest chunk so far; ties by index), each chunk sorted. Deterministic; empty chunks
    are dropped."""
    parts = max(1, min(int(parts), len(weights)))
    load = [0.0] * parts
    chunks: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(weights)), key=lambda k: (-float(weights[k]), k)):
        j = min(range(parts), key=lambda k: (load[k], k))
        chunks[j].append(i)
        load[j] += float(weights[i])
    return [sorted(c) for c in chunks if c]


def _run_child(conn: Any, fn: Callable[[Any], Any], chunk: Any) -> None:
    # A forked child inherits the parent's handlers, e.g. python -m pipeline's, which turn
    # SIGTERM into an exception (pipeline/core/interrupts.py): the parent's clean-up
    # terminating a child that has sent its result but not yet exited then printed a
    # traceback. The parent decides: SIGINT ignored, SIGTERM ends the child silently.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        message: tuple = ("ok", fn(chunk))
    except BaseException as err:  # sent to the parent, which raises it
        message = ("error", err, traceback.format_exc())
    try:
        conn.send(message)
    except Exception as err:  # the result or the exception does not pickle
        conn.send(("error", None, f"{type(err).__name__}: {err}\n{message[-1]}"))
    finally:
        conn.close()


def map_chunks(fn: Callable[[T], R], chunks: Sequence[T]) -> list[R]:
    """``[fn(c) for c in chunks]``, the chunks after the first in forked children.

    Raises:
        whatever ``fn`` raised (in the calling process or a child; a child's traceback
        is attached as the exception's ``__notes__``), or :class:`WorkerError` for a
        child that died or sent something that cannot be unpickled.
    """
    if len(chunks) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [fn(c) for c in chunks]
    ctx = multiprocessing.get_context("fork")
    children: list[tuple[Any, Any]] = []
    try:
        for chunk in chunks[1:]:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_run_child, args=(send, fn, chunk), daemon=True)
            proc.start()
            send.close()
            children.append((proc, recv))
        results: list[Any] = [fn(chunks[0])]
        for k, (proc, recv) in enumerate(children, start=1):
            try:
                status, *payload = recv.recv()
            except EOFError:
                proc.join()
                raise WorkerError(f"worker {k} of {len(chunks)} exited with code "
                                  f"{proc.exitcode} before sending its result (killed "
                                  "or out of memory?); set workers=1 to run serially"
                                  ) from None
            if status == "error":
                err, text = payload
                if isinstance(err, BaseException):
                    err.add_note(f"in worker {k} of {len(chunks)}:\n{text}")
                    raise err
                raise WorkerError(f"worker {k} of {len(chunks)} failed: {text.splitlines()[0]}")
            results.append(payload[0])
        return results
    finally:
        for proc, recv in children:
            recv.close()
            if proc.is_alive():
                proc.terminate()
            proc.join()
