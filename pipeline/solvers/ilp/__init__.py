"""Exact integer program (and its LP relaxation) for the pairwise MRF.

Entry points: :func:`solve_ilp` / :func:`lp_lower_bound` (keyword arguments)
and the solver protocol ``solve(mrf, IlpOptions)`` / ``solve_lp(mrf, LpOptions)``
(:mod:`pipeline.solvers.registry`). The program, its exactness and its LP
relaxation (= the local polytope, ``>=`` every TRW-S bound) are written out in
:mod:`pipeline.solvers.ilp.model`; the backends:

* ``"highs"``: HiGHS (``highspy``), fed the CSC arrays directly
  (:mod:`pipeline.solvers.ilp.highs`).
* ``"cbc"``: the CBC binary bundled with PuLP, run on the MPS written by HiGHS
  and read back through PuLP's own status parser
  (:mod:`pipeline.solvers.ilp.cbc`).

Errors: ``ValueError`` for malformed MRFs (shape mismatch, NaN, ``-inf``);
:class:`~pipeline.solvers.errors.InfeasibleError` when no labelling exists;
:class:`~pipeline.solvers.errors.FractionalRelaxationError` when
``relax=True`` and the LP optimum is fractional.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import numpy as np

from pipeline.solvers.errors import FractionalRelaxationError, InfeasibleError
from pipeline.solvers.ilp.cbc import CBC_HARD_LIMIT_FACTOR, parse_cbc_log, solve_cbc
from pipeline.solvers.ilp.fallback import fallback_result, plan_problem, violated_rows
from pipeline.solvers.ilp.highs import solve_highs, write_mps
from pipeline.solvers.ilp.interrupts import signals_raise
from pipeline.solvers.ilp.model import INTEGRALITY_TOL, BackendOutcome, IlpModel, build_model
from pipeline.solvers.mrf import MRF
from pipeline.solvers.options import BACKENDS, IlpOptions, LpOptions
from pipeline.solvers.result import SolverResult
from pipeline.solvers.status import FEASIBLE_TIME_LIMIT, INFEASIBLE, NOT_SOLVED, OPTIMAL

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "CBC_HARD_LIMIT_FACTOR",
    "INTEGRALITY_TOL",
    "BackendOutcome",
    "IlpModel",
    "build_model",
    "lp_lower_bound",
    "parse_cbc_log",
    "solve",
    "solve_ilp",
    "solve_lp",
    "solve_model",
    "write_mps",
]


def solve_model(model: IlpModel, backend: str, *, relax: bool, time_limit_s: float | None,
                mip_gap: float, threads: int, msg: bool,
                mps_path: str | Path | None) -> BackendOutcome:
    """Run ``backend`` (one of :data:`BACKENDS`) on a built model. SIGTERM / SIGINT end
    the solve as an exception (:func:`pipeline.solvers.ilp.interrupts.signals_raise`):
    with ``cbc`` the child process is killed and its temp directory removed; HiGHS runs
    in its own thread and is cancelled (:func:`pipeline.solvers.ilp.highs.
    run_interruptible`), and an MPS write in progress removes its temp file."""
    kw = dict(relax=relax, time_limit_s=time_limit_s, mip_gap=mip_gap, threads=threads,
              msg=msg, mps_path=mps_path)
    if backend == "highs":
        with signals_raise():
            return solve_highs(model, **kw)
    if backend == "cbc":
        with signals_raise():
            return solve_cbc(model, **kw)
    raise ValueError(f"unknown ILP backend {backend!r}; choose one of {BACKENDS}")


#: The former private name of :func:`solve_model` (tests import it).
_solve_model = solve_model


#: The former name of :func:`pipeline.solvers.ilp.fallback.violated_rows`.
_check_labels = violated_rows


def solve_ilp(
    mrf: MRF,
    *,
    backend: str = "highs",
    relax: bool = False,
    time_limit_s: float | None = None,
    mip_gap: float = 0.0,
    threads: int = 1,
    mps_path: str | Path | None = None,
    msg: bool = False,
    fallback: SolverResult | None = None,
) -> SolverResult:
    """Solve the MRF exactly as an integer program (or its LP relaxation).

    Args:
        mrf: the problem.
        backend: ``"highs"`` (highspy) or ``"cbc"`` (PuLP's bundled CBC).
        relax: solve the LP relaxation (= local polytope) instead; accepted only
            if every ``x`` is within :data:`INTEGRALITY_TOL` of 0/1.
        time_limit_s: wall-clock limit of the backend solve (s); ``None`` = none.
            Building the model and writing the MPS file are not counted.
        mip_gap: relative MIP gap at which the backend may stop and call the
            incumbent optimal (0 = prove optimality).
        threads: backend threads.
        mps_path: if given, the full model (integer unless ``relax``) is
            written there as MPS, names as in the module docstring.
        msg: print the backend log.
        fallback: a plan found before (the TRW-S plan of the pruning step): when
            the backend stops without an incumbent that is a plan (a time limit, an
            incumbent with a forbidden entry or a violated row), the result is this
            plan, status ``"Heuristic"``, with the better of both lower bounds
            (:mod:`pipeline.solvers.ilp.fallback`).

    Returns:
        :class:`SolverResult` with ``labels`` int64 ``[G]`` (all ``-1`` when
        ``status == "Not Solved"``: stopped without a plan and without a usable
        ``fallback``), ``objective = mrf.evaluate(labels)`` (µs,
        ``+inf`` when not solved), ``lower_bound`` (µs; the objective for an
        ``"Optimal"`` run with ``mip_gap == 0``, else the backend's dual bound;
        ``-inf`` if none), ``lower_bound_source`` ``"ilp"`` or ``"lp"``,
        ``iterations`` (B&B nodes for the ILP; for the LP, HiGHS IPM + crossover
        iterations or CBC simplex iterations),
        ``bound_history`` ``[lower_bound]`` (one final value) and ``extra``
        with ``backend``, ``variables``, ``constraints``, ``nonzeros``,
        ``integer_variables``, ``labels_dominated``, ``build_seconds``,
        ``backend_seconds`` (the backend's own wall-clock solve time),
        ``backend_cpu_seconds``, ``mip_gap`` (reported), ``backend_objective``
        and backend-specific diagnostics.

    Raises:
        ValueError: unknown backend or malformed MRF.
        InfeasibleError: no labelling satisfies the forbidden entries and
            linear constraints (proved by the backend or found while building).
        FractionalRelaxationError: ``relax=True`` and the LP optimum is
            fractional.
    """
    return _solve(mrf, backend=backend, relax=relax, time_limit_s=time_limit_s,
                  mip_gap=mip_gap, threads=threads, mps_path=mps_path, msg=msg,
                  fallback=fallback)


def _solve(mrf: MRF, *, backend: str, relax: bool, time_limit_s: float | None,
           mip_gap: float, threads: int, mps_path: str | Path | None, msg: bool,
           accept_fractional: bool = False, fallback: SolverResult | None = None
           ) -> SolverResult:
    """:func:`solve_ilp`; ``accept_fractional`` (``relax`` only): a fractional LP
    optimum gives a bound-only result instead of an error (:class:`LpOptions`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown ILP backend {backend!r}; choose one of {BACKENDS}")
    t_start = time.perf_counter()
    model = build_model(mrf)
    out = solve_model(
        model,
        backend,
        relax=relax,
        time_limit_s=time_limit_s,
        mip_gap=mip_gap,
        threads=threads,
        msg=msg,
        mps_path=mps_path,
    )
    extra = {
        "backend": backend,
        "relax": relax,
        "variables": model.num_cols,
        "integer_variables": 0 if relax else model.num_x,
        "constraints": model.num_rows,
        "nonzeros": model.nnz,
        "labels_dominated": model.labels_dominated,
        "build_seconds": model.build_seconds,
        "backend_seconds": out.backend_seconds,
        "mip_gap": out.mip_gap,
        "backend_objective": out.backend_objective,
        "time_limit_s": time_limit_s,
        "threads": threads,
    }
    extra.update(out.extra)
    if out.status == INFEASIBLE:
        kind = "LP relaxation" if relax else "ILP"
        raise InfeasibleError(
            f"{kind} is infeasible ({backend}): no labelling satisfies "
            "the forbidden entries and linear constraints"
        )
    source = "lp" if relax else "ilp"
    if out.status == FEASIBLE_TIME_LIMIT and not relax:
        # a stopped run's incumbent is used only when it is a plan (fallback.py)
        problem = plan_problem(mrf, model.labels_from_x(out.col_value))
        if problem is not None:
            extra["incumbent_rejected"] = problem
            out = dataclasses.replace(out, status=NOT_SOLVED, col_value=None)
    if out.status == NOT_SOLVED:
        labels = np.full(model.num_groups, -1, dtype=np.int64)
        bound = out.dual_bound if math.isfinite(out.dual_bound) else -math.inf
        stopped = SolverResult(
            labels=labels,
            objective=math.inf,
            lower_bound=bound,
            lower_bound_source=source,
            status=NOT_SOLVED,
            iterations=out.iterations,
            bound_history=[bound],
            solve_seconds=time.perf_counter() - t_start,
            extra=extra,
        )
        why = extra.get("incumbent_rejected") or "no incumbent"
        planned = None if fallback is None else fallback_result(mrf, fallback, stopped, why)
        if planned is None:
            return stopped
        how = extra.get("highs_model_status") or extra.get("cbc_result") or NOT_SOLVED
        log.warning("%s (%s) stopped without a plan (%s; %s): the %s plan found before, "
                    "status %s, objective %.3f bound %.3f", source, backend, how, why,
                    planned.extra["fallback"], planned.status, planned.objective,
                    planned.lower_bound)
        return planned
    labels = model.labels_from_x(out.col_value)
    if relax:
        frac = model.fractionality(out.col_value)
        extra["max_fractionality"] = frac
        if accept_fractional:
            return _lp_bound_result(mrf, model, out, labels, frac, extra,
                                    time.perf_counter() - t_start)
        if frac > INTEGRALITY_TOL:
            raise FractionalRelaxationError(
                f"LP relaxation is fractional (max distance to integral = {frac:.3g}); "
                "use solver=ilp"
            )
    objective = mrf.evaluate(labels)
    if not math.isfinite(objective):
        raise RuntimeError(
            f"{backend} returned a labelling with a forbidden entry (objective {objective})"
        )
    violated = _check_labels(mrf, labels)
    if violated:
        raise RuntimeError(f"{backend} labelling violates linear constraints {violated}")
    if out.status == OPTIMAL and not relax and mip_gap == 0.0:
        bound = objective
    else:
        bound = min(objective, out.dual_bound)
    return SolverResult(
        labels=labels,
        objective=objective,
        lower_bound=bound,
        lower_bound_source=source,
        status=out.status,
        iterations=out.iterations,
        bound_history=[bound],
        solve_seconds=time.perf_counter() - t_start,
        extra=extra,
    )



def _lp_bound_result(mrf: MRF, model: IlpModel, out: BackendOutcome, labels: np.ndarray,
                     frac: float, extra: dict, seconds: float) -> SolverResult:
    """The bound-only result of an optimal LP (:class:`LpOptions` ``accept_fractional``):
    ``lower_bound`` is the LP optimum as the backend reports it; the labels (and
    their objective) only when the optimum is integral and valid, else ``-1`` and
    ``+inf``."""
    objective = math.inf
    if frac <= INTEGRALITY_TOL:
        objective = mrf.evaluate(labels)
        if not math.isfinite(objective) or _check_labels(mrf, labels):
            objective = math.inf
    if not math.isfinite(objective):
        labels = np.full(model.num_groups, -1, dtype=np.int64)
    bound = float(out.dual_bound)
    return SolverResult(labels=labels, objective=objective, lower_bound=bound,
                        lower_bound_source="lp", status=out.status, iterations=out.iterations,
                        bound_history=[bound], solve_seconds=seconds, extra=extra)


def lp_lower_bound(
    mrf: MRF,
    backend: str = "highs",
    *,
    time_limit_s: float | None = None,
    threads: int = 1,
) -> SolverResult:
    """Optimum of the LP relaxation (local polytope + linear rows), in µs, as
    ``result.lower_bound`` (status ``"Optimal"``).

    A valid lower bound on the MRF minimum, ``>=`` any TRW-S bound (module
    docstring). Integral or not, the LP optimum is returned; ``labels`` and
    ``objective`` only when it is integral (else ``-1`` and ``+inf``).

    Raises:
        InfeasibleError: the LP (hence the MRF) is infeasible.
        RuntimeError: the LP was not solved to optimality (e.g. time limit).
    """
    res = solve_lp(mrf, LpOptions(backend=backend, time_limit_s=time_limit_s, threads=threads,
                                  accept_fractional=True))
    if res.status != OPTIMAL:
        raise RuntimeError(f"LP relaxation not solved to optimality ({backend}): {res.status}")
    return res


def solve(mrf: MRF, options: IlpOptions | None = None) -> SolverResult:
    """The solver protocol for ``ilp``: :func:`solve_ilp` with ``options``."""
    o = options if options is not None else IlpOptions()
    return _solve(mrf, backend=o.backend, relax=False, time_limit_s=o.time_limit_s,
                  mip_gap=o.mip_gap, threads=o.threads, mps_path=o.mps_path, msg=o.msg,
                  fallback=o.fallback)


def solve_lp(mrf: MRF, options: LpOptions | None = None) -> SolverResult:
    """The solver protocol for ``lp``: the LP relaxation with ``options``
    (``accept_fractional``: see :class:`~pipeline.solvers.options.LpOptions`)."""
    o = options if options is not None else LpOptions()
    return _solve(mrf, backend=o.backend, relax=True, time_limit_s=o.time_limit_s,
                  mip_gap=0.0, threads=o.threads, mps_path=o.mps_path, msg=o.msg,
                  accept_fractional=o.accept_fractional, fallback=o.fallback)
