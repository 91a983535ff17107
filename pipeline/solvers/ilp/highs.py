"""The HiGHS backend of the integer program (``highspy``).

The :class:`~pipeline.solvers.ilp.model.IlpModel` CSC arrays are handed to HiGHS
through ``highspy.Highs.passModel(HighsLp)`` (HiGHS docs, "Python interface /
passModel"). The MPS file is written by ``highspy.Highs.writeModel`` (HiGHS
picks the format from the ``.mps`` suffix; the objective offset is stored as
the RHS of the objective row, which CBC and HiGHS both honour); the CBC backend
(pipeline/solvers/ilp/cbc.py) reads that file. HiGHS' model status is mapped by
:func:`pipeline.solvers.status.map_highs_status`.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.solvers.ilp.model import BackendOutcome, IlpModel
from pipeline.solvers.status import FEASIBLE_TIME_LIMIT, NOT_SOLVED, OPTIMAL, map_highs_status

__all__ = ["highs_lp", "new_highs", "run_interruptible", "solve_highs", "write_mps",
           "write_mps_highs"]


def highs_lp(model: IlpModel, *, relax: bool, names: bool):
    """The model as a ``highspy.HighsLp`` (column-wise matrix, minimise)."""
    import highspy

    lp = highspy.HighsLp()
    lp.num_col_ = model.num_cols
    lp.num_row_ = model.num_rows
    lp.col_cost_ = model.col_cost
    lp.col_lower_ = np.zeros(model.num_cols)
    lp.col_upper_ = np.ones(model.num_cols)
    lp.row_lower_ = model.row_lower
    lp.row_upper_ = model.row_upper
    lp.offset_ = model.offset
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_ = model.num_cols
    lp.a_matrix_.num_row_ = model.num_rows
    lp.a_matrix_.start_ = model.a_start
    lp.a_matrix_.index_ = model.a_index
    lp.a_matrix_.value_ = model.a_value
    if not relax:
        k_int = highspy.HighsVarType.kInteger
        k_cont = highspy.HighsVarType.kContinuous
        lp.integrality_ = [k_int] * model.num_x + [k_cont] * model.num_y
    if names:
        lp.col_names_ = model.col_names()
        lp.row_names_ = model.row_names()
    return lp


_HIGHS_THREADS: list[int] = []


@contextlib.contextmanager
def _stdout_to_devnull() -> Iterator[None]:
    """Send file descriptor 1 (C-level stdout) to /dev/null for the block."""
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def new_highs(msg: bool, threads: int):
    """A ``highspy.Highs`` with output ``msg`` and ``threads`` threads (banner silenced)."""
    import highspy

    # HiGHS keeps one global task scheduler per process; asking a later solve
    # for a different thread count fails unless the scheduler is reset first.
    if _HIGHS_THREADS and _HIGHS_THREADS[0] != threads:
        highspy.Highs.resetGlobalScheduler(True)
    _HIGHS_THREADS[:] = [threads]
    if msg:
        h = highspy.Highs()
    else:
        with _stdout_to_devnull():  # the constructor prints a banner before any option
            h = highspy.Highs()
    h.setOptionValue("output_flag", bool(msg))
    h.setOptionValue("threads", int(threads))
    return h


def write_mps_highs(h, path: Path) -> float:
    """Write the model held by ``h`` to ``path`` atomically; return seconds."""
    t0 = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".mps", dir=path.parent)
    os.close(fd)
    try:
        status = h.writeModel(tmp)
        if status.name != "kOk" and status.name != "kWarning":
            raise OSError(f"HiGHS writeModel({tmp}) returned {status}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return time.perf_counter() - t0


def write_mps(model: IlpModel, path: str | Path, *, relax: bool = False) -> float:
    """Write ``model`` (``relax``: without integrality) as an MPS file.

    Names follow the module docstring so a re-solve can be mapped back. The
    file is written through HiGHS' ``writeModel`` (atomic rename into place).

    Returns:
        Seconds spent (name generation + pass + write).
    """
    t0 = time.perf_counter()
    h = new_highs(False, _HIGHS_THREADS[0] if _HIGHS_THREADS else 1)
    h.passModel(highs_lp(model, relax=relax, names=True))
    write_mps_highs(h, Path(path))
    return time.perf_counter() - t0


def run_interruptible(h: Any) -> None:
    """``h.run()`` in HiGHS's own solver thread (highspy ``startSolve``) while this
    thread waits in short slices, so that a signal handled here (SIGINT's
    ``KeyboardInterrupt``; SIGTERM under :func:`pipeline.solvers.ilp.interrupts.
    signals_raise`) reaches Python at once: the solve is cancelled through HiGHS's
    user-interrupt callback (``cancelSolve``), this thread waits for the solver to stop,
    and the exception propagates (so every ``finally`` runs and no temp file stays). The
    callback only polls a flag: the solve and its result are unchanged."""
    h.HandleUserInterrupt = True
    h.startSolve()
    try:
        while not h.wait(0.1)[0]:
            pass
    except BaseException:
        h.cancelSolve()
        while not h.wait(0.1)[0]:
            pass
        raise


def solve_highs(model: IlpModel, *, relax: bool, time_limit_s: float | None, mip_gap: float,
                threads: int, msg: bool, mps_path: str | Path | None) -> BackendOutcome:
    """Solve ``model`` (``relax``: its LP relaxation) with HiGHS; see the module docstring."""
    t0 = time.perf_counter()
    h = new_highs(msg, threads)
    names = mps_path is not None
    lp = highs_lp(model, relax=relax, names=names)
    h.passModel(lp)
    del lp
    pass_seconds = time.perf_counter() - t0
    extra = {"pass_seconds": pass_seconds}
    if mps_path is not None:
        extra["mps_seconds"] = write_mps_highs(h, Path(mps_path))
    if time_limit_s is not None:
        h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("random_seed", 0)
    if relax:
        # Interior point + crossover: a basic (vertex) optimum, ~7x faster than
        # dual simplex on the degenerate local-polytope LPs measured here.
        h.setOptionValue("solver", "ipm")
        h.setOptionValue("run_crossover", "on")
    t1, c1 = time.perf_counter(), time.process_time()
    run_interruptible(h)
    wall, cpu = time.perf_counter() - t1, time.process_time() - c1
    info = h.getInfo()
    model_status = h.getModelStatus()
    has_solution = int(info.primal_solution_status) == 2
    status = map_highs_status(model_status, has_solution)
    if relax and status == FEASIBLE_TIME_LIMIT:
        status = NOT_SOLVED  # an LP stopped early gives neither a bound nor an optimum
    col_value = None
    if has_solution and status in (OPTIMAL, FEASIBLE_TIME_LIMIT):
        col_value = np.asarray(h.getSolution().col_value, dtype=np.float64)
    obj = float(info.objective_function_value) if col_value is not None else math.inf
    if relax:
        bound = obj if status == OPTIMAL else -math.inf
        gap = 0.0 if status == OPTIMAL else math.inf
        iterations = int(info.ipm_iteration_count) + int(info.simplex_iteration_count)
    else:
        bound = float(info.mip_dual_bound)
        gap = float(info.mip_gap)
        iterations = int(info.mip_node_count)
    extra.update(
        highs_model_status=model_status.name,
        simplex_iterations=int(info.simplex_iteration_count),
        ipm_iterations=int(info.ipm_iteration_count),
        mip_nodes=int(info.mip_node_count) if not relax else 0,
        wall_solve_seconds=wall,
        backend_cpu_seconds=cpu,
    )
    return BackendOutcome(status, col_value, obj, bound, gap, float(h.getRunTime()), iterations,
                          extra)
