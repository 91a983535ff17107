"""What an exact solve stopped early returns: its incumbent when that is a plan, else a
plan found before it (the TRW-S plan the pruning step solved against), as a
``Heuristic`` result with the best lower bound either method proved.

**A plan.** A labelling is a plan of the MRF when its energy ``E(x)`` is finite (no
forbidden label or pair) and every linear row holds,
``low_c - tol <= sum_g coef_c[g][x_g] <= high_c + tol`` with
``tol = 1e-6 * max(1, |low_c|, |high_c|)`` (the backend's own feasibility tolerance, as
:func:`violated_rows` checks it). A backend stopped by its time limit (HiGHS
``kTimeLimit``, CBC ``-sec``) may hold an incumbent that is none: HiGHS and CBC accept
a point within their primal tolerances, which a row near its bound can miss by more, and
a CBC run killed at its hard limit leaves no solution file at all.

**The bound.** Two lower bounds on ``min E`` are valid at once: the backend's dual bound
of the program it solved, and the fallback plan's own bound (the TRW-S dual,
Kolmogorov 2006). With pruning the program is the pruned one, whose bounds are bounds
of the full problem (:mod:`pipeline.solvers.pruning`: the labels removed are in no
labelling cheaper than the TRW-S plan, so both problems have the same optimum). The
result carries ``min(E(fallback), max(dual bound, fallback bound))``, and the gap
``(E - bound) / max(1, |E|)`` (:func:`pipeline.solvers.result.relative_gap`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from pipeline.solvers.mrf import MRF, row_value
from pipeline.solvers.result import SolverResult, relative_gap
from pipeline.solvers.status import HEURISTIC

__all__ = ["fallback_result", "no_plan_message", "plan_problem", "violated_rows"]


def violated_rows(mrf: MRF, labels: np.ndarray, tol: float = 1e-6) -> list[str]:
    """Names of the linear rows ``labels`` violates by more than ``tol`` relative to
    ``max(1, |low|, |high|)`` (the finite ones)."""
    bad = []
    for lc in mrf.linear_constraints:
        val = row_value(lc, labels)
        scale = tol * max(
            1.0,
            abs(lc.low) if math.isfinite(lc.low) else 1.0,
            abs(lc.high) if math.isfinite(lc.high) else 1.0,
        )
        if val < lc.low - scale or val > lc.high + scale:
            bad.append(lc.name)
    return bad


def plan_problem(mrf: MRF, labels: np.ndarray) -> str | None:
    """Why ``labels`` is not a plan of ``mrf`` (one phrase), or None when it is one: a
    label out of range, an infinite energy, or the rows it violates."""
    labels = np.asarray(labels, dtype=np.int64)
    sizes = np.asarray(mrf.domain_sizes)
    if labels.shape != sizes.shape or (labels < 0).any() or (labels >= sizes).any():
        return "no label for every group"
    energy = mrf.evaluate(labels)
    if not math.isfinite(energy):
        return f"energy {energy} (a forbidden label or pair)"
    bad = violated_rows(mrf, labels)
    return f"violates the rows {', '.join(bad)}" if bad else None


def fallback_result(mrf: MRF, fallback: SolverResult, stopped: SolverResult,
                    why: str) -> SolverResult | None:
    """The fallback plan as the result of the stopped exact solve ``stopped``, or None
    when ``fallback`` is not a plan of ``mrf`` (:func:`plan_problem`).

    Status ``Heuristic``; the bound and its source as in the module docstring;
    ``iterations``, ``solve_seconds`` and ``extra`` are the stopped solve's, with
    ``exact_status`` (its own status), ``fallback`` (the fallback's bound source, e.g.
    ``trws``), ``fallback_reason`` (``why``) and ``gap`` added.
    """
    labels = np.asarray(fallback.labels, dtype=np.int64)
    if plan_problem(mrf, labels) is not None:
        return None
    objective = float(mrf.evaluate(labels))
    bound, source = float(fallback.lower_bound), str(fallback.lower_bound_source)
    if math.isfinite(stopped.lower_bound) and stopped.lower_bound > bound:
        bound, source = float(stopped.lower_bound), str(stopped.lower_bound_source)
    bound = min(objective, bound)
    extra: dict[str, Any] = dict(stopped.extra)
    extra.update(exact_status=stopped.status, fallback=str(fallback.lower_bound_source),
                 fallback_reason=why, gap=relative_gap(objective, bound))
    return dataclasses.replace(stopped, labels=labels, objective=objective, lower_bound=bound,
                               lower_bound_source=source, status=HEURISTIC,
                               bound_history=[bound], extra=extra)


def no_plan_message(solver: str, result: SolverResult, time_limit_s: float | None,
                    pruned: bool) -> str:
    """One line for an exact solve that ended without a plan and without a fallback
    (``pruned``: whether TRW-S ran before it): the key to change, its value and what is
    allowed."""
    backend = str(result.extra.get("backend", "?"))
    how = result.extra.get("highs_model_status") or result.extra.get("cbc_result") \
        or result.status
    why = ("TRW-S found no plan to fall back on" if pruned
           else "no TRW-S plan to fall back on (solver.prune=false)")
    return (f"solver.time_limit_s={time_limit_s}: solver={solver} ({backend}) ended without "
            f"a feasible plan ({how}) and {why}; allowed a larger solver.time_limit_s or null "
            "(no limit), or solver.prune=true")
