"""Stage 4 - the step time as the objective (``solver.objective=step_time``, default).

The solvers (approx, ilp, lp) minimise an additive MRF; the quantity a run is judged by
is the overlapped step time of pipeline/costmodel/steptime.py (``step_time_us``). The
search here returns, of a set of candidate plans, the one with the smallest simulated
step time, and bounds the step time of every plan from below.

Search (deterministic):

1. **Additive plan.** The configured solver on the additive objective (the plan
   ``solver.objective=additive`` returns; with ``constraints.device_memory`` after the
   fit loop of pipeline/memory/constraint.py). It is candidate 0.
2. **Re-weight and re-solve.** On the current plan's simulation, every graph edge's
   exposed share ``s_e`` of its communication is measured (pipeline/costmodel/exposure.py:
   activation edges 1, a unit's weight gathers ``max(0, G - W) / G`` behind the
   previous unit's compute, gradient reductions the FIFO tail the rest of the backward
   cannot hide) and the weights move half way to it, ``w <- w + (s - w) / 2``
   (:data:`DAMPING`; ``w = 1`` at the start: the additive objective). The same solver
   solves the additive objective with ``comm_e`` replaced by ``w_e comm_e``
   (pipeline/costmodel/reweight.py, ``Surrogate``; same groups, labels and linear
   rows: the parameter-memory budget and the device-memory row and cuts are honoured).
   Its plan is simulated and becomes a candidate and the current plan.
3. **Stop** at a *fixed point*, when the solver returns the plan the weights came from
   and no weight moved by more than :data:`WEIGHT_TOL`, or after
   ``solver.step_time_rounds`` re-solves (``rounds``), or when a re-solve gives no plan
   (``lp``: a re-weighted relaxation that is fractional; an exact solve stopped without
   one); ``step_time_search.stop`` says which. A plan returned before is not simulated
   again (it becomes the current plan).
4. **Choose** the candidate with the smallest simulated step time (the first of equal
   ones); with a device-memory limit, a candidate whose liveness peak exceeds it is
   not chosen (the additive plan fits). So the plan returned is never slower than the
   additive plan by the simulation.

Convergence: the weights stay in ``[0, 1]`` and, with the plan fixed, approach its
exposed shares geometrically (half the distance per round), so a plan the solver keeps
returning is a fixed point within ``log2(1 / WEIGHT_TOL) = 10`` rounds; a sequence that
keeps changing plans is cut at ``step_time_rounds``. No monotonicity of the simulated
step along the sequence is claimed, which is why every plan is a candidate and the best
is kept. Not candidates
(yet): local-search moves scored by the simulation, and the recipes' plans (they need
their own pinned topology).

**Lower bound** (pipeline/solvers/step_bound.py, argument in its docstring): the step of
every plan is at least ``max(C(x), M(x) / D)``, the compute stream's busy time and the
mean of the ``D`` communication streams'; ``theta C + (1 - theta) M / D`` is additive
(pipeline/costmodel/reweight.py, ``StreamObjective``) and TRW-S's dual bound of its
minimum bounds the step of every plan from below (``step_time_lower_bound_us``, for every
solver; ``step_time_gap = (step_time_us - bound) / max(1, step_time_us)``). The stage
evaluates ``theta = 1``, the compute stream alone (:data:`BOUND_STEPS`). ``status``
is ``Optimal`` only when that gap closes (:data:`STEP_TIME_RTOL`); the additive
certificate (``lower_bound``, ``gap``, ``certified``, ``additive_status``) keeps its
own fields: they certify the additive solve's plan (candidate 0, its objective
``additive_plan_us``); ``objective`` and ``additive_us`` are the chosen plan's additive
objective.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core.errors import PlanError
from pipeline.costmodel.breakdown import plan_breakdown
from pipeline.costmodel.exposure import exposed_shares
from pipeline.costmodel.factors import group_structure
from pipeline.costmodel.reweight import StreamObjective, Surrogate
from pipeline.costmodel.steptime import StepInputs, StepTime, plan_step_inputs, simulate
from pipeline.solvers.errors import FractionalRelaxationError
from pipeline.solvers.mrf import MRF
from pipeline.solvers.result import SolverResult, relative_gap
from pipeline.solvers.step_bound import step_lower_bound

log = logging.getLogger(__name__)

__all__ = ["STEP_TIME_RTOL", "SearchOutcome", "step_time_fields", "step_time_search"]

#: Damping of the weights' update: ``w <- w + DAMPING * (exposed share - w)`` (a damped
#: fixed-point iteration; undamped, the first re-solve treats every hidden gather as free
#: and buys gathers the streams cannot hide: llama1b 2x4x8, 59.6 ms against the additive
#: plan's 33.7 ms).
DAMPING = 0.5

#: The weights have converged when no weight moves by more than this in a round.
WEIGHT_TOL = 1e-3

#: Bisection solves of the bound after ``theta = 1`` (pipeline/solvers/step_bound.py). 0:
#: the compute stream alone. On llama1b 2x4x8 (2026-12-03) the thetas 0.5, 0.75, 0.875
#: gave 13.2, 14.7 and 15.3 ms against theta = 1's 15.7 ms, for three more solves and
#: every redistribution table built again; on toy 2x4 likewise (0.87, 1.19, 1.35 against
#: 1.51 ms).
BOUND_STEPS = 0

#: Relative step-time gap under which the bound certifies the plan (the simulation and
#: the bound's MRF add the same numbers in different orders).
STEP_TIME_RTOL = 1e-9


@dataclass
class Candidate:
    """One plan of the search: where it came from, its additive objective, its
    simulated step time and whether it fits the device-memory limit."""

    source: str
    labels: np.ndarray
    additive_us: float
    step_time_us: float
    fits: bool = True
    result: SolverResult | None = field(default=None, repr=False)


@dataclass
class SearchOutcome:
    """The chosen plan (``result``: labels and its additive objective), the search's
    record entry, the step-time bound and the additive objective of the additive solve's
    plan (candidate 0, the plan the additive certificate is about)."""

    result: SolverResult
    record: dict[str, Any]
    lower_bound_us: float
    additive_plan_us: float = math.nan


class _Evaluator:
    """Simulates plans of one run (pipeline/costmodel/steptime.py)."""

    def __init__(self, topology: Any, cost_model: Any, groups: Any, weight_derived: list[bool],
                 mesh_names: list[str]):
        self.topology, self.cm, self.groups = topology, cost_model, groups
        self.weight_derived, self.mesh_names = weight_derived, mesh_names

    def __call__(self, labels: np.ndarray) -> tuple[StepInputs, StepTime, Any]:
        strategy = np.asarray(labels, dtype=np.int64)[self.groups.group_of]
        parts = plan_breakdown(self.cm, strategy, self.mesh_names)
        inputs = plan_step_inputs(self.topology, self.cm, strategy, parts, self.weight_derived)
        return inputs, simulate(inputs), parts


def step_time_search(cfg: Any, costs: Any, mrf: MRF, first: SolverResult,
                     solve: Callable[[MRF], SolverResult], weight_derived: list[bool],
                     ) -> SearchOutcome:
    """The search and bound of the module docstring, from the additive solve ``first``
    of ``mrf`` (with the rows the plan was solved under); ``solve`` is the configured
    solver (with its presolve)."""
    from pipeline.solvers.registry import get_solver

    start = time.perf_counter()
    topology = costs.topology
    cm = costs.cost_model()
    groups = group_structure(topology)
    mesh_names = [str(m) for m in cfg.mesh_names]
    evaluate = _Evaluator(topology, cm, groups, weight_derived, mesh_names)
    limit = costs.memory.limit if costs.memory is not None else None

    def candidate(source: str, res: SolverResult) -> tuple[Candidate, StepInputs, StepTime]:
        labels = np.asarray(res.labels, dtype=np.int64)
        inputs, sim, _ = evaluate(labels)
        fits = True
        if limit is not None and source != "additive":
            fits = bool(costs.memory.walk(labels[groups.group_of]).peak_bytes <= limit)
        return Candidate(source, labels, float(mrf.evaluate(labels)), float(sim.step_time_us),
                         fits, res), inputs, sim

    cand, inputs, sim = candidate("additive", first)
    cands = [cand]
    shares = [exposed_shares(inputs, sim)]  # per candidate: its plan's exposed shares
    seen = {cand.labels.tobytes(): 0}
    stop, current = "rounds", 0
    weights = np.ones(len(cm.edges))
    surrogate = Surrogate(mrf, cm, groups)
    solves = 0
    for it in range(1, int(cfg.solver.step_time_rounds) + 1):
        step = DAMPING * (shares[current] - weights)
        weights = weights + step
        try:
            res = solve(surrogate.mrf(weights))
        except (FractionalRelaxationError, PlanError) as err:
            # lp: a re-weighted relaxation may be fractional (the additive one was
            # integral); an exact solve may stop without a plan: the search ends, recorded
            stop = f"re-solve {it} gave no plan: {str(err).splitlines()[0]}"
            log.warning("step-time search: %s", stop)
            break
        solves += 1
        key = np.asarray(res.labels, dtype=np.int64).tobytes()
        if key in seen:
            again = seen[key]
            if again == current and float(np.abs(step).max(initial=0.0)) <= WEIGHT_TOL:
                stop = "fixed point"
                break
            current = again  # its shares again, the weights damped on
            continue
        cand, inputs, sim = candidate(f"step-time round {it}", res)
        seen[key] = current = len(cands)
        cands.append(cand)
        shares.append(exposed_shares(inputs, sim))
    search_seconds = time.perf_counter() - start

    fitting = [k for k, c in enumerate(cands) if c.fits]
    chosen = min(fitting, key=lambda k: (cands[k].step_time_us, k))
    best = cands[chosen]
    result = dataclasses.replace(first, labels=best.labels, objective=best.additive_us)

    start = time.perf_counter()
    approx = get_solver("approx")
    options = approx.options(cfg.solver)
    num_dims = len(cm.mesh_shape)

    def measure(labels: np.ndarray) -> tuple[float, float]:
        parts = plan_breakdown(cm, labels[groups.group_of], mesh_names)
        compute = math.fsum(parts.compute_us) + math.fsum(parts.fusion_us)
        comm = math.fsum(float(r["comm_us"]) for r in parts.redistributions
                         if math.isfinite(float(r["comm_us"])))
        return compute, comm

    streams = StreamObjective(mrf, cm, groups)
    bound = step_lower_bound(streams.mrf, measure, lambda m: approx.solve(m, options),
                             num_dims, steps=BOUND_STEPS)
    record = {
        "objective": "step_time",
        "stop": stop,
        "solves": solves,
        "chosen": best.source,
        "candidates": [{"source": c.source, "additive_us": c.additive_us,
                        "step_time_us": c.step_time_us, "fits": c.fits} for c in cands],
        "search_seconds": search_seconds,
        "bound": {"method": "max over theta of TRW-S's bound of theta * C + (1 - theta) * "
                            "M / D (pipeline/solvers/step_bound.py)",
                  "theta": bound.theta, "streams": num_dims, "history": bound.history,
                  "seconds": time.perf_counter() - start},
    }
    return SearchOutcome(result, record, bound.lower_bound_us, cands[0].additive_us)


def step_time_fields(step_time_us: float, outcome: SearchOutcome | None) -> dict[str, Any]:
    """``step_time_lower_bound_us``, ``step_time_gap`` and ``step_time_certified`` of
    the run record (None bound: ``solver.objective=additive``, no bound computed)."""
    if outcome is None:
        return {}
    lb = float(outcome.lower_bound_us)
    gap = relative_gap(step_time_us, lb)
    return {"step_time_lower_bound_us": lb, "step_time_gap": gap,
            "step_time_certified": bool(gap <= STEP_TIME_RTOL)}
