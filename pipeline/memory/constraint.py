"""``constraints.device_memory``: the memory row of the MRF and the check of a solved plan.

The row (built by the costs stage beside the parameter budget) bounds the linear model
of :mod:`pipeline.memory.terms`:

    sum_g c_g(x_g) <= H,        c_g = sum of the memory terms of group g's nodes

``approx`` honours it by Lagrangian relaxation (pipeline/solvers/lagrangian.py, with a
lower bound valid for the row), ``ilp`` / ``lp`` as a row of the program. The liveness
peak (:mod:`pipeline.memory.liveness`) adds transients the row cannot see (redistributed
inputs, re-gathered weights, recomputed values, the loss gradient), so the solve stage
checks the plan after solving: while its peak exceeds the limit ``M`` it asks for a plan
whose linear memory is below the last plan's by that excess, deterministically:

    H_0 = M,    H_{r+1} = min(H_r, g(x_r)) - (peak(x_r) - M)
                while peak(x_r) > M and r < max_rounds

(``g(x_r)``: the last plan's row value; the cut excludes it and every plan using at
least as much linear memory).

The bound of the last solve is for the problem with the row at ``H_r`` (the record
says which). A limit below the smallest linear memory any allowed plan reaches,
``sum_g min_{k allowed} c_g(k)`` (exact: the row is separable), is infeasible before
any solve.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.errors import PlanError
from pipeline.memory.options import format_bytes
from pipeline.solvers.mrf import LinearConstraint

__all__ = ["MAX_ROUNDS", "ROW_NAME", "FitResult", "fit_plan", "memory_row", "smallest_memory"]

ROW_NAME = "device_memory"
#: Solves at most (the first one included) while the peak exceeds the limit.
MAX_ROUNDS = 4


def memory_row(coef: dict[int, np.ndarray], high: float) -> LinearConstraint:
    """The device-memory row ``sum_g coef_g(x_g) <= high`` (bytes)."""
    return LinearConstraint(name=ROW_NAME, coef=coef, low=-math.inf, high=float(high))


def smallest_memory(coef: dict[int, np.ndarray], unary: list[np.ndarray]) -> float:
    """The smallest linear memory over the labels each group allows (finite unary)."""
    total = 0.0
    for g, c in sorted(coef.items()):
        ok = np.isfinite(unary[g])
        total += float(c[ok].min()) if ok.any() else float(c.min())
    return total


def check_feasible(coef: dict[int, np.ndarray], unary: list[np.ndarray], limit: float,
                   limit_text: str) -> float:
    """Raise PlanError (one line) when no allowed plan's linear memory fits ``limit``;
    returns the smallest linear memory."""
    least = smallest_memory(coef, unary)
    if least > limit:
        raise PlanError(
            f"constraints.device_memory={limit_text}: infeasible, the smallest memory any "
            f"plan reaches is {format_bytes(least)} ({int(least)} B: parameters, gradients, "
            f"optimizer state, buffers and saved activations per device) > "
            f"{format_bytes(limit)}; raise the limit, shard over more devices or use "
            "memory.activation_checkpointing=full")
    return least


@dataclass
class FitResult:
    """The plan found under the limit and how it was found: the solver's ``result``, the
    memory ``row`` of the last solve, every solve's ``rounds``, the plan's liveness
    ``peak`` and (set by the caller) all ``rows`` of the last solve."""

    result: Any
    row: LinearConstraint
    rounds: list[dict[str, float]] = field(default_factory=list)
    peak: Any = None
    rows: list[LinearConstraint] = field(default_factory=list)


def fit_plan(solve: Callable[[list[LinearConstraint]], Any],
             peak_of: Callable[[np.ndarray], Any], coef: dict[int, np.ndarray],
             limit: float, unary: list[np.ndarray], limit_text: str,
             max_rounds: int = MAX_ROUNDS) -> FitResult:
    """Solve with the memory row, check the liveness peak, lower the row until it fits.

    ``solve(rows)`` solves the MRF with the given memory row list and returns a result
    with ``labels``; ``peak_of(labels)`` returns a :class:`~pipeline.memory.Liveness`.
    Raises PlanError when the lowered row becomes infeasible or no plan fits after
    ``max_rounds`` solves.
    """
    least = check_feasible(coef, unary, limit, limit_text)
    high = float(limit)
    rounds: list[dict[str, float]] = []
    for _ in range(max_rounds):
        row = memory_row(coef, high)
        result = solve([row])
        labels = np.asarray(result.labels, dtype=np.int64)
        linear = float(sum(float(c[labels[g]]) for g, c in sorted(coef.items())))
        live = peak_of(labels)
        rounds.append({"row_high_bytes": high, "linear_bytes": linear,
                       "peak_bytes": float(live.peak_bytes),
                       "objective": float(result.objective)})
        if live.peak_bytes <= limit:
            return FitResult(result, row, rounds, live)
        high = min(high, linear) - (float(live.peak_bytes) - limit)
        if high < least:
            break
    last = rounds[-1]
    raise PlanError(
        f"constraints.device_memory={limit_text}: no plan found that fits, the best of "
        f"{len(rounds)} solves peaks at {format_bytes(last['peak_bytes'])} > "
        f"{format_bytes(limit)} (linear model {format_bytes(last['linear_bytes'])}, smallest "
        f"reachable {format_bytes(least)}); raise the limit or use "
        "memory.activation_checkpointing=full")
