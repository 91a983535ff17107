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
   Its plan is simulated and becomes a candidate and the current plan. The re-solves
   are proposals, not certificates (the surrogate is not the step time), so an exact
   configured solver (``ilp``, ``lp``) is not spent on them: on toy 2x4x8 one HiGHS
   solve of a re-weighted MRF took 58-86 s against TRW-S's ~1 s (2026-12-03, this
   project's 2-core EPYC), and a search of 12 such solves ran past CI's 20 minutes.
   The exact solver solves the additive problem (step 1) and each recipe's domain
   (step 4); ``step_time_search.round_solver`` names the re-solves' solver. Each
   re-solve's TRW-S starts from the previous solve's messages in the same domain
   (pipeline/solvers/warm.py: any messages give a valid bound; the planner's domain's
   first round from the additive solve's, which itself starts from zeros).
3. **Stop** at a *fixed point*, when the solver returns the plan the weights came from
   and no weight moved by more than :data:`WEIGHT_TOL`, or after
   ``solver.step_time_rounds`` re-solves (``rounds``), or when a re-solve gives no plan
   (``lp``: a re-weighted relaxation that is fractional; an exact solve stopped without
   one); ``step_time_search.stop`` says which. A plan returned before is not simulated
   again (it becomes the current plan).
4. **Recipes** (a planner run): each applicable recipe's pins, written by the topology
   stage as a restriction of this problem's domains
   (pipeline/stages/topology/recipe_domains.py), restrict the MRF
   (pipeline/solvers/restrict.py: the kept labels only, the same energy); the same
   solver solves it with the same rows, and steps 2-3 run inside the restriction
   (sources ``recipe:<name>``, ``recipe:<name> step-time round k``). A recipe that does
   not apply is skipped; one whose plan breaks the run's constraints (the
   parameter-memory budget, a pin) is discarded and searched again with its parameters'
   groups free (``recipe:<name>/params``); ``step_time_search.recipes`` says which.
5. **Choose** the candidate with the smallest simulated step time (the first of equal
   ones: the planner's own before the recipes'); with a device-memory limit, a
   candidate whose liveness peak exceeds it is not chosen (the additive plan fits). So
   the plan returned is never slower than the additive plan, nor than any recipe's plan
   that satisfies the run's constraints, by the simulation.

Convergence: the weights stay in ``[0, 1]`` and, with the plan fixed, approach its
exposed shares geometrically (half the distance per round), so a plan the solver keeps
returning is a fixed point within ``log2(1 / WEIGHT_TOL) = 10`` rounds; a sequence that
keeps changing plans is cut at ``step_time_rounds``. No monotonicity of the simulated
step along the sequence is claimed, which is why every plan is a candidate and the best
is kept. Not candidates (yet): local-search moves scored by the simulation.

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
from pipeline.solvers.errors import FractionalRelaxationError, NoFeasibleLabelingError
from pipeline.solvers.lagrangian import allowed_unaries
from pipeline.solvers.mrf import MRF, row_holds, row_value
from pipeline.solvers.restrict import Restriction, restrict
from pipeline.solvers.result import SolverResult, relative_gap
from pipeline.solvers.step_bound import step_lower_bound
from pipeline.solvers.warm import WarmStart

log = logging.getLogger(__name__)

__all__ = ["STEP_TIME_RTOL", "RoundSolve", "SearchOutcome", "step_time_fields",
           "step_time_search"]

#: The re-weighting rounds' solver: ``resolve(mrf, warm)``, with ``warm`` the
#: :class:`~pipeline.solvers.warm.WarmStart` of the domain's rounds (TRW-S starts each
#: re-solve from the previous one's messages; a solver without messages ignores it).
RoundSolve = Callable[[MRF, WarmStart], SolverResult]

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


class _Search:
    """The candidates of one run's search (every searched domain's), each plan simulated
    once, and the re-weighting rounds of one domain (module docstring, steps 2-3)."""

    def __init__(self, cfg: Any, costs: Any, mrf: MRF, solve: Callable[[MRF], SolverResult],
                 weight_derived: list[bool], resolve: RoundSolve):
        self.cfg, self.costs, self.mrf, self.solve = cfg, costs, mrf, solve
        self.resolve = resolve  # the re-weighted re-solves' solver (step 2)
        self.cm = costs.cost_model()
        self.groups = group_structure(costs.topology)
        self.evaluate = _Evaluator(costs.topology, self.cm, self.groups, weight_derived,
                                   [str(m) for m in cfg.mesh_names])
        self.limit = costs.memory.limit if costs.memory is not None else None
        self.surrogate = Surrogate(mrf, self.cm, self.groups)
        self.cands: list[Candidate] = []
        self.shares: list[np.ndarray] = []  # per candidate: its plan's exposed shares
        self.seen: dict[bytes, int] = {}
        self.solves = 0

    def add(self, source: str, res: SolverResult) -> int:
        """The index of ``res``'s plan among the candidates, simulated on first sight."""
        labels = np.asarray(res.labels, dtype=np.int64)
        key = labels.tobytes()
        if key in self.seen:
            return self.seen[key]
        inputs, sim, _ = self.evaluate(labels)
        fits = True
        if self.limit is not None and source != "additive":
            fits = bool(self.costs.memory.walk(labels[self.groups.group_of]).peak_bytes
                        <= self.limit)
        self.cands.append(Candidate(source, labels, float(self.mrf.evaluate(labels)),
                                    float(sim.step_time_us), fits, res))
        self.shares.append(exposed_shares(inputs, sim))
        self.seen[key] = len(self.cands) - 1
        return self.seen[key]

    def rounds(self, current: int, prefix: str, domain: Restriction | None = None,
               visited: list[int] | None = None, seed: WarmStart | None = None) -> str:
        """Re-weight and re-solve from candidate ``current`` (``domain``: within that
        restriction of the MRF); returns the stop reason. ``visited`` gains the index of
        every plan a re-solve returns. The re-solves share one
        :class:`~pipeline.solvers.warm.WarmStart` (one domain: one layout), ``seed`` when
        given (the messages the domain's additive solve left), so each TRW-S re-solve
        starts from the previous solve's messages."""
        visited = [] if visited is None else visited
        weights = np.ones(len(self.cm.edges))
        warm = WarmStart() if seed is None else seed
        warm.load_enabled = True
        for it in range(1, int(self.cfg.solver.step_time_rounds) + 1):
            step = DAMPING * (self.shares[current] - weights)
            weights = weights + step
            m = self.surrogate.mrf(weights)
            self.release_caches()
            try:
                if domain is None:
                    res = self.resolve(m, warm)
                else:
                    res = self.resolve(restrict(m, _as_keep(domain)).mrf, warm)
                    res = dataclasses.replace(res, labels=domain.expand(res.labels))
            except (FractionalRelaxationError, NoFeasibleLabelingError, PlanError) as err:
                # lp: a re-weighted relaxation may be fractional (the additive one was
                # integral); an exact solve may stop without a plan: the search ends, recorded
                stop = f"re-solve {it} gave no plan: {str(err).splitlines()[0]}"
                log.warning("step-time search%s: %s", f" ({prefix})" if prefix else "", stop)
                return stop
            self.solves += 1
            key = np.asarray(res.labels, dtype=np.int64).tobytes()
            if key in self.seen:
                again = self.seen[key]
                visited.append(again)
                if again == current and float(np.abs(step).max(initial=0.0)) <= WEIGHT_TOL:
                    return "fixed point"
                current = again  # its shares again, the weights damped on
                continue
            current = self.add(f"{prefix}step-time round {it}", res)
            visited.append(current)
        return "rounds"

    def release_caches(self) -> None:
        """The first surrogate has computed its redistribution tables with the
        planner's caches the factor build left (``FactorProvider.hold_caches``, set by
        the solve stage); later rounds re-weight the same edges: drop the caches."""
        if self.costs.factor_provider is not None:
            self.costs.factor_provider.release_caches()

    def recipe(self, name: str, entry: dict[str, Any]) -> dict[str, Any]:
        """The candidates of recipe ``name`` (its domain ``entry`` from the topology,
        pipeline/stages/topology/recipe_domains.py): the configured solver on the additive
        objective within the recipe's labels, then its step-time rounds; returns its
        record entry (``skipped`` / ``discarded`` with the reason, else its candidates).
        When the recipe's parameter placements break the run's constraints (the default
        parameter-memory budget shards every parameter as far as it goes; a recipe
        replicates some), the recipe is searched again with its parameters' groups free
        (``recipe:<name>/params``: the recipe's activations, the parameters placed within
        the budget and gathered where the recipe needs them)."""
        if "skipped" in entry:
            return {"skipped": entry["skipped"]}
        reason = _intra_node_reason(self.cfg, name)
        if reason is not None:
            return {"skipped": reason}
        keep = {int(g): np.asarray(ks, dtype=np.int64) for g, ks in entry["labels"].items()}
        out: dict[str, Any] = {"inputs_moved": bool(entry.get("inputs_moved", False))}
        why, visited = self._domain(f"recipe:{name}", keep)
        if why is None:
            return {**out, **self._best(visited)}
        out["discarded"] = why
        nodes = self.costs.topology.nodes
        params = {int(self.groups.group_of[i]) for i, (r, t) in
                  enumerate(zip(nodes["role"], nodes["target"]))
                  if r == "param" and t == "placeholder"}
        relaxed = {g: ks for g, ks in keep.items() if g not in params}
        why, visited = self._domain(f"recipe:{name}/params", relaxed)
        if why is not None:
            return {**out, "params_free": {"discarded": why}}
        return {**out, "params_free": self._best(visited)}

    def _best(self, visited: list[int]) -> dict[str, Any]:
        """The best plan the search of a domain returned (``best``: its candidate's source,
        which may be an earlier domain's when the plans coincide)."""
        best = min(visited, key=lambda k: (self.cands[k].step_time_us, k))
        return {"best": self.cands[best].source, "step_time_us": self.cands[best].step_time_us}

    def _domain(self, prefix: str, keep: dict[int, np.ndarray]) -> tuple[str | None, list[int]]:
        """Search the MRF restricted to ``keep`` (its additive solve, then its rounds):
        ``(None, the candidates it returned)``, or ``(why it gave none, [])``."""
        allowed = allowed_unaries(self.mrf)  # the run's pins and exactly tight rows
        for g, ks in sorted(keep.items()):
            if not np.isfinite(allowed[g][ks]).any():
                node = self.costs.topology.nodes["name"][self.groups.members[g][0]]
                return (f"the recipe's plan violates the run's constraints at node {node} "
                        "(the parameter-memory budget or a pin)"), []
        domain = restrict(self.mrf, keep)
        try:
            res = self.solve(domain.mrf)
        except (FractionalRelaxationError, NoFeasibleLabelingError, PlanError) as err:
            return ("no plan within the recipe's pins and the run's constraints: "
                    f"{str(err).splitlines()[0]}"), []
        labels = domain.expand(res.labels)
        broken = [r.name for r in self.mrf.linear_constraints
                  if not row_holds(r, row_value(r, labels))]
        if broken:
            return f"the recipe's plan violates {', '.join(broken)}", []
        if not math.isfinite(float(self.mrf.evaluate(labels))):
            return "the recipe's plan has an infinite cost (a forbidden pair)", []
        visited = [self.add(prefix, dataclasses.replace(res, labels=labels))]
        self.rounds(visited[0], prefix + " ", domain, visited)
        return None, visited


def _as_keep(domain: Restriction) -> dict[int, np.ndarray]:
    return {g: k for g, k in enumerate(domain.keep)}


def _intra_node_reason(cfg: Any, name: str) -> str | None:
    """Why recipe ``name`` has no plan under ``constraints.model_parallel=intra_node``
    (its ``tp`` or ``cp`` on a mesh dim that spans nodes), or None."""
    if str(cfg.constraints.get("model_parallel") or "") != "intra_node":
        return None
    from pipeline.core.recipes import recipe_dim_roles
    from pipeline.costmodel.model_parallel import cross_node_dims

    names = [str(n) for n in cfg.mesh_names]
    crossing = cross_node_dims(tuple(int(m) for m in cfg.mesh), int(cfg.hardware.gpus_per_node))
    for d, role in enumerate(recipe_dim_roles(name, names)):
        if role in ("tp", "cp") and d in crossing:
            return (f"recipe={name}: constraints.model_parallel=intra_node and its {role} "
                    f"dim {names[d]} spans nodes")
    return None


def step_time_search(cfg: Any, costs: Any, mrf: MRF, first: SolverResult,
                     solve: Callable[[MRF], SolverResult], weight_derived: list[bool],
                     resolve: RoundSolve | None = None,
                     round_solver: str | None = None,
                     seed: WarmStart | None = None) -> SearchOutcome:
    """The search and bound of the module docstring, from the additive solve ``first``
    of ``mrf`` (with the rows the plan was solved under); ``solve`` is the configured
    solver (with its presolve), ``resolve`` the re-weighting rounds' (:data:`RoundSolve`;
    ``None``: ``solve``, cold), named ``round_solver`` in the record (``None``:
    ``solver.name``). ``seed``: the :class:`~pipeline.solvers.warm.WarmStart` the additive
    solve left its TRW-S messages in (the first round starts from them), else None."""
    from pipeline.solvers.registry import get_solver

    start = time.perf_counter()
    search = _Search(cfg, costs, mrf, solve, weight_derived,
                     (lambda m, _warm: solve(m)) if resolve is None else resolve)
    search.add("additive", first)
    stop = search.rounds(0, "", seed=seed)
    recipes = {str(name): search.recipe(str(name), entry) for name, entry in
               sorted((costs.topology.summary.get("recipe_domains") or {}).items())}
    search.release_caches()  # no round built a surrogate (else a no-op)
    search_seconds = time.perf_counter() - start
    cands, solves, cm, groups = search.cands, search.solves, search.cm, search.groups
    mesh_names = [str(m) for m in cfg.mesh_names]

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
        "round_solver": str(cfg.solver.name) if round_solver is None else round_solver,
        "chosen": best.source,
        "recipes": recipes,
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
