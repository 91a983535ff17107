"""The CBC backend of the integer program (the binary bundled with PuLP).

The CBC binary (``pulp.PULP_CBC_CMD().path``) runs on the MPS file written by
HiGHS (pipeline/solvers/ilp/highs.py), with the command-line options PuLP's
``PULP_CBC_CMD`` would pass; the solution file is read by PuLP's own
``COIN_CMD.get_status`` so the ``(status, sol_status)`` pair is exactly PuLP's,
then mapped by :func:`pipeline.solvers.status.map_pulp_status`. The gap is
:func:`pipeline.solvers.result.relative_gap` of the objective and CBC's bound.

Going through ``pulp.LpProblem`` instead was measured (5.6e6 columns, 1.31e7
nonzeros, 2 cores): 38 s to build the PuLP objects (2.9 µs per nonzero), 82 s
for PuLP's own ``writeMPS`` (which ``PULP_CBC_CMD`` always calls, and which
drops the objective constant) and 10.7 GB peak RSS, against 2.3 s for
:func:`~pipeline.solvers.ilp.model.build_model` plus 15-21 s for HiGHS'
``writeModel`` including names; so PuLP objects are not built.
"""

from __future__ import annotations

import decimal
import math
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from pipeline.solvers.ilp.highs import highs_lp, new_highs, write_mps_highs
from pipeline.solvers.ilp.interrupts import die_with_parent
from pipeline.solvers.ilp.model import BackendOutcome, IlpModel
from pipeline.solvers.result import relative_gap
from pipeline.solvers.status import (
    FEASIBLE_TIME_LIMIT,
    INFEASIBLE,
    NOT_SOLVED,
    OPTIMAL,
    map_pulp_status,
)

__all__ = ["CBC_HARD_LIMIT_FACTOR", "parse_cbc_log", "solve_cbc"]

CBC_HARD_LIMIT_FACTOR = 2.0
"""CBC is killed after ``max(2 * time_limit_s, time_limit_s + 60)`` s of wall time."""


_CBC_FLOAT = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf|infinity|nan))"


def parse_cbc_log(text: str) -> dict:
    """Extract the summary of a CBC run from its stdout.

    Returns a dict with any of: ``result`` (the "Result - ..." phrase),
    ``objective``, ``lower_bound`` (as printed, i.e. rounded),
    ``lower_bound_rounding`` (half a unit of its last printed digit), ``gap``,
    ``nodes``, ``iterations``, ``wall_seconds``, ``cpu_seconds``.
    """
    out: dict = {}
    pats = {
        "objective": r"^Objective value:\s*" + _CBC_FLOAT,
        "lower_bound": r"^Lower bound:\s*" + _CBC_FLOAT,
        "gap": r"^Gap:\s*" + _CBC_FLOAT,
        "nodes": r"^Enumerated nodes:\s*(\d+)",
        "iterations": r"^Total iterations:\s*(\d+)",
        "cpu_seconds": r"^Total time \(CPU seconds\):\s*" + _CBC_FLOAT,
        "wall_seconds": r"^Total time \(CPU seconds\):.*\(Wallclock seconds\):\s*" + _CBC_FLOAT,
    }
    for key, pat in pats.items():
        m = re.findall(pat, text, flags=re.MULTILINE | re.IGNORECASE)
        if m:
            val = m[-1]
            out[key] = int(val) if key in ("nodes", "iterations") else float(val)
            if key == "lower_bound" and math.isfinite(out[key]):
                # CBC rounds the bound it prints (e.g. 3 decimals); step down by
                # half a unit of the last printed digit so it stays a valid bound.
                exponent = decimal.Decimal(val).as_tuple().exponent
                out["lower_bound_rounding"] = 0.5 * 10.0 ** int(exponent)
    m = re.findall(r"^Result - (.*)$", text, flags=re.MULTILINE)
    if m:
        out["result"] = m[-1].strip()
    return out


def _read_cbc_solution(path: str, num_cols: int) -> np.ndarray:
    """Column values from a CBC ``-solution`` file (rows ``idx name value dj``)."""
    values = np.zeros(num_cols)
    with open(path) as fh:
        fh.readline()
        for line in fh:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "**":
                parts = parts[1:]
            idx = int(parts[0])
            if idx < num_cols:
                values[idx] = float(parts[2])
    return values


def solve_cbc(model: IlpModel, *, relax: bool, time_limit_s: float | None, mip_gap: float,
              threads: int, msg: bool, mps_path: str | Path | None) -> BackendOutcome:
    """Solve ``model`` (``relax``: its LP relaxation) with PuLP's CBC binary on the MPS
    file written by HiGHS; see the module docstring."""
    import warnings

    import pulp

    with warnings.catch_warnings():  # PuLP 3.3 deprecates PULP_CBC_CMD (removal in 4.0)
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=False)
    if not solver.available():
        raise RuntimeError(f"PuLP's bundled CBC is not executable: {solver.path}")
    extra: dict = {}
    with tempfile.TemporaryDirectory(prefix="ilp_cbc_") as tmp:
        t0 = time.perf_counter()
        h = new_highs(False, threads)
        h.passModel(highs_lp(model, relax=relax, names=True))
        # CBC reads the requested MPS file itself (written once), else a temp one.
        run_mps = str(mps_path) if mps_path is not None else os.path.join(tmp, "model.mps")
        write_mps_highs(h, Path(run_mps))
        del h
        extra["mps_seconds"] = time.perf_counter() - t0
        sol = os.path.join(tmp, "model.sol")
        args = [solver.path, run_mps]
        if time_limit_s is not None:
            args += ["-sec", repr(float(time_limit_s))]
        args += ["-timeMode", "elapsed", "-threads", str(int(threads))]
        if not relax:
            args += ["-ratio", repr(float(mip_gap))]
        args += ["-initialSolve" if relax else "-solve", "-solution", sol]
        # CBC checks -sec only between phases (not inside the root LP), so a
        # run is killed once it overruns the limit by CBC_HARD_LIMIT_FACTOR.
        hard = None
        if time_limit_s is not None:
            hard = max(CBC_HARD_LIMIT_FACTOR * float(time_limit_s), float(time_limit_s) + 60.0)
        t1 = time.perf_counter()
        killed = False
        try:
            proc = subprocess.run(
                args,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=hard,
                check=False,
                preexec_fn=die_with_parent,  # not outliving this process, even on SIGKILL
            )
            stdout, returncode = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:  # subprocess.run has killed CBC
            killed = True
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            returncode = None
        wall = time.perf_counter() - t1
        if msg:
            print(stdout)
        log = parse_cbc_log(stdout)
        extra.update(cbc_result=log.get("result"), cbc_returncode=returncode, cbc_killed=killed)
        if killed or returncode != 0 or not os.path.exists(sol):
            status, values = NOT_SOLVED, None
            extra["pulp_status"] = None
        else:
            pulp_status, sol_status = solver.get_status(sol)
            status = map_pulp_status(pulp_status, sol_status)
            extra["pulp_status"] = (int(pulp_status), int(sol_status))
            if status == INFEASIBLE and time_limit_s is not None and wall >= time_limit_s:
                # an infeasibility verdict of a run cut by its time limit is not taken:
                # CBC's preprocessing can call feasible models infeasible (coin-or/Cbc
                # issues #466, #740), and a truncated run cannot have checked it
                status = NOT_SOLVED
                extra["cbc_infeasible_at_time_limit"] = True
            values = _read_cbc_solution(sol, model.num_cols)
    if relax and status == FEASIBLE_TIME_LIMIT:
        status = NOT_SOLVED
    col_value = values if status in (OPTIMAL, FEASIBLE_TIME_LIMIT) else None
    obj = math.inf
    if col_value is not None:
        obj = float(model.col_cost @ col_value + model.offset)
    cbc_obj = log.get("objective")
    # CBC prints "Lower bound:" whenever optimality is not proven outright,
    # including "Optimal solution found (within gap tolerance)" for -ratio > 0.
    bound = -math.inf
    if not relax and "lower_bound" in log:
        bound = float(log["lower_bound"]) - log.get("lower_bound_rounding", 0.0)
        if cbc_obj is not None and col_value is not None:
            bound += obj - float(cbc_obj)  # same offset convention as our objective
    elif status == OPTIMAL:
        bound = obj
    gap = math.inf
    if col_value is not None and math.isfinite(bound):
        gap = max(0.0, relative_gap(obj, bound))
    extra.update(
        cbc_objective=cbc_obj,
        mip_nodes=log.get("nodes", 0),
        simplex_iterations=log.get("iterations", 0),
        wall_solve_seconds=wall,
        backend_cpu_seconds=log.get("cpu_seconds", math.nan),
    )
    iterations = int(log.get("iterations" if relax else "nodes", 0))
    backend_seconds = float(log.get("wall_seconds", wall))
    return BackendOutcome(status, col_value, obj, bound, gap, backend_seconds, iterations, extra)
