"""``constraints.device_memory``: the memory rows of the MRF and the check of a solved plan.

The first row (built by the costs stage beside the parameter budget) bounds the linear
model of :mod:`pipeline.memory.terms`:

    sum_g c_g(x_g) <= M,        c_g = sum of the memory terms of group g's nodes

``approx`` honours rows by Lagrangian relaxation (pipeline/solvers/lagrangian.py, with a
lower bound valid for the rows), ``ilp`` / ``lp`` as rows of the program. The liveness
peak (:mod:`pipeline.memory.liveness`) also holds transients the row cannot see
(redistributed inputs, re-gathered weights, recomputed values, the loss gradient), so
the solve stage checks the plan after solving and, while its peak exceeds ``M``, adds a
cut for the moment of the peak and solves again (deterministic, at most
``max_rounds`` solves): with ``t`` the node at which plan ``x_r`` peaks and ``A_t`` the
allocations live there (each a function of one node's strategy,
:attr:`~pipeline.memory.liveness.Liveness.peak_sources`),

    sum_{a in A_t} bytes_a(x_{node(a)}) <= M

is the memory live at ``t`` as a linear function of the labels (with ``x_r``'s aliasing
and lifetimes), which ``x_r`` violates. The bound of the last solve is for the problem
with every row added (the record says which). A limit below the smallest linear memory
any allowed plan reaches, ``sum_g min_{k allowed} c_g(k)`` (exact: the row is
separable), is infeasible before any solve; so is a cut whose smallest value exceeds
``M``.

The allocator reserve. A device needs more than the liveness peak: the caching
allocator's reserve and fragmentation, NCCL's and the kernels' workspaces and the
optimizer step's temporaries (:mod:`pipeline.memory.liveness` lists them). The model
takes them as ``memory.reserve_fraction = f`` of the peak, so the device holds
``(1 + f) * peak`` (the *reserved* bytes, ``torch.cuda.memory_reserved``'s analogue),
and the limit ``M`` bounds that: every row above and the check compare the linear model
and the peak with ``M / (1 + f)`` (exact, the rows being linear).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core.errors import PlanError
from pipeline.memory.options import format_bytes
from pipeline.solvers.mrf import LinearConstraint

__all__ = ["MAX_ROUNDS", "ROW_NAME", "FitResult", "fit_plan", "is_memory_row", "memory_row",
           "reserved", "smallest_memory"]

ROW_NAME = "device_memory"
#: Solves at most (the first one included) while the peak exceeds the limit.
MAX_ROUNDS = 6


def memory_row(coef: dict[int, np.ndarray], high: float, at: str | None = None
               ) -> LinearConstraint:
    """A device-memory row ``sum_g coef_g(x_g) <= high`` (bytes); ``at``: the node whose
    live memory a cut bounds (its name becomes ``device_memory@<node>``)."""
    name = ROW_NAME if at is None else f"{ROW_NAME}@{at}"
    return LinearConstraint(name=name, coef=coef, low=-math.inf, high=float(high))


def is_memory_row(row: LinearConstraint) -> bool:
    """Whether a row is one of the device-memory rows."""
    return row.name == ROW_NAME or row.name.startswith(ROW_NAME + "@")


def smallest_memory(coef: dict[int, np.ndarray], unary: list[np.ndarray]) -> float:
    """The smallest value of a row over the labels each group allows (finite unary)."""
    total = 0.0
    for g, c in sorted(coef.items()):
        ok = np.isfinite(unary[g])
        total += float(c[ok].min()) if ok.any() else float(c.min())
    return total


def reserved(nbytes: float, reserve_fraction: float) -> float:
    """Bytes a device reserves for ``nbytes`` live: ``(1 + f) * nbytes`` (module
    docstring)."""
    return float(nbytes) * (1.0 + float(reserve_fraction))


def _with_reserve(nbytes: float, reserve_fraction: float) -> str:
    """``X`` or ``X (+ f reserve: Y)`` for messages."""
    if not reserve_fraction:
        return format_bytes(nbytes)
    return (f"{format_bytes(nbytes)} (x {1 + reserve_fraction:g} with memory.reserve_fraction"
            f"={reserve_fraction:g}: {format_bytes(reserved(nbytes, reserve_fraction))})")


def check_feasible(coef: dict[int, np.ndarray], unary: list[np.ndarray], limit: float,
                   limit_text: str, reserve_fraction: float = 0.0) -> float:
    """Raise PlanError (one line) when no allowed plan's linear memory, with the
    allocator reserve, fits ``limit``; returns the smallest linear memory."""
    least = smallest_memory(coef, unary)
    if reserved(least, reserve_fraction) > limit:
        raise PlanError(
            f"constraints.device_memory={limit_text}: infeasible, the smallest memory any "
            f"plan reaches is {_with_reserve(least, reserve_fraction)} ({int(least)} B: "
            f"parameters, gradients, optimizer state, buffers and saved activations per "
            f"device) > {format_bytes(limit)}; raise the limit, shard over more devices or "
            "use memory.activation_checkpointing=full")
    return least


@dataclass
class FitResult:
    """The plan found under the limit and how it was found: the solver's ``result``,
    the memory ``rows`` of the last solve (the linear row, then the cuts), every solve's
    ``rounds`` and the plan's liveness ``peak``."""

    result: Any
    rows: list[LinearConstraint]
    rounds: list[dict[str, Any]] = field(default_factory=list)
    peak: Any = None


def fit_plan(solve: Callable[[list[LinearConstraint]], Any],
             peak_of: Callable[[np.ndarray], Any],
             peak_coef: Callable[[Any], dict[int, np.ndarray]],
             coef: dict[int, np.ndarray], limit: float, unary: list[np.ndarray],
             limit_text: str, node_name: Callable[[int], str] = str,
             max_rounds: int = MAX_ROUNDS, reserve_fraction: float = 0.0) -> FitResult:
    """Solve with the memory row, check the liveness peak, cut until the plan fits.

    ``solve(rows)`` solves the MRF with the given memory rows and returns a result with
    ``labels``; ``peak_of(labels)`` returns its :class:`~pipeline.memory.liveness.Liveness`,
    ``peak_coef(liveness)`` the row of the memory live at its peak (module docstring).
    ``reserve_fraction``: the allocator reserve ``f``; the rows and the peak are held
    to ``limit / (1 + f)``. Raises PlanError when a cut cannot be met by any allowed plan
    or no plan fits after ``max_rounds`` solves.
    """
    least = check_feasible(coef, unary, limit, limit_text, reserve_fraction)
    high = limit / (1.0 + reserve_fraction)
    rows = [memory_row(coef, high)]
    rounds: list[dict[str, Any]] = []
    for _ in range(max_rounds):
        result = solve(list(rows))
        labels = np.asarray(result.labels, dtype=np.int64)
        linear = float(sum(float(c[labels[g]]) for g, c in sorted(coef.items())))
        live = peak_of(labels)
        at = node_name(int(live.peak_node))
        rounds.append({"rows": len(rows), "linear_bytes": linear,
                       "peak_bytes": float(live.peak_bytes), "peak_node": at,
                       "objective": float(result.objective)})
        if live.peak_bytes <= high:
            return FitResult(result, rows, rounds, live)
        cut = peak_coef(live)
        floor = smallest_memory(cut, unary)
        if floor > high:
            raise PlanError(
                f"constraints.device_memory={limit_text}: infeasible, at {at} the smallest "
                f"memory any plan reaches is {_with_reserve(floor, reserve_fraction)} > "
                f"{format_bytes(limit)} (the smallest linear memory is "
                f"{format_bytes(least)}); raise the limit or use "
                "memory.activation_checkpointing=full")
        rows.append(memory_row(cut, high, at))
    last = rounds[-1]
    raise PlanError(
        f"constraints.device_memory={limit_text}: no plan found that fits, the last of "
        f"{len(rounds)} solves peaks at "
        f"{_with_reserve(last['peak_bytes'], reserve_fraction)} at "
        f"{last['peak_node']} > {format_bytes(limit)} (linear model "
        f"{format_bytes(last['linear_bytes'])}, smallest reachable {format_bytes(least)}); "
        "raise the limit or use memory.activation_checkpointing=full")
