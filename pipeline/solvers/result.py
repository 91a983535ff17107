"""The result record returned by the MRF solvers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.solvers.status import HEURISTIC, OPTIMAL

#: Relative tolerance under which a lower bound certifies an objective.
CERTIFY_RTOL = 1e-9


def relative_gap(objective: float, bound: float) -> float:
    """Return ``(objective - bound) / max(1, |objective|)`` (dimensionless).

    ``+inf`` if either value is not finite (no certificate possible). The
    denominator floor of 1 µs keeps the gap meaningful for objectives near 0.
    """
    if not (math.isfinite(objective) and math.isfinite(bound)):
        return math.inf
    return (objective - bound) / max(1.0, abs(objective))


def is_certified(objective: float, bound: float, rtol: float = CERTIFY_RTOL) -> bool:
    """True when ``objective - bound <= rtol * max(1, |objective|)``."""
    return relative_gap(objective, bound) <= rtol


def certified_status(objective: float, bound: float) -> str:
    """Status of a heuristic solve: ``"Optimal"`` when ``bound`` certifies
    ``objective`` (:func:`is_certified`), else ``"Heuristic"``."""
    return OPTIMAL if is_certified(objective, bound) else HEURISTIC


@dataclass
class SolverResult:
    """Outcome of one MRF solve.

    Attributes:
        labels: int64 ``[G]`` chosen label per group.
        objective: ``mrf.evaluate(labels)`` in µs (includes ``mrf.constant``).
        lower_bound: a valid lower bound on ``min E`` in µs (``-inf`` if none).
        lower_bound_source: which method produced the bound (e.g. ``"trws"``).
        status: exact solvers (ilp, lp) use one of
            ``pipeline.solvers.status.STATUSES``; the heuristic solvers (TRW-S,
            the Lagrangian wrapper) use :func:`certified_status`: ``"Optimal"``
            when the bound certifies the objective
            (``objective - lower_bound <= 1e-9 * max(1, |objective|)``), else
            ``"Heuristic"``.
        iterations: solver iterations performed.
        bound_history: lower bound (µs) after each iteration.
        solve_seconds: wall time of the solve in seconds.
        extra: solver-specific diagnostics (JSON-serialisable values).
        label_bounds: optional per-group float64 ``[K_g]`` arrays: entry ``k`` of
            group ``g`` is a lower bound (µs) on ``E(x)`` over every labelling
            with ``x_g = k`` that satisfies the MRF's linear constraints
            (:func:`pipeline.solvers.pruning.label_bounds`); ``None`` if not
            computed. Used for exact reduced-cost fixing before an ILP/LP.
    """

    labels: np.ndarray
    objective: float
    lower_bound: float
    lower_bound_source: str
    status: str
    iterations: int
    bound_history: list[float] = field(default_factory=list)
    solve_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    label_bounds: list[np.ndarray] | None = field(default=None, repr=False)

    @property
    def gap(self) -> float:
        """Relative gap, see :func:`relative_gap`."""
        return relative_gap(self.objective, self.lower_bound)
