"""Exact minimisation of a small MRF by enumeration (the test oracle).

Builds the full energy tensor of shape ``(K_0, ..., K_{G-1})`` by
broadcasting (constant + unaries + dense pairwise matrices), sets every
labelling that violates a linear row ``low <= g(x) <= high``
(:data:`pipeline.solvers.mrf.ROW_RTOL` tolerance, as everywhere) to ``+inf``,
and takes the argmin. Ties go to the lexicographically smallest labelling
(C order).
"""

from __future__ import annotations

import math
import time

import numpy as np

from pipeline.solvers.errors import InfeasibleError
from pipeline.solvers.mrf import MRF, row_holds
from pipeline.solvers.options import BruteForceOptions
from pipeline.solvers.result import SolverResult
from pipeline.solvers.status import OPTIMAL

#: Default cap on the number of joint labellings (float64 tensor of 16 MB).
MAX_JOINT_LABELS = BruteForceOptions().max_joint_labels


def _broadcast(vector: np.ndarray, axis: int, n: int) -> np.ndarray:
    shape = [1] * n
    shape[axis] = vector.shape[0]
    return np.asarray(vector, dtype=np.float64).reshape(shape)


def energy_tensor(mrf: MRF) -> np.ndarray:
    """``E(x)`` of every labelling, float64 of shape ``domain_sizes`` (rows ignored)."""
    sizes = [int(k) for k in mrf.domain_sizes]
    n = len(sizes)
    energy = np.full(sizes, float(mrf.constant), dtype=np.float64)
    for g in range(n):
        energy = energy + _broadcast(mrf.unary[g], g, n)
    for e in range(mrf.num_edges):
        u, v = (int(x) for x in mrf.edges[e])
        shape = [1] * n
        shape[u] = sizes[u]
        shape[v] = sizes[v]
        energy = energy + mrf.factor(e).dense().reshape(shape)
    return energy


def feasible_mask(mrf: MRF) -> np.ndarray:
    """bool of shape ``domain_sizes``: the labellings that satisfy every linear row."""
    sizes = [int(k) for k in mrf.domain_sizes]
    n = len(sizes)
    ok = np.ones(sizes, dtype=bool)
    for row in mrf.linear_constraints:
        value = np.zeros(sizes)
        for g, c in sorted(row.coef.items()):  # the summation order of row_value
            value = value + _broadcast(c, int(g), n)
        ok &= row_holds(row, value)
    return ok


def brute_force(mrf: MRF, options: BruteForceOptions | None = None) -> SolverResult:
    """A minimum-energy labelling among those satisfying every linear row.

    Returns:
        :class:`SolverResult` with ``labels`` int64 ``[G]``, ``objective =
        mrf.evaluate(labels)`` (µs), ``lower_bound == objective``,
        ``lower_bound_source="brute_force"``, status ``"Optimal"``; ``extra``
        holds ``joint_labellings`` (all) and ``feasible_labellings`` (finite
        energy, rows satisfied).

    Raises:
        ValueError: ``prod(K_g) > options.max_joint_labels``.
        InfeasibleError: every labelling has energy ``+inf`` or violates a row.
    """
    o = options if options is not None else BruteForceOptions()
    t0 = time.perf_counter()
    sizes = [int(k) for k in mrf.domain_sizes]
    total = math.prod(sizes)
    if total > o.max_joint_labels:
        raise ValueError(
            f"brute_force: {total} joint labellings exceed max_joint_labels={o.max_joint_labels}"
        )
    energy = energy_tensor(mrf)
    if mrf.linear_constraints:
        energy = np.where(feasible_mask(mrf), energy, np.inf)
    flat = int(np.argmin(energy)) if energy.size else 0
    if energy.size and not np.isfinite(energy.flat[flat]):
        raise InfeasibleError(
            "brute_force: every labelling has energy +inf or violates a linear constraint")
    labels = np.array(np.unravel_index(flat, sizes), dtype=np.int64).reshape(len(sizes))
    objective = mrf.evaluate(labels)
    return SolverResult(
        labels=labels,
        objective=objective,
        lower_bound=objective,
        lower_bound_source="brute_force",
        status=OPTIMAL,
        iterations=1,
        bound_history=[objective],
        solve_seconds=time.perf_counter() - t0,
        extra={"joint_labellings": total,
               "feasible_labellings": int(np.isfinite(energy).sum())},
    )


#: The solver protocol (:mod:`pipeline.solvers.registry`).
solve = brute_force
