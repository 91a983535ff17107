"""Constraints on the plan that live beside the MRF: the parameter-memory budget.

Parameter-memory budget (``constraints.param_memory: {low, high}``), as in the
public reference's optimizer: for parameter p under strategy k let

    r_p(k) = local elements / full elements      (1 replicated, 1/64 on 64 devices)

and ``min_r_p`` the smallest ratio p's tensor can reach on the mesh, before
any pin (the most p can be sharded). The plan must satisfy

    sum_p max(min_r_p, low)  <=  sum_p r_p(x_p)  <=  sum_p max(min_r_p, high)

so a parameter that cannot be sharded further never makes the budget
infeasible. The budget is *parameter-count weighted*: every parameter counts
as one unit whatever its size (not byte weighted). Parameters pinned by
``constraints.nodes`` are excluded. With ``high = 1 / mesh size`` (the default)
every parameter is as sharded as it can be.

On the group MRF the sum is a :class:`~pipeline.solvers.mrf.LinearConstraint`
whose coefficient vector for group g is the sum of its member parameters'
``r_p`` over the group's labels (repeated-layer copies counted). The ILP adds it
as rows; the approx solver handles it by Lagrangian relaxation
(pipeline/solvers/lagrangian.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.errors import PlanError
from pipeline.placements import local_shape, parse_placements
from pipeline.solvers.mrf import LinearConstraint


@dataclass
class ParamBudget:
    """The budget row and the facts reported in the run record.

    Attributes:
        constraint: the row over groups (None when no parameter is counted).
        low, high: bounds of the ratio sum (dimensionless).
        params: counted parameter node ids; ratio[p] per strategy of node p.
        bytes_of: full size in bytes of each counted parameter.
        excluded: names of pinned parameters left out.
    """

    constraint: LinearConstraint | None
    low: float
    high: float
    params: list[int]
    ratios: dict[int, np.ndarray]
    bytes_of: dict[int, int]
    excluded: list[str]
    high_fraction: float = 0.0


def param_ratios(tt: Any, node: int) -> np.ndarray:
    """``r_p(k)`` for every strategy k of parameter node ``node`` (float64 [K])."""
    mesh = tuple(int(s) for s in tt.summary["mesh"])
    meta = _out_meta(tt, node)
    shape = meta["shape"]
    full = math.prod(shape) if shape else 1
    out = []
    for text in tt.slist_outputs[tt.nodes["slist"][node]]:
        loc = local_shape(shape, parse_placements(text, len(mesh)), mesh) if shape else ()
        out.append((math.prod(loc) if loc else 1) / full)
    return np.asarray(out, dtype=np.float64)


def _out_meta(tt: Any, node: int) -> dict:
    import json

    return json.loads(tt.nodes["out_metas"][node])[0]


def param_budget(tt: Any, group_of: np.ndarray, domain: np.ndarray, cfg_budget: Any,
                 pinned: set[str]) -> ParamBudget | None:
    """Build the budget row; None when ``constraints.param_memory`` is null.

    Raises PlanError when even the most sharded plan the pins allow exceeds
    ``high`` (only possible when pins fix a counted parameter indirectly).
    """
    if cfg_budget is None:
        return None
    low = float(cfg_budget["low"] or 0.0)
    high = float(cfg_budget["high"])
    nodes = tt.nodes
    params, ratios, bytes_of, excluded = [], {}, {}, []
    for v, role in enumerate(nodes["role"]):
        if role != "param":
            continue
        if nodes["name"][v] in pinned:
            excluded.append(nodes["fqn"][v] or nodes["name"][v])
            continue
        params.append(v)
        ratios[v] = param_ratios(tt, v)
        meta = _out_meta(tt, v)
        from pipeline.costs import itemsize

        bytes_of[v] = (math.prod(meta["shape"]) if meta["shape"] else 1) * itemsize(meta["dtype"])
    if not params:
        return ParamBudget(None, low, high, [], {}, {}, excluded, high)
    # min_r_p is what the tensor can reach on the mesh, before any pin: a pin that keeps
    # a counted parameter replicated then shows up as an infeasible budget.
    min_r = {p: float(nodes["min_param_ratio"][p]) for p in params}
    lo = sum(max(min_r[p], low) for p in params)
    hi = sum(max(min_r[p], high) for p in params)
    coef: dict[int, np.ndarray] = {}
    for p in params:
        g = int(group_of[p])
        coef[g] = coef.get(g, np.zeros(int(domain[g]))) + ratios[p]
    row = LinearConstraint(name="param_memory", coef=coef, low=lo, high=hi)
    return ParamBudget(row, lo, hi, params, ratios, bytes_of, excluded, high)


def check_budget_feasible(budget: ParamBudget, unary: list[np.ndarray], pins: dict) -> None:
    """Fail fast when no allowed label of each group can meet the budget.

    A label is allowed when its unary is finite (pins forbid the others). The
    smallest reachable ratio sum is the sum of per-group minima over allowed
    labels; above ``high`` the problem is infeasible.
    Raises PlanError naming the budget and the pins involved.
    """
    row = budget.constraint
    if row is None:
        return
    reach_min = 0.0
    reach_max = 0.0
    for g, c in row.coef.items():
        ok = np.isfinite(unary[g])
        reach_min += float(c[ok].min())
        reach_max += float(c[ok].max())
    pinned = ", ".join(sorted(pins)) or "none"
    if reach_min > row.high * (1 + 1e-12):
        raise PlanError(
            f"constraints.param_memory.high={budget_high_text(budget)}: infeasible, the "
            f"placements allowed (pins: {pinned}) reach at best a ratio sum of "
            f"{reach_min:.6g} > {row.high:.6g}; remove the pin or loosen the budget")
    if reach_max < row.low * (1 - 1e-12):
        raise PlanError(
            f"constraints.param_memory.low: infeasible, the allowed placements reach at most "
            f"{reach_max:.6g} < {row.low:.6g}")


def budget_high_text(budget: ParamBudget) -> str:
    """The configured fraction with the ratio-sum bound it gives (for messages)."""
    return f"{budget.high_fraction:.6g} (ratio-sum bound {budget.high:.6g})"


def used_memory(budget: ParamBudget, strategy: np.ndarray) -> dict[str, float]:
    """Ratio sum and bytes per device of the counted parameters under a plan."""
    ratio = sum(float(budget.ratios[p][strategy[p]]) for p in budget.params)
    nbytes = sum(float(budget.ratios[p][strategy[p]]) * budget.bytes_of[p]
                 for p in budget.params)
    return {"ratio_sum": ratio, "bytes_per_device": nbytes,
            "full_bytes": float(sum(budget.bytes_of.values()))}
