"""Side constraints for solvers that only minimise an MRF: Lagrangian relaxation.

Problem: minimise E(x) subject to linear rows ``L_i <= g_i(x) <= H_i``,
``i = 1..m``, with ``g_i(x) = sum_g c_ig(x_g)`` (pipeline.solvers.mrf.LinearConstraint).

* Tight rows. When ``H_i`` equals the smallest reachable value ``sum_g min c_ig``
  over allowed labels, every feasible x puts each group at a minimum of its
  coefficient, so the row is *exactly* a domain restriction: labels with a
  larger coefficient get unary +inf (no multiplier needed, bound unchanged).
  Every row is checked in turn (:func:`tighten`; :func:`allowed_unaries`: the labels
  the rows leave a plan).
* Weak duality. For signed multipliers ``mu_i`` (``mu_i > 0`` prices the upper
  side, ``T_i = H_i``; ``mu_i < 0`` the lower side, ``T_i = L_i``) every
  feasible x has ``mu_i (g_i(x) - T_i) <= 0``, hence (Boyd & Vandenberghe 2004,
  section 5.2)::

      OPT >= min_x [E(x) + sum_i mu_i g_i(x)] - sum_i mu_i T_i
          >= LB_mu - sum_i mu_i T_i

  where LB_mu is the inner solver's lower bound of the penalised MRF (for TRW-S
  its dual bound). Every inner solve gives such a bound; the best is kept, so
  the reported bound is valid for the constrained problem whatever the
  multipliers are.
* One row: the multiplier on the violated side is doubled until the penalised
  solution satisfies the row, then bisected a fixed number of times
  (deterministic); the best feasible labelling (by the unpenalised E) and the
  best bound are kept.
* Several rows: coordinate search over the multipliers, deterministic. A round
  visits the rows in order; for a row the current penalised solution violates,
  its multiplier (the others fixed) is doubled from its current magnitude until
  the row holds and then bisected as above, and the solution at the smallest
  multiplier found that satisfies the row becomes the current one. Rounds end
  when the current solution satisfies every row (at most ``max_rounds``).
  Multipliers only grow, so a row satisfied once is not priced less later; the
  polish below hands back the slack. With one row this is exactly the search
  above (one round).
* Repair and polish. The penalised solution at the largest multiplier that
  still violated a row is usually nearly feasible and cheaper than the first
  feasible one: groups are moved greedily to the label that reduces the
  (weighted) violation most per unit of added energy until every row holds
  (also used when no penalised solution is feasible: with several rows, up to
  ``MAX_REPAIRS`` penalised solutions, least violation first, since a greedy
  repair can be stuck where rows conflict); then the candidates are polished
  by a row-aware ICM (moves that lower E and keep every row) and the best is
  kept. Violations of different rows are weighted by
  ``s_1 / s_i`` with ``s_i = max(1, |L_i|, |H_i|)`` over the finite bounds (the
  unit of row ``i`` relative to the first; 1 for a single row).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from pipeline.solvers.errors import NoFeasibleLabelingError
from pipeline.solvers.mrf import MRF, LinearConstraint, row_holds, row_tolerance, row_value
from pipeline.solvers.options import LagrangianOptions, RowProgressFn
from pipeline.solvers.result import SolverResult, certified_status, is_certified

__all__ = [
    "RowProgressFn",
    "allowed_unaries",
    "RowSearch",
    "repair",
    "row_value",
    "solve",
    "solve_with_row",
    "solve_with_rows",
    "tighten",
]

InnerSolve = Callable[[MRF], SolverResult]

#: Several rows: penalised solutions tried as starts of the repair (module docstring).
MAX_REPAIRS = 16


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


def allowed_unaries(mrf: MRF) -> list[np.ndarray]:
    """The unaries with the labels an exactly tight row excludes set to +inf (the
    default parameter budget allows only each parameter's most sharded placements):
    finite entries are the labels a plan may use."""
    out = replace(mrf, linear_constraints=[])
    for row in mrf.linear_constraints:
        out, _ = tighten(out, row)
    return list(out.unary)


def _penalised(mrf: MRF, rows: Sequence[LinearConstraint], mult: Sequence[float]) -> MRF:
    """``E + sum_i mult_i g_i`` (rows with a zero multiplier add nothing)."""
    unary = list(mrf.unary)
    for row, lam in zip(rows, mult):
        if lam == 0.0:
            continue
        for g, c in row.coef.items():
            unary[g] = unary[g] + lam * c
    return replace(mrf, unary=unary, linear_constraints=[])


def _offset(rows: Sequence[LinearConstraint], mult: Sequence[float]) -> float:
    """``sum_i mult_i T_i``: ``T_i = H_i`` for ``mult_i > 0``, ``L_i`` for ``mult_i < 0``."""
    return sum(lam * (row.high if lam > 0 else row.low)
               for row, lam in zip(rows, mult) if lam != 0.0)


class _Search:
    """The inner solves of one multiplier search, with everything kept across them."""

    def __init__(self, mrf: MRF, base: MRF, rows: list[LinearConstraint], solve: InnerSolve,
                 progress: RowProgressFn | None) -> None:
        self.mrf, self.base, self.rows, self.inner = mrf, base, rows, solve
        self.progress = progress
        self.solves = 0
        self.best: SolverResult | None = None  # best labelling satisfying every row (by E)
        self.best_mult: list[float] = [0.0] * len(rows)
        self.bound = -np.inf
        self.bound_mult: list[float] = [0.0] * len(rows)
        self.bounds: _Bounds | None = None
        self.last: SolverResult | None = None
        self.labellings: list[np.ndarray] = []  # of every solve, in order

    def holds(self, res: SolverResult) -> bool:
        return all(row_holds(row, row_value(row, res.labels)) for row in self.rows)

    def solve(self, mult: list[float], shown: int) -> SolverResult:
        """One inner solve at multipliers ``mult``; ``shown``: the row being searched."""
        zero = not any(mult)
        res = self.inner(self.base if zero else _penalised(self.base, self.rows, mult))
        self.solves += 1
        offset = _offset(self.rows, mult)
        if zero:
            self.bound = res.lower_bound
            self.bounds = _Bounds(res.label_bounds)
        else:
            value = res.lower_bound - offset
            if value > self.bound:
                self.bound, self.bound_mult = value, list(mult)
            self.bounds.add(res.label_bounds, -offset)
        ok = self.holds(res)
        if ok and not zero and (self.best is None or self.mrf.evaluate(res.labels)
                                <= self.mrf.evaluate(self.best.labels)):
            self.best, self.best_mult = res, list(mult)
        if self.progress is not None:
            row = self.rows[shown]
            self.progress(self.solves, mult[shown], row_value(row, res.labels), ok)
        self.last = res
        self.labellings.append(res.labels)
        return res


def solve_with_rows(mrf: MRF, rows: Sequence[LinearConstraint], solve: InnerSolve, *,
                    bisect_steps: int = 8, max_doublings: int = 40, max_rounds: int = 4,
                    progress: RowProgressFn | None = None) -> SolverResult:
    """Minimise E subject to every row of ``rows`` with ``solve`` (e.g. TRW-S) as the
    inner solver (module docstring).

    ``progress``, if given, is called after every inner solve as
    ``progress(inner_solves, multiplier, row_value, feasible)``: the multiplier
    (signed, 0 for the unpenalised first solve) and value of the row being searched
    (the first row for the first solve), and whether the solve satisfies every row;
    it only observes.
    ``result.extra`` gains ``multiplier`` and ``row_value`` (of the first row),
    ``multipliers`` and ``row_values`` (every row, in order; the multipliers of the
    returned labelling's solve), ``bound_multipliers`` (those of the solve giving
    ``lower_bound``), ``inner_solves``, ``tight_row`` (some row was tight) and
    ``repaired``. If every inner solve returned ``label_bounds``,
    ``result.label_bounds`` holds their entrywise maximum, each shifted by
    ``-sum_i mu_i T_i`` (valid for every labelling satisfying the rows).
    Raises NoFeasibleLabelingError when even the repair cannot satisfy the rows.
    """
    rows = list(rows)
    base = replace(mrf, linear_constraints=[])
    if not rows:
        res = solve(base)
        return _finish(mrf, res, res.lower_bound, [], [], [], 1, False, False, res.label_bounds)
    tight = False
    for row in rows:
        base, row_tight = tighten(base, row)
        tight = tight or row_tight
    search = _Search(mrf, base, rows, solve, progress)
    mult = [0.0] * len(rows)
    first = search.solve(mult, 0)
    if search.holds(first):
        return _finish(mrf, first, search.bound, mult, mult, rows, search.solves, tight, False,
                       search.bounds.value)
    cur, near = first, first
    gave_up = False
    for _ in range(max_rounds if len(rows) > 1 else 1):
        for i, row in enumerate(rows):
            value = row_value(row, cur.labels)
            if row_holds(row, value):
                continue
            sign = 1.0 if value > row.high else -1.0
            target = row.high if sign > 0 else row.low
            lo = abs(mult[i]) if mult[i] * sign > 0 else 0.0
            scale = max(1.0, abs(cur.objective)) / max(1e-12, abs(value - target))
            hi = lo + scale
            near, found = cur, None
            for _ in range(max_doublings):
                mult[i] = sign * hi
                res = search.solve(mult, i)
                if row_holds(row, row_value(row, res.labels)):
                    found = res
                    break
                lo, hi = hi, hi * 2.0
            if found is None:
                mult[i] = sign * hi
                gave_up = True
                break
            for _ in range(bisect_steps):
                mid = 0.5 * (lo + hi)
                mult[i] = sign * mid
                res = search.solve(mult, i)
                if row_holds(row, row_value(row, res.labels)):
                    hi, found = mid, res
                else:
                    lo, near = mid, res
            mult[i] = sign * hi
            cur = found
        if gave_up or search.holds(cur):
            break
    rs = RowSearch(base, rows)
    if search.best is not None:
        # The penalised solution just below the multiplier that first satisfies a row
        # is often nearly feasible and cheaper: repair it, polish both, keep the best.
        labels = rs.polish(search.best.labels)
        repaired = False
        try:
            other = rs.polish(rs.repair(near.labels))
        except NoFeasibleLabelingError:
            other = None
        if other is not None and mrf.evaluate(other) < mrf.evaluate(labels):
            labels, repaired = other, True
        res = replace(search.best, labels=labels)
        return _finish(mrf, res, search.bound, search.best_mult, search.bound_mult, rows,
                       search.solves, tight, repaired, search.bounds.value)
    if len(rows) == 1:
        start = search.last if gave_up else cur
        labels = rs.polish(rs.repair(start.labels))
    else:
        labels = _repair_any(mrf, rs, search.labellings)
    res = replace(search.last, labels=labels)
    return _finish(mrf, res, search.bound, mult, search.bound_mult, rows, search.solves, tight,
                   True, search.bounds.value)


def _repair_any(mrf: MRF, rs: RowSearch, labellings: list[np.ndarray]) -> np.ndarray:
    """Several rows, no penalised solution satisfies them all: repair and polish up to
    :data:`MAX_REPAIRS` distinct penalised solutions, least (weighted) violation first
    (then lower E, then solve order), and keep the lowest E. A greedy repair can be
    stuck where rows conflict (every single move that mends one breaks another), so
    one start is not enough.

    Raises:
        NoFeasibleLabelingError: no start could be repaired (the first start's error).
    """
    unique: dict[bytes, np.ndarray] = {}
    for lab in labellings:
        unique.setdefault(np.asarray(lab, dtype=np.int64).tobytes(), lab)
    starts = sorted(enumerate(unique.values()),
                    key=lambda t: (rs.violation(t[1]), mrf.evaluate(t[1]), t[0]))
    best, best_e, error = None, np.inf, None
    for _, lab in starts[:MAX_REPAIRS]:
        try:
            out = rs.polish(rs.repair(lab))
        except NoFeasibleLabelingError as err:
            error = error or err
            continue
        e = mrf.evaluate(out)
        if best is None or e < best_e:
            best, best_e = out, e
    if best is None:
        raise error
    return best


def solve_with_row(mrf: MRF, row: LinearConstraint, solve: InnerSolve, *,
                   bisect_steps: int = 8, max_doublings: int = 40,
                   progress: RowProgressFn | None = None) -> SolverResult:
    """:func:`solve_with_rows` with the single row ``row``."""
    return solve_with_rows(mrf, [row], solve, bisect_steps=bisect_steps,
                           max_doublings=max_doublings, progress=progress)


def solve(mrf: MRF, options: LagrangianOptions) -> SolverResult:
    """The solver protocol (:mod:`pipeline.solvers.registry`): ``options.inner``
    subject to every row of ``mrf.linear_constraints``."""
    if options.inner is None:
        raise ValueError("lagrangian: options.inner is None; pass the inner solve, "
                         "e.g. registry.bind('approx', TrwsOptions())")
    return solve_with_rows(mrf, mrf.linear_constraints, options.inner,
                           bisect_steps=options.bisect_steps,
                           max_doublings=options.max_doublings, max_rounds=options.max_rounds,
                           progress=options.progress)


class _Bounds:
    """Entrywise maximum of per-label bounds valid for every feasible labelling.

    A penalised solve's bounds hold for ``E + sum_i mu_i g_i``; for feasible x they
    become bounds on E after adding ``-sum_i mu_i T_i`` (module docstring), so each
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


def repair(mrf: MRF, rows: LinearConstraint | Sequence[LinearConstraint],
           labels: np.ndarray) -> np.ndarray:
    """Greedy repair of row violations (module docstring); deterministic.

    Raises NoFeasibleLabelingError when no sequence of greedy moves satisfies the rows.
    """
    return RowSearch(mrf, rows).repair(labels)


class RowSearch:
    """Moves of single groups that are exact in E given the other groups' labels.

    ``cost_g(k) = theta_g(k) + sum_t theta_gt(k, x_t)`` is read from a
    :class:`~pipeline.solvers.compiled.CompiledMRF` (group order unchanged), so a
    move costs one gather per incident edge instead of an evaluation of E.
    """

    def __init__(self, mrf: MRF, rows: LinearConstraint | Sequence[LinearConstraint]) -> None:
        from pipeline.solvers.compiled import CompiledMRF

        self.rows = [rows] if isinstance(rows, LinearConstraint) else list(rows)
        self.mrf = replace(mrf, linear_constraints=[])
        self.cm = CompiledMRF(self.mrf)
        self.buf = self.cm.new_buffer()
        self.coef = [{int(g): np.asarray(c, dtype=np.float64) for g, c in sorted(r.coef.items())}
                     for r in self.rows]
        self.tol = [row_tolerance(r) for r in self.rows]
        units = [t / self.tol[0] for t in self.tol]  # s_i / s_1 (the tolerances are ROW_RTOL s_i)
        self.weight = [1.0 / u for u in units]
        self.groups = sorted({g for c in self.coef for g in c})

    def _cost(self, labels: np.ndarray, g: int) -> np.ndarray:
        cost = self.cm.unary[g].copy()
        if self.cm.inc[g]:
            cost += self.cm.local_costs(self.buf, labels, g).sum(axis=1)
        return cost

    def violation(self, labels: np.ndarray) -> float:
        """Weighted sum over the rows of ``max(0, g - H) + max(0, L - g)``."""
        total = 0.0
        for row, w in zip(self.rows, self.weight):
            value = row_value(row, labels)
            total += w * (max(0.0, value - row.high) + max(0.0, row.low - value))
        return total

    def _violated(self, values: list[float]) -> list[int]:
        return [i for i, r in enumerate(self.rows) if not row_holds(r, values[i])]

    def repair(self, labels: np.ndarray) -> np.ndarray:
        """Move groups, one at a time, to the label with the least added energy per
        unit of (weighted) violation removed until every row holds; returns new labels.

        The gain of a move is, summed over the rows: ``s * (c[k0] - c[k])`` for a
        violated row (``s = +1`` above ``H``, ``-1`` below ``L``) and minus the
        violation it would create for a satisfied row, each times the row's weight.

        Raises:
            NoFeasibleLabelingError: no move reduces the violation any more.
        """
        labels = np.asarray(labels, dtype=np.int64).copy()
        values = [row_value(r, labels) for r in self.rows]
        for _ in range(sum(c.size for coef in self.coef for c in coef.values()) + 1):
            violated = self._violated(values)
            if not violated:
                return labels
            best = None
            for g in self.groups:
                cost = self._cost(labels, g)
                k0 = int(labels[g])
                gain = None
                for i, coef in enumerate(self.coef):
                    c = coef.get(g)
                    if c is None:
                        continue
                    row = self.rows[i]
                    if i in violated:
                        sign = 1.0 if values[i] > row.high else -1.0
                        term = sign * (c[k0] - c)
                    else:
                        new = values[i] - c[k0] + c
                        term = -(np.maximum(new - (row.high + self.tol[i]), 0.0)
                                 + np.maximum((row.low - self.tol[i]) - new, 0.0))
                    term = term * self.weight[i]
                    gain = term if gain is None else gain + term
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
            for i, coef in enumerate(self.coef):
                c = coef.get(g)
                if c is not None:
                    values[i] += c[k] - c[int(labels[g])]
            labels[g] = k
        violated = self._violated(values)
        if violated:
            row, value = self.rows[violated[0]], values[violated[0]]
            raise NoFeasibleLabelingError(
                f"constraint {row.name}: no labelling found with {row.low:.6g} <= value <= "
                f"{row.high:.6g} (best {value:.6g})")
        return labels

    def polish(self, labels: np.ndarray, max_rounds: int = 50) -> np.ndarray:
        """Row-aware ICM: lower E while every row stays satisfied.

        Visits the groups in index order and moves each to its cheapest label among
        those keeping ``L_i <= g_i(x) <= H_i`` for every row (strict improvement
        only, so E never increases and the loop ends). The penalised solves spend
        the rows' slack badly (multipliers large enough to satisfy a row over-shard);
        this hands the slack back where it buys most. ``labels`` must satisfy the rows.
        """
        labels = np.asarray(labels, dtype=np.int64).copy()
        values = [row_value(r, labels) for r in self.rows]
        for _ in range(max_rounds):
            changed = False
            for g in range(self.cm.num_groups):
                cost = self._cost(labels, g)
                k0 = int(labels[g])
                for i, coef in enumerate(self.coef):
                    c = coef.get(g)
                    if c is not None:
                        row, tol = self.rows[i], self.tol[i]
                        new_value = values[i] - c[k0] + c
                        cost[(new_value < row.low - tol) | (new_value > row.high + tol)] = np.inf
                k = int(np.argmin(cost))
                if cost[k] < cost[k0] - 1e-12 * max(1.0, abs(cost[k])):
                    for i, coef in enumerate(self.coef):
                        c = coef.get(g)
                        if c is not None:
                            values[i] += c[k] - c[k0]
                    labels[g] = k
                    changed = True
            if not changed:
                break
        return labels


def _finish(mrf: MRF, res: SolverResult, bound: float, mult: list[float],
            bound_mult: list[float], rows: list[LinearConstraint], solves: int, tight: bool,
            repaired: bool, label_bounds: list[np.ndarray] | None = None) -> SolverResult:
    objective = mrf.evaluate(res.labels)
    bound = min(bound, objective) if is_certified(objective, bound) else bound
    values = [row_value(row, res.labels) for row in rows]
    extra = dict(res.extra or {})
    extra.update({"multiplier": mult[0] if mult else 0.0,
                  "row_value": values[0] if values else 0.0,
                  "multipliers": list(mult), "row_values": values,
                  "bound_multipliers": list(bound_mult), "inner_solves": solves,
                  "tight_row": tight, "repaired": repaired})
    return replace(res, objective=objective, lower_bound=bound,
                   status=certified_status(objective, bound), extra=extra,
                   label_bounds=label_bounds)
