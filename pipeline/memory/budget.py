"""The parameter-memory budget: a linear constraint row of the MRF, built by the costs
stage (:func:`pipeline.stages.costs.stage.build_mrf`).

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
(pipeline/solvers/lagrangian.py). With eager costs the row is stored in
``factors.npz`` with the rest of the MRF and the facts of the run record
(:meth:`ParamBudget.to_record`) in ``costs.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.core.dtypes import itemsize
from pipeline.core.errors import PlanError
from pipeline.dtensor.placements import local_shape, parse_placements
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

    def to_record(self) -> dict[str, Any]:
        """The facts as plain JSON data (``costs.json`` of eager costs); the row itself
        is part of the MRF (``factors.npz``). Floats round-trip exactly."""
        return {"low": self.low, "high": self.high, "high_fraction": self.high_fraction,
                "params": list(self.params),
                "ratios": [self.ratios[p].tolist() for p in self.params],
                "bytes": [int(self.bytes_of[p]) for p in self.params],
                "excluded": list(self.excluded)}

    @classmethod
    def from_record(cls, record: dict[str, Any],
                    constraint: LinearConstraint | None) -> ParamBudget:
        """Inverse of :meth:`to_record`, with the row read back from the MRF."""
        params = [int(p) for p in record["params"]]
        return cls(constraint, float(record["low"]), float(record["high"]), params,
                   {p: np.asarray(r, dtype=np.float64) for p, r in zip(params, record["ratios"])},
                   {p: int(b) for p, b in zip(params, record["bytes"])},
                   list(record["excluded"]), float(record["high_fraction"]))


def param_ratios(topology: Any, node: int) -> np.ndarray:
    """``r_p(k)`` for every strategy k of parameter node ``node`` (float64 [K])."""
    mesh = tuple(int(s) for s in topology.summary["mesh"])
    meta = _out_meta(topology, node)
    shape = meta["shape"]
    full = math.prod(shape) if shape else 1
    out = []
    for text in topology.slist_outputs[topology.nodes["slist"][node]]:
        loc = local_shape(shape, parse_placements(text, len(mesh)), mesh) if shape else ()
        out.append((math.prod(loc) if loc else 1) / full)
    return np.asarray(out, dtype=np.float64)


def _out_meta(topology: Any, node: int) -> dict:
    return json.loads(topology.nodes["out_metas"][node])[0]


def param_budget(topology: Any, group_of: np.ndarray, domain: np.ndarray, cfg_budget: Any,
                 pinned: set[str]) -> ParamBudget | None:
    """Build the budget row; None when ``constraints.param_memory`` is null.

    ``group_of``: group of each node; ``domain``: label count per group; ``pinned``:
    names of the nodes ``constraints.nodes`` pins (left out). Whether the pins leave
    the budget feasible is :func:`check_budget_feasible`'s job.
    """
    if cfg_budget is None:
        return None
    low = float(cfg_budget["low"] or 0.0)
    high = float(cfg_budget["high"])
    nodes = topology.nodes
    params, ratios, bytes_of, excluded = [], {}, {}, []
    for v, role in enumerate(nodes["role"]):
        if role != "param":
            continue
        if nodes["name"][v] in pinned:
            excluded.append(nodes["fqn"][v] or nodes["name"][v])
            continue
        params.append(v)
        ratios[v] = param_ratios(topology, v)
        meta = _out_meta(topology, v)
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
