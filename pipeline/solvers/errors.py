"""Typed errors raised by the MRF solvers (TRW-S, local search, brute force).

Catch :class:`SolverError` for "the solver could not produce a usable labelling";
:class:`InfeasibleError` is also a :class:`ValueError` because it is a property of
the input problem, not of the solver.
"""

from __future__ import annotations


class SolverError(Exception):
    """Base class of the errors the MRF solvers raise on purpose."""


class InfeasibleError(SolverError, ValueError):
    """The MRF provably has no labelling of finite energy.

    Raised when every label of a group is forbidden (``+inf`` unary), or when
    message passing proves it: a TRW-S message that is ``+inf`` for every label
    of its target group means no label of the target is compatible with any
    still-allowed label of the sender (an arc-consistency proof).
    """


class NoFeasibleLabelingError(SolverError, RuntimeError):
    """A heuristic solver ended without any finite-energy labelling.

    Unlike :class:`InfeasibleError` this is not a proof of infeasibility: the
    problem may still have a feasible labelling the heuristic did not find
    (use the exact ILP solver to decide).
    """


class FractionalRelaxationError(SolverError, RuntimeError):
    """``solve_ilp(relax=True)``: the LP optimum is fractional, so it gives no labelling.

    The message is one line: "LP relaxation is fractional (max distance to
    integral = ...); use solver=ilp".
    """
