"""Honest solver status: the status words, defined once, and the backend maps.

Every exact solver result (ilp, lp) carries exactly one of:

* ``"Optimal"`` -- proven optimal (for a MIP: within the requested gap,
  ``mip_gap=0`` meaning the backend's default absolute tolerance only).
* ``"Feasible (time limit)"`` -- the run stopped early (time, node, iteration
  or solution limit, interrupt) *with* an incumbent; the result carries the
  incumbent and the backend's best dual bound.
* ``"Infeasible"`` -- the backend proved that no labelling exists.
* ``"Not Solved"`` -- anything else (stopped without incumbent, errors, and
  outcomes that cannot occur for our bounded models such as "unbounded").

Why this module exists: PuLP 3.3.2 reports a CBC run stopped on the time
limit with an incumbent as ``LpStatusOptimal`` (``status == 1``); only the
second code ``sol_status`` (``LpSolutionOptimal`` = 1 versus
``LpSolutionIntegerFeasible`` = 2) tells the two apart (see
``pulp.apis.coin_api.COIN_CMD.get_status``). HiGHS reports its own
``HighsModelStatus`` (HiGHS docs, "Model status") and whether a primal
solution exists (``info.primal_solution_status == 2``, "feasible").

Heuristic solvers (TRW-S with local search, the Lagrangian wrapper) report
``"Optimal"`` when their lower bound certifies the objective
(:func:`pipeline.solvers.result.certified_status`) and otherwise:

* ``"Heuristic"`` -- a feasible labelling without a proof of optimality.

The functions here are pure (no solver is run) so every branch is unit-tested.
"""

from __future__ import annotations

OPTIMAL = "Optimal"
FEASIBLE_TIME_LIMIT = "Feasible (time limit)"
INFEASIBLE = "Infeasible"
NOT_SOLVED = "Not Solved"

HEURISTIC = "Heuristic"

#: The statuses of the exact solvers (ilp, lp), the range of the backend maps below.
STATUSES = (OPTIMAL, FEASIBLE_TIME_LIMIT, INFEASIBLE, NOT_SOLVED)

# PuLP constants (pulp.constants), repeated so this module imports nothing.
PULP_STATUS_OPTIMAL = 1
PULP_STATUS_NOT_SOLVED = 0
PULP_STATUS_INFEASIBLE = -1
PULP_STATUS_UNBOUNDED = -2
PULP_STATUS_UNDEFINED = -3
PULP_SOLUTION_NO_SOLUTION = 0
PULP_SOLUTION_OPTIMAL = 1
PULP_SOLUTION_INTEGER_FEASIBLE = 2
PULP_SOLUTION_INFEASIBLE = -1
PULP_SOLUTION_UNBOUNDED = -2

# HiGHS model statuses that mean "stopped early by a limit or an interrupt":
# with an incumbent they give "Feasible (time limit)", without one "Not Solved".
_HIGHS_EARLY_STOP = frozenset(
    {
        "kTimeLimit",
        "kIterationLimit",
        "kSolutionLimit",
        "kInterrupt",
        "kHighsInterrupt",
        "kMemoryLimit",
        "kObjectiveBound",
        "kObjectiveTarget",
        "kUnknown",
    }
)


def map_pulp_status(status: int, sol_status: int) -> str:
    """Map PuLP's ``(LpStatus, LpSolution)`` pair to one of :data:`STATUSES`.

    Args:
        status: ``prob.status`` / ``COIN_CMD.get_status(...)[0]``
            (1 optimal, 0 not solved, -1 infeasible, -2 unbounded, -3 undefined).
        sol_status: ``prob.sol_status`` / ``get_status(...)[1]`` (1 optimal
            solution, 2 integer feasible, 0 none, -1 infeasible, -2 unbounded).

    Returns:
        ``"Optimal"`` only for ``(1, 1)``; ``"Feasible (time limit)"`` whenever
        ``sol_status`` is 2 (an incumbent without proof, which PuLP labels
        ``status == 1`` after a time-limited CBC run) unless ``status`` says
        infeasible; ``"Infeasible"`` for ``status == -1``; otherwise
        ``"Not Solved"``. Unbounded cannot happen (all variables in [0, 1]), so
        it is treated as a failed solve.
    """
    if status == PULP_STATUS_INFEASIBLE:
        return INFEASIBLE
    if status == PULP_STATUS_OPTIMAL and sol_status == PULP_SOLUTION_OPTIMAL:
        return OPTIMAL
    if status in (PULP_STATUS_OPTIMAL, PULP_STATUS_NOT_SOLVED) and (
        sol_status == PULP_SOLUTION_INTEGER_FEASIBLE
    ):
        return FEASIBLE_TIME_LIMIT
    return NOT_SOLVED


def map_highs_status(model_status, has_solution: bool) -> str:
    """Map a HiGHS model status to one of :data:`STATUSES`.

    Args:
        model_status: a ``highspy.HighsModelStatus`` member or its name
            (e.g. ``"kTimeLimit"``).
        has_solution: whether HiGHS holds a primal feasible point
            (``h.getInfo().primal_solution_status == 2``).

    Returns:
        ``kOptimal`` -> ``"Optimal"`` (``"Not Solved"`` if, inconsistently, no
        solution is held); ``kInfeasible`` and ``kUnboundedOrInfeasible`` ->
        ``"Infeasible"`` (our models have every variable in [0, 1], so the
        unbounded alternative is impossible); limits, interrupts and
        ``kUnknown`` -> ``"Feasible (time limit)"`` with a solution, else
        ``"Not Solved"``; errors, ``kNotset``, ``kModelEmpty``, ``kUnbounded``
        and any unknown name -> ``"Not Solved"``.

    Reference: HiGHS documentation, "HighsModelStatus".
    """
    name = model_status if isinstance(model_status, str) else model_status.name
    if name == "kOptimal":
        return OPTIMAL if has_solution else NOT_SOLVED
    if name in ("kInfeasible", "kUnboundedOrInfeasible"):
        return INFEASIBLE
    if name in _HIGHS_EARLY_STOP:
        return FEASIBLE_TIME_LIMIT if has_solution else NOT_SOLVED
    return NOT_SOLVED
