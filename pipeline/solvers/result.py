"""The result every MRF solver returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SolverResult:
    """Outcome of one solver run.

    Attributes:
        labels: int64 ``[G]`` chosen label per group.
        objective: ``E(labels)`` in µs.
        lower_bound: a proven lower bound on the minimum (µs).
        lower_bound_source: where the bound comes from (e.g. ``"ilp"``, ``"lp"``).
        status: one of ``pipeline.solvers.status.STATUSES``.
        iterations: solver iterations (meaning is solver specific).
        bound_history: lower bound over the run (solver specific entries).
        solve_seconds: wall time of the solve (s).
        extra: solver-specific diagnostics.
    """

    labels: np.ndarray
    objective: float
    lower_bound: float
    lower_bound_source: str
    status: str
    iterations: int
    bound_history: list = field(default_factory=list)
    solve_seconds: float = 0.0
    extra: dict = field(default_factory=dict)
