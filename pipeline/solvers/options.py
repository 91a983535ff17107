"""Options of the solvers: one small frozen dataclass per solver.

Every solver of this package is called as ``solve(mrf, options) -> SolverResult``
(:mod:`pipeline.solvers.registry`); ``options`` is the dataclass below that belongs
to it. Each has ``from_config(solver_cfg, **overrides)``, which reads the fields it
needs from the Hydra solver config (``pipeline.config.SolverConfig``: any object
with those attributes) and takes run-time values (a progress callback, an MPS path,
the inner solver of the Lagrangian wrapper) as keyword overrides.

This module imports no solver (it is imported by the config validation, for
:data:`BACKENDS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from pipeline.solvers.mrf import MRF
    from pipeline.solvers.result import SolverResult
    from pipeline.solvers.warm import WarmStart

#: Backends of the integer program and its LP relaxation (pipeline/solvers/ilp/).
BACKENDS: tuple[str, ...] = ("highs", "cbc")

#: ``progress(iteration, bound_us, best_energy_us)``, called after every TRW-S iteration.
TrwsProgressFn = Callable[[int, float, float], None]
#: ``progress(inner_solves, multiplier, row_value, feasible)``, called after every
#: inner solve of the Lagrangian wrapper (pipeline/solvers/lagrangian.py).
RowProgressFn = Callable[[int, float, float, bool], None]


def _fields(cls: type, solver_cfg: Any, names: tuple[str, ...], overrides: dict) -> Any:
    values = {n: getattr(solver_cfg, n) for n in names if n not in overrides}
    return cls(**values, **overrides)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown ILP backend {backend!r}; choose one of {BACKENDS}")


@dataclass(frozen=True)
class TrwsOptions:
    """TRW-S then local search (solver ``approx``); see
    :func:`pipeline.solvers.trws.solve_trws` for the meaning of each field."""

    max_iters: int = 500
    tol: float = 1e-7
    local_search_rounds: int = 50
    time_limit_s: float | None = None
    order: str | np.ndarray = "auto"
    max_levels: int = 128
    label_bounds: bool = False
    progress: TrwsProgressFn | None = None
    #: messages of an earlier solve of the same layout to start from, and where this
    #: solve leaves its own (pipeline/solvers/warm.py); None: from zeros
    warm: WarmStart | None = None

    @classmethod
    def from_config(cls, solver_cfg: Any, **overrides: Any) -> TrwsOptions:
        """``max_iters``, ``tol``, ``local_search_rounds``, ``time_limit_s`` from the config."""
        out = _fields(cls, solver_cfg, ("max_iters", "tol", "local_search_rounds",
                                        "time_limit_s"), overrides)
        return dataclasses.replace(out, max_iters=int(out.max_iters), tol=float(out.tol),
                                   local_search_rounds=int(out.local_search_rounds))


@dataclass(frozen=True)
class IlpOptions:
    """The exact integer program (solver ``ilp``); see
    :func:`pipeline.solvers.ilp.solve_ilp` for the meaning of each field."""

    backend: str = "highs"
    time_limit_s: float | None = None
    mip_gap: float = 0.0
    threads: int = 1
    mps_path: str | Path | None = None
    msg: bool = False
    #: a plan found before (the pruning step's TRW-S result), returned as ``Heuristic``
    #: when the solve stops without a plan (pipeline/solvers/ilp/fallback.py)
    fallback: SolverResult | None = None

    def __post_init__(self) -> None:
        _check_backend(self.backend)

    @classmethod
    def from_config(cls, solver_cfg: Any, **overrides: Any) -> IlpOptions:
        """``backend``, ``time_limit_s``, ``mip_gap``, ``threads`` from the config."""
        out = _fields(cls, solver_cfg, ("backend", "time_limit_s", "mip_gap", "threads"),
                      overrides)
        return dataclasses.replace(out, backend=str(out.backend), mip_gap=float(out.mip_gap),
                                   threads=int(out.threads))


@dataclass(frozen=True)
class LpOptions:
    """The LP relaxation of the integer program (solver ``lp``).

    ``accept_fractional=False`` (the solver ``lp``): a fractional optimum raises
    :class:`~pipeline.solvers.errors.FractionalRelaxationError`, as it gives no
    labelling. ``True`` (a lower bound only, :func:`pipeline.solvers.ilp.lp_lower_bound`):
    the result carries the LP optimum as its bound, and a labelling only when the
    optimum is integral. Other fields as for :class:`IlpOptions`.
    """

    backend: str = "highs"
    time_limit_s: float | None = None
    threads: int = 1
    mps_path: str | Path | None = None
    msg: bool = False
    accept_fractional: bool = False
    fallback: SolverResult | None = None

    def __post_init__(self) -> None:
        _check_backend(self.backend)

    @classmethod
    def from_config(cls, solver_cfg: Any, **overrides: Any) -> LpOptions:
        """``backend``, ``time_limit_s``, ``threads`` from the config."""
        out = _fields(cls, solver_cfg, ("backend", "time_limit_s", "threads"), overrides)
        return dataclasses.replace(out, backend=str(out.backend), threads=int(out.threads))


@dataclass(frozen=True)
class BruteForceOptions:
    """Enumeration (solver ``brute_force``, the test oracle).

    Attributes:
        max_joint_labels: refuse problems with more joint labellings (the energy
            tensor of the default 2e6 labellings is 16 MB of float64).
    """

    max_joint_labels: int = 2_000_000

    @classmethod
    def from_config(cls, solver_cfg: Any = None, **overrides: Any) -> BruteForceOptions:
        """No config field: defaults and ``overrides`` only."""
        return cls(**overrides)


@dataclass(frozen=True)
class LagrangianOptions:
    """The Lagrangian wrapper (solver ``lagrangian``) around a solver that ignores rows.

    Attributes:
        inner: the inner solve, ``inner(mrf) -> SolverResult`` on an MRF without
            rows (e.g. ``registry.bind("approx", TrwsOptions(...))``).
        bisect_steps: bisection steps per multiplier once a multiplier satisfies its row.
        max_doublings: doublings per multiplier before giving up on it.
        max_rounds: rounds over the rows (several rows only: one row needs one round).
        progress: optional observer of every inner solve (:data:`RowProgressFn`).
    """

    inner: Callable[[MRF], SolverResult] | None = None
    bisect_steps: int = 8
    max_doublings: int = 40
    max_rounds: int = 4
    progress: RowProgressFn | None = None

    @classmethod
    def from_config(cls, solver_cfg: Any = None, **overrides: Any) -> LagrangianOptions:
        """No config field yet: defaults and ``overrides`` (``inner`` at least)."""
        return cls(**overrides)
