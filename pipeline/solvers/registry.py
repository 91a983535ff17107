"""The solver registry: name -> solver, one protocol for all.

Every solver is ``solve(mrf, options) -> SolverResult`` (pipeline/solvers/result.py)
with ``options`` a frozen dataclass of pipeline/solvers/options.py:

* ``approx``: TRW-S then local search (trws.py); ``TrwsOptions``; ignores rows.
* ``ilp``: the exact integer program (ilp/); ``IlpOptions``; rows are program rows.
* ``lp``: its LP relaxation, a labelling only when integral (else an error, or a
  bound-only result with ``accept_fractional``); ``LpOptions``; rows too.
* ``brute_force``: enumeration, the test oracle (brute.py); ``BruteForceOptions``;
  honours rows.
* ``lagrangian``: a row-ignoring solver subject to any number of rows
  (lagrangian.py); ``LagrangianOptions`` (``inner``: that solver, e.g. from
  :func:`bind`).

A solver that ignores ``MRF.linear_constraints`` (``Solver.honours_rows`` False)
is wrapped in ``lagrangian`` when an MRF has rows; :func:`solve` does this.

Adding a solver: write ``solve(mrf, options)`` and its options dataclass (with
``from_config``), and add one :class:`Solver` entry to :data:`SOLVERS`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from pipeline.solvers import brute, ilp, lagrangian, trws
from pipeline.solvers.mrf import MRF
from pipeline.solvers.options import (
    BruteForceOptions,
    IlpOptions,
    LagrangianOptions,
    LpOptions,
    TrwsOptions,
)
from pipeline.solvers.result import SolverResult


@dataclass(frozen=True)
class Solver:
    """One registered solver.

    Attributes:
        name: registry key (``solver.name`` in the config for approx, ilp, lp).
        run: ``run(mrf, options) -> SolverResult``.
        options_type: its options dataclass (has ``from_config``).
        honours_rows: True if ``run`` enforces ``MRF.linear_constraints`` itself.
        exact: True if an ``"Optimal"`` status is a proof by the solver itself
            (ilp, lp, brute_force); False for heuristics that certify only when
            their bound meets the objective (approx, lagrangian).
        summary: one line for listings.
    """

    name: str
    run: Callable[[MRF, Any], SolverResult]
    options_type: type
    honours_rows: bool
    exact: bool
    summary: str

    def solve(self, mrf: MRF, options: Any = None) -> SolverResult:
        """``run(mrf, options)``; default options when ``options`` is None."""
        return self.run(mrf, self.options_type() if options is None else options)

    def options(self, solver_cfg: Any = None, **overrides: Any) -> Any:
        """Options from the Hydra solver config (``pipeline.config.SolverConfig``)
        plus run-time ``overrides``; defaults only when ``solver_cfg`` is None."""
        if solver_cfg is None:
            return self.options_type(**overrides)
        return self.options_type.from_config(solver_cfg, **overrides)


SOLVERS: Mapping[str, Solver] = MappingProxyType({
    s.name: s for s in (
        Solver("approx", trws.solve, TrwsOptions, False, False, "TRW-S then local search"),
        Solver("ilp", ilp.solve, IlpOptions, True, True, "exact integer program (HiGHS or CBC)"),
        Solver("lp", ilp.solve_lp, LpOptions, True, True, "LP relaxation (local polytope)"),
        Solver("brute_force", brute.solve, BruteForceOptions, True, True,
               "enumeration (the test oracle)"),
        Solver("lagrangian", lagrangian.solve, LagrangianOptions, True, False,
               "Lagrangian relaxation of the rows around a row-less solver"),
    )
})


def get_solver(name: str) -> Solver:
    """The solver registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(f"solver {name!r}: allowed {', '.join(SOLVERS)}") from None


def bind(name: str, options: Any = None) -> Callable[[MRF], SolverResult]:
    """``mrf -> get_solver(name).solve(mrf, options)`` (e.g. the inner solve of
    ``lagrangian``)."""
    return functools.partial(get_solver(name).solve, options=options)


def solve(name: str, mrf: MRF, options: Any = None,
          lagrangian_options: LagrangianOptions | None = None) -> SolverResult:
    """Solve ``mrf`` with the solver ``name``, honouring its rows: a solver that
    ignores rows is wrapped in ``lagrangian`` (``lagrangian_options`` with
    ``inner`` replaced) when ``mrf`` has any."""
    solver = get_solver(name)
    if solver.honours_rows or not mrf.linear_constraints:
        return solver.solve(mrf, options)
    wrapper = lagrangian_options if lagrangian_options is not None else LagrangianOptions()
    return SOLVERS["lagrangian"].solve(mrf, replace(wrapper, inner=bind(name, options)))
