"""Side constraints for solvers that only minimise an MRF: Lagrangian relaxation.

Problem: minimise E(x) subject to one linear row ``L <= g(x) <= H`` with
``g(x) = sum_g c_g(x_g)`` (pipeline.solvers.mrf.LinearConstraint).

* Tight row. When ``H`` equals the smallest reachable value ``sum_g min c_g``
  over allowed labels, every feasible x puts each group at a minimum of its
  coefficient, so the row is *exactly* a domain restriction: labels with a
  larger coefficient get unary +inf (no multiplier needed, bound unchanged).
* Otherwise, for a multiplier lambda >= 0 on the violated side (upper: +g,
  lower: -g) and any feasible x, ``E(x) >= E(x) + s*lambda*(g(x) - T)``, hence
  (weak duality; Boyd & Vandenberghe 2004, section 5.2)::

      OPT >= min_x [E(x) + s*lambda*g(x)] - s*lambda*T >= LB_lambda - s*lambda*T

  where LB_lambda is the solver's lower bound of the penalised MRF (for TRW-S
  its dual bound), s = +1 and T = H for the upper row, s = -1 and T = L for the
  lower row. The multiplier is doubled until the penalised solution is
  feasible, then bisected a fixed number of times (deterministic); the best
  feasible labelling (by the unpenalised E) and the best bound are kept.
* Repair. If no penalised solution is feasible, groups are moved greedily to
  the label that reduces the violation most per unit of added energy until
  the row holds.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import numpy as np

from pipeline.solvers.errors import NoFeasibleLabelingError
from pipeline.solvers.mrf import MRF, LinearConstraint
from pipeline.solvers.result import SolverResult, is_certified


def row_value(row: LinearConstraint, labels: np.ndarray) -> float:
    """``g(labels)`` for a row (sum over groups in index order)."""
    return float(sum(float(c[labels[g]]) for g, c in sorted(row.coef.items())))


def _feasible(row: LinearConstraint, value: float) -> bool:
    tol = 1e-9 * max(1.0, abs(row.high if math.isfinite(row.high) else 1.0))
    return row.low - tol <= value <= row.high + tol


def tighten(mrf: MRF, row: LinearConstraint) -> tuple[MRF, bool]:
    """Apply the exact domain restriction when the upper side is tight (see module doc).

    Returns (mrf, True) with restricted unaries when it applies, else (mrf, False).
    """
    reach = 0.0
    for g, c in sorted(row.coef.items()):
        ok = np.isfinite(mrf.unary[g])
        reach += float(c[ok].min())
    if row.high > reach * (1 + 1e-12) + 1e-15:
        return mrf, False
    unary = list(mrf.unary)
    for g, c in sorted(row.coef.items()):
        ok = np.isfinite(unary[g])
        cmin = float(c[ok].min())
        unary[g] = np.where(c <= cmin * (1 + 1e-12) + 1e-15, unary[g], np.inf)
    return replace(mrf, unary=unary), True


def _penalised(mrf: MRF, row: LinearConstraint, lam: float) -> MRF:
    unary = list(mrf.unary)
    for g, c in row.coef.items():
        unary[g] = unary[g] + lam * c
    return replace(mrf, unary=unary, linear_constraints=[])


RowProgressFn = Callable[[int, float, float, bool], None]


def solve_with_row(mrf: MRF, row: LinearConstraint, solve: Callable[[MRF], SolverResult], *,
                   bisect_steps: int = 8, max_doublings: int = 40,
                   progress: RowProgressFn | None = None) -> SolverResult:
    """Minimise E subject to ``row`` with ``solve`` (e.g. TRW-S) as the inner solver.

    ``progress``, if given, is called after every inner solve as
    ``progress(inner_solves, multiplier, row_value, feasible)`` (multiplier signed, 0
    for the unpenalised first solve); it only observes.
    ``result.extra`` gains ``multiplier`` (final lambda, signed), ``row_value``,
    ``inner_solves``, ``tight_row`` and ``repaired``.
    Raises NoFeasibleLabelingError when even the repair cannot satisfy the row.
    """
    def report(lam: float, res: SolverResult) -> bool:
        value = row_value(row, res.labels)
        ok = _feasible(row, value)
        if progress is not None:
            progress(solves, lam, value, ok)
        return ok

    base = replace(mrf, linear_constraints=[])
    base, tight = tighten(base, row)
    first = solve(base)
    solves = 1
    value = row_value(row, first.labels)
    report(0.0, first)
    if _feasible(row, value):
        return _finish(mrf, first, first.lower_bound, 0.0, value, solves, tight, False)
    sign = 1.0 if value > row.high else -1.0
    target = row.high if sign > 0 else row.low
    best: SolverResult | None = None
    best_bound = first.lower_bound
    scale = max(1.0, abs(first.objective)) / max(1e-12, abs(value - target))
    lo, hi = 0.0, scale
    last = first
    for _ in range(max_doublings):
        res = solve(_penalised(base, row, sign * hi))
        solves += 1
        best_bound = max(best_bound, res.lower_bound - sign * hi * target)
        last = res
        if report(sign * hi, res):
            best = res
            break
        lo, hi = hi, hi * 2.0
    if best is not None:
        lam = hi
        for _ in range(bisect_steps):
            mid = 0.5 * (lo + hi)
            res = solve(_penalised(base, row, sign * mid))
            solves += 1
            best_bound = max(best_bound, res.lower_bound - sign * mid * target)
            if report(sign * mid, res):
                hi = mid
                if mrf.evaluate(res.labels) <= mrf.evaluate(best.labels):
                    best, lam = res, mid
            else:
                lo = mid
        return _finish(mrf, best, best_bound, sign * lam, row_value(row, best.labels), solves,
                       tight, False)
    labels = repair(base, row, last.labels)
    res = replace(last, labels=labels)
    return _finish(mrf, res, best_bound, sign * hi, row_value(row, labels), solves, tight, True)


def repair(mrf: MRF, row: LinearConstraint, labels: np.ndarray) -> np.ndarray:
    """Greedy repair of a row violation (module docstring); deterministic."""
    labels = labels.copy()
    value = row_value(row, labels)
    for _ in range(sum(len(c) for c in row.coef.values())):
        if _feasible(row, value):
            return labels
        sign = 1.0 if value > row.high else -1.0
        best = None
        base_e = mrf.evaluate(labels)
        for g, c in sorted(row.coef.items()):
            for k in np.flatnonzero(np.isfinite(mrf.unary[g])):
                gain = sign * (c[labels[g]] - c[k])
                if gain <= 0:
                    continue
                trial = labels.copy()
                trial[g] = k
                cost = mrf.evaluate(trial) - base_e
                if not math.isfinite(cost):
                    continue
                score = cost / gain
                if best is None or score < best[0]:
                    best = (score, g, int(k))
        if best is None:
            break
        labels[best[1]] = best[2]
        value = row_value(row, labels)
    if not _feasible(row, value):
        raise NoFeasibleLabelingError(
            f"constraint {row.name}: no labelling found with {row.low:.6g} <= value <= "
            f"{row.high:.6g} (best {value:.6g})")
    return labels


def _finish(mrf: MRF, res: SolverResult, bound: float, lam: float, value: float, solves: int,
            tight: bool, repaired: bool) -> SolverResult:
    objective = mrf.evaluate(res.labels)
    bound = min(bound, objective) if is_certified(objective, bound) else bound
    extra = dict(res.extra or {})
    extra.update({"multiplier": lam, "row_value": value, "inner_solves": solves,
                  "tight_row": tight, "repaired": repaired})
    status = "Optimal" if is_certified(objective, bound) else "Heuristic"
    return replace(res, objective=objective, lower_bound=bound, status=status, extra=extra)
