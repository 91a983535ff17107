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
* Repair and polish. The penalised solution at the largest multiplier that
  still violated the row is usually nearly feasible and cheaper than the first
  feasible one: groups are moved greedily to the label that reduces the
  violation most per unit of added energy until the row holds (also used when
  no penalised solution is feasible); then both candidates are polished by a
  row-aware ICM (moves that lower E and keep the row) and the better is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

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
    ``inner_solves``, ``tight_row`` and ``repaired``. If every inner solve returned
    ``label_bounds``, ``result.label_bounds`` holds their entrywise maximum, each
    shifted by ``-s*lambda*T`` (valid for every labelling satisfying the row).
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
    bounds = _Bounds(first.label_bounds)
    value = row_value(row, first.labels)
    report(0.0, first)
    if _feasible(row, value):
        return _finish(mrf, first, first.lower_bound, 0.0, value, solves, tight, False,
                       bounds.value)
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
        bounds.add(res.label_bounds, -sign * hi * target)
        last = res
        if report(sign * hi, res):
            best = res
            break
        lo, hi = hi, hi * 2.0
    if best is not None:
        lam = hi
        infeasible = last if last is not best else first
        for _ in range(bisect_steps):
            mid = 0.5 * (lo + hi)
            res = solve(_penalised(base, row, sign * mid))
            solves += 1
            best_bound = max(best_bound, res.lower_bound - sign * mid * target)
            bounds.add(res.label_bounds, -sign * mid * target)
            if report(sign * mid, res):
                hi = mid
                if mrf.evaluate(res.labels) <= mrf.evaluate(best.labels):
                    best, lam = res, mid
            else:
                lo = mid
                infeasible = res
        # The penalised solution just below the multiplier that first satisfies the row
        # is often nearly feasible and cheaper: repair it, polish both, keep the best.
        search = RowSearch(base, row)
        labels = search.polish(best.labels)
        repaired = False
        try:
            other = search.polish(search.repair(infeasible.labels))
        except NoFeasibleLabelingError:
            other = None
        if other is not None and mrf.evaluate(other) < mrf.evaluate(labels):
            labels, repaired = other, True
        res = replace(best, labels=labels)
        return _finish(mrf, res, best_bound, sign * lam, row_value(row, labels), solves,
                       tight, repaired, bounds.value)
    search = RowSearch(base, row)
    labels = search.polish(search.repair(last.labels))
    res = replace(last, labels=labels)
    return _finish(mrf, res, best_bound, sign * hi, row_value(row, labels), solves, tight, True,
                   bounds.value)


class _Bounds:
    """Entrywise maximum of per-label bounds valid for every feasible labelling.

    A penalised solve's bounds hold for ``E + s*lambda*g``; for feasible x they
    become bounds on E after adding ``-s*lambda*T`` (module docstring), so each
    is shifted by that offset. ``value`` is None when a solve gave no bounds.
    """

    def __init__(self, first: list[np.ndarray] | None) -> None:
        self.value = None if first is None else [np.array(b, dtype=np.float64) for b in first]

    def add(self, bounds: list[np.ndarray] | None, offset: float) -> None:
        if self.value is None or bounds is None:
            self.value = None
            return
        for acc, b in zip(self.value, bounds):
            np.maximum(acc, np.asarray(b, dtype=np.float64) + offset, out=acc)


def repair(mrf: MRF, row: LinearConstraint, labels: np.ndarray) -> np.ndarray:
    """Greedy repair of a row violation (module docstring); deterministic.

    Raises NoFeasibleLabelingError when no sequence of greedy moves satisfies the row.
    """
    return RowSearch(mrf, row).repair(labels)


class RowSearch:
    """Moves of single groups that are exact in E given the other groups' labels.

    ``cost_g(k) = theta_g(k) + sum_t theta_gt(k, x_t)`` is read from a
    :class:`~pipeline.solvers.compiled.CompiledMRF` (group order unchanged), so a
    move costs one gather per incident edge instead of an evaluation of E.
    """

    def __init__(self, mrf: MRF, row: LinearConstraint) -> None:
        from pipeline.solvers.compiled import CompiledMRF

        self.mrf = replace(mrf, linear_constraints=[])
        self.row = row
        self.cm = CompiledMRF(self.mrf)
        self.buf = self.cm.new_buffer()
        self.coef = {int(g): np.asarray(c, dtype=np.float64) for g, c in sorted(row.coef.items())}
        scale = max([1.0] + [abs(v) for v in (row.low, row.high) if math.isfinite(v)])
        self.tol = 1e-9 * scale

    def _cost(self, labels: np.ndarray, g: int) -> np.ndarray:
        cost = self.cm.unary[g].copy()
        if self.cm.inc[g]:
            cost += self.cm.local_costs(self.buf, labels, g).sum(axis=1)
        return cost

    def repair(self, labels: np.ndarray) -> np.ndarray:
        """Move groups, one at a time, to the label with the least added energy per
        unit of violation removed until the row holds; returns new labels.

        Raises:
            NoFeasibleLabelingError: no move reduces the violation any more.
        """
        row = self.row
        labels = np.asarray(labels, dtype=np.int64).copy()
        value = row_value(row, labels)
        for _ in range(sum(c.size for c in self.coef.values()) + 1):
            if _feasible(row, value):
                return labels
            sign = 1.0 if value > row.high else -1.0
            best = None
            for g, c in self.coef.items():
                cost = self._cost(labels, g)
                k0 = int(labels[g])
                gain = sign * (c[k0] - c)
                ok = (gain > 0) & np.isfinite(cost)
                if not ok.any():
                    continue
                score = np.where(ok, (cost - cost[k0]) / np.where(ok, gain, 1.0), np.inf)
                k = int(np.argmin(score))
                if best is None or score[k] < best[0]:
                    best = (float(score[k]), g, k)
            if best is None:
                break
            _, g, k = best
            value += self.coef[g][k] - self.coef[g][int(labels[g])]
            labels[g] = k
        if not _feasible(row, value):
            raise NoFeasibleLabelingError(
                f"constraint {row.name}: no labelling found with {row.low:.6g} <= value <= "
                f"{row.high:.6g} (best {value:.6g})")
        return labels

    def polish(self, labels: np.ndarray, max_rounds: int = 50) -> np.ndarray:
        """Row-aware ICM: lower E while the row stays satisfied.

        Visits the groups in index order and moves each to its cheapest label among
        those keeping ``low <= g(x) <= high`` (strict improvement only, so E never
        increases and the loop ends). The penalised solves spend the row's slack
        badly (a multiplier large enough to satisfy the row over-shards); this hands
        the slack back where it buys most. ``labels`` must satisfy the row.
        """
        row = self.row
        labels = np.asarray(labels, dtype=np.int64).copy()
        value = row_value(row, labels)
        for _ in range(max_rounds):
            changed = False
            for g in range(self.cm.num_groups):
                cost = self._cost(labels, g)
                k0 = int(labels[g])
                c = self.coef.get(g)
                if c is not None:
                    new_value = value - c[k0] + c
                    cost[(new_value < row.low - self.tol) | (new_value > row.high + self.tol)] = (
                        np.inf)
                k = int(np.argmin(cost))
                if cost[k] < cost[k0] - 1e-12 * max(1.0, abs(cost[k])):
                    if c is not None:
                        value += c[k] - c[k0]
                    labels[g] = k
                    changed = True
            if not changed:
                break
        return labels


def _finish(mrf: MRF, res: SolverResult, bound: float, lam: float, value: float, solves: int,
            tight: bool, repaired: bool, label_bounds: list[np.ndarray] | None = None
            ) -> SolverResult:
    objective = mrf.evaluate(res.labels)
    bound = min(bound, objective) if is_certified(objective, bound) else bound
    extra = dict(res.extra or {})
    extra.update({"multiplier": lam, "row_value": value, "inner_solves": solves,
                  "tight_row": tight, "repaired": repaired})
    status = "Optimal" if is_certified(objective, bound) else "Heuristic"
    return replace(res, objective=objective, lower_bound=bound, status=status, extra=extra,
                   label_bounds=label_bounds)
