"""Stage 3 - costs: the placement MRF, complete: unary and pairwise factors and the
constraint rows.

Objective (the same words as pipeline/solvers/mrf.py)::

    E(x) = sum_v U_v(x_v) + sum_e B_e(x_u, x_v)

``U_v`` is node v's compute cost per strategy (and the collectives inside its op),
``B_e`` edge e's redistribution cost per pair of placement classes, plus the transition
cost and the pointwise-fusion term: the cost model, pipeline/costmodel/model.py, states
each part. The topology's groups fold them into the group MRF the solvers see
(pipeline/costmodel/factors.py: group unaries, group factors over joint classes, the
same values eager and lazy).

The MRF also carries the parameter-memory budget row
(``constraints.param_memory``, pipeline/memory/budget.py) and, with
``constraints.device_memory``, the device-memory row (bytes per device of parameters,
gradients, optimizer state, buffers and saved activations: pipeline/memory/), both
built here with the unaries. Activation checkpointing
(``memory.activation_checkpointing``) makes the recomputed forward ops and edges of
each repeated layer count twice.

Eager: every factor is computed here, one table per graph edge, and the complete
MRF (with its rows) is written to ``factors.npz`` (pipeline/stages/costs/factors_file.py);
``costs.json`` holds the counts and the budget's facts. Lazy: only the resolved cost
model (``costs.json``) is written; the solve stage builds the MRF with :func:`build_mrf`
(:func:`load_costs`), and the solver asks for a group factor on first use.

Phases: ``factor_build`` is the time spent building pairwise group factors
(:attr:`~pipeline.costmodel.factors.FactorProvider.factor_seconds`), in the costs stage
when eager, inside the solver when lazy; ``cost_build`` is the rest of the cost work
(reading the topology, unaries, the budget row, writing or reading ``factors.npz``).
The explanation of a plan (per-node cost parts, redistributions) is
pipeline/costmodel/breakdown.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from pipeline.config.readers import fuse_pointwise_config, param_memory_config, workers_config
from pipeline.core import artifacts, runtime
from pipeline.core.artifacts import COSTS, FACTORS
from pipeline.costmodel.factors import FactorProvider, group_structure
from pipeline.costmodel.fsdp import collective_options_of_config
from pipeline.costmodel.model import TRANSITION_COST, CostModel
from pipeline.memory.budget import ParamBudget, check_budget_feasible, param_budget
from pipeline.memory.constraint import check_feasible, memory_row
from pipeline.memory.model import memory_model
from pipeline.memory.options import device_memory_of_config, options_of_config
from pipeline.solvers.lagrangian import allowed_unaries
from pipeline.solvers.mrf import MRF
from pipeline.stages.costs.factors_file import load_factors, save_factors
from pipeline.stages.topology import TopologyTables, read_topology


@dataclass
class Costs:
    """What the costs stage hands to the solve stage.

    Attributes:
        mrf: the complete MRF: group unaries, pairwise factors and constraint rows
            (the parameter-memory budget).
        budget: the budget's facts for the run record (None without a budget).
        memory: the memory model of the plan (pipeline/memory/; None when not asked
            for), with the device-memory limit.
        collectives: FSDP2's collective semantics the costs follow
            (:class:`pipeline.costmodel.fsdp.CollectiveOptions`; None: none).
        factor_provider: lazy costs: the provider that builds the factors on first
            use (and its cost model); None when the factors were read from
            ``factors.npz``.
        topology, hardware: what the costs were computed from.
        record: ``costs.json`` (empty before the stage has written it).
    """

    mrf: MRF
    budget: ParamBudget | None
    factor_provider: FactorProvider | None
    topology: TopologyTables
    hardware: Any
    record: dict[str, Any] = field(default_factory=dict)
    memory: Any = None
    collectives: Any = None
    fuse_pointwise: bool = False
    model_parallel: str | None = None  # constraints.model_parallel

    def cost_model(self) -> CostModel:
        """The cost model to explain a plan with (pipeline/costmodel/breakdown.py): lazy, the one
        behind the factors (its memoised tables are reused); eager, a new memoising
        one over the same topology and hardware (same values)."""
        if self.factor_provider is not None:
            return self.factor_provider.cost_model
        recompute = self.memory.recompute() if self.memory is not None else None
        return CostModel(self.topology, self.hardware, memoise=True, recompute=recompute,
                         collectives=self.collectives,
                         fuse_pointwise=self.fuse_pointwise,
                         model_parallel=self.model_parallel)

    def factor_counts(self) -> dict[str, int | None]:
        """Unary vectors, edge tables and group factors materialised, and their total:
        lazy, counted in this process so far; eager, as the costs stage recorded."""
        if self.factor_provider is not None:
            stats = self.factor_provider.cost_model.stats
            counts: dict[str, Any] = {"unary_vectors": stats.unary_vectors,
                                      "edge_tables": stats.edge_tables,
                                      "group_factors": stats.group_factors}
        else:
            counts = self.record.get("counts", {})
        out = {k: counts.get(k) for k in ("unary_vectors", "edge_tables", "group_factors")}
        out["total"] = sum(v or 0 for v in out.values())
        return out


def build_mrf(topology: TopologyTables, hw: Any, lazy: bool,
              param_memory: dict[str, Any] | None = None, memory: Any = None,
              device_memory: tuple[int | None, str | None] = (None, None),
              collectives: Any = None,
              fuse_pointwise: bool = False, workers: int = 1,
              model_parallel: str | None = None) -> Costs:
    """The complete group MRF of a topology; lazy leaves pairwise factors to first use.

    ``param_memory``: ``constraints.param_memory`` as plain data (``{low, high}``), or
    None for no budget row. ``memory``: the
    :class:`~pipeline.memory.options.MemoryOptions` of the step (None: no memory model, no
    recomputation); ``device_memory``: ``(bytes, text)`` of
    ``constraints.device_memory`` or ``(None, None)`` for no device-memory row.
    ``collectives``: the :class:`~pipeline.costmodel.fsdp.CollectiveOptions` (FSDP2
    buckets, re-gather, reduce dtype), or None for DTensor's one collective per tensor.
    ``fuse_pointwise``: the pointwise-fusion term (``costs.fuse_pointwise``).
    ``model_parallel``: ``constraints.model_parallel`` (``intra_node``: +inf on activation
    collectives over cross-node mesh dims, pipeline/costmodel/model_parallel.py).
    ``workers``: processes that build the factors of eager costs (pipeline/core/parallel.py).

    Raises:
        PlanError: the pins leave the budget infeasible, or no allowed plan fits the
            device memory (before any factor is built).
    """
    groups = group_structure(topology)
    model = None
    if memory is not None:
        model = memory_model(topology, groups.group_of, groups.domain, memory,
                             device_memory[0], device_memory[1])
    cost_model = CostModel(topology, hw, memoise=lazy,
                           recompute=model.recompute() if model is not None else None,
                           collectives=collectives,
                           fuse_pointwise=fuse_pointwise, model_parallel=model_parallel)
    provider = FactorProvider(cost_model, groups)
    mrf = MRF(domain_sizes=groups.domain.copy(), unary=provider.unaries(),
              edges=groups.edges.copy(), factor=provider.factor,
              share=provider.share if lazy else None)
    budget = None
    if param_memory is not None:
        pins = topology.summary.get("pins", {})
        budget = param_budget(topology, groups.group_of, np.asarray(mrf.domain_sizes),
                              param_memory, set(pins))
        if budget is not None and budget.constraint is not None:
            check_budget_feasible(budget, mrf.unary, pins)
            mrf.linear_constraints = [budget.constraint]
    if model is not None and model.limit is not None:
        coef = model.coef()
        reserve = model.options.reserve_fraction
        check_feasible(coef, allowed_unaries(mrf), model.limit, str(model.limit_text),
                       reserve)
        # the device reserves (1 + f) x the live bytes: the row bounds them by M / (1 + f)
        mrf.linear_constraints = [*mrf.linear_constraints,
                                  memory_row(coef, model.limit / (1.0 + reserve))]
    if not lazy:
        provider.materialise_all(workers)
    return Costs(mrf, budget, provider, topology, hw, memory=model, collectives=collectives,
                 fuse_pointwise=fuse_pointwise, model_parallel=model_parallel)


def memory_config(cfg: Any) -> dict[str, Any]:
    """The step-model keyword arguments of :func:`build_mrf` from a resolved config:
    ``memory`` (optimizer, checkpointing, FSDP resharding), ``device_memory`` and
    ``collectives`` (FSDP2's buckets, re-gather and reduce dtype)."""
    return {"memory": options_of_config(cfg), "device_memory": device_memory_of_config(cfg),
            "collectives": collective_options_of_config(cfg),
            "model_parallel": cfg.constraints.get("model_parallel")}


def load_costs(cfg: Any, topology: TopologyTables, costs_dir: Path) -> Costs:
    """The costs of a run for the solve stage: eager, the MRF of ``factors.npz`` and the
    budget facts of ``costs.json``; lazy, :func:`build_mrf` (factors on first use)."""
    record = artifacts.read_json(COSTS, costs_dir)
    if bool(cfg.lazy_costs):
        costs = build_mrf(topology, cfg.hardware, lazy=True,
                          param_memory=param_memory_config(cfg), **memory_config(cfg),
                          fuse_pointwise=fuse_pointwise_config(cfg))
    else:
        mrf = load_factors(FACTORS.path(costs_dir))
        budget = None
        if record.get("param_memory") is not None:
            row = next((r for r in mrf.linear_constraints if r.name == "param_memory"), None)
            budget = ParamBudget.from_record(record["param_memory"], row)
        groups = group_structure(topology)
        mem = memory_config(cfg)
        model = memory_model(topology, groups.group_of, groups.domain, mem["memory"],
                             *mem["device_memory"])
        costs = Costs(mrf, budget, None, topology, cfg.hardware, memory=model,
                      collectives=mem["collectives"],
                      fuse_pointwise=fuse_pointwise_config(cfg),
                      model_parallel=mem["model_parallel"])
    costs.record = record
    return costs


def run_costs(cfg: Any, topology_dir: Path, out_dir: Path) -> None:
    """Stage entry point. Eager: build the complete MRF and write ``factors.npz``; both:
    ``costs.json`` last (with the eager counts and the budget's facts)."""
    timer = runtime.PhaseTimer()
    lazy = bool(cfg.lazy_costs)
    hw = cfg.hardware
    extra: dict[str, Any] = {"counts": {}}
    if not lazy:
        start = time.perf_counter()
        costs = build_mrf(read_topology(Path(topology_dir)), hw, lazy=False,
                          param_memory=param_memory_config(cfg), **memory_config(cfg),
                          fuse_pointwise=fuse_pointwise_config(cfg),
                          workers=workers_config(cfg))
        provider = costs.factor_provider
        pairwise = [costs.mrf.factor(e) for e in range(costs.mrf.num_edges)]  # built above
        save_factors(FACTORS.path(out_dir), costs.mrf, pairwise)
        # factor_build: pairwise group factors, as inside the solver with lazy costs
        timer.add("cost_build", time.perf_counter() - start - provider.factor_seconds)
        timer.add("factor_build", provider.factor_seconds)
        stats = provider.cost_model.stats
        extra["counts"] = {"unary_vectors": stats.unary_vectors,
                           "edge_tables": stats.edge_tables,
                           "group_factors": stats.group_factors,
                           "groups": costs.mrf.num_groups, "group_edges": costs.mrf.num_edges}
        if costs.budget is not None:
            extra["param_memory"] = costs.budget.to_record()
    artifacts.write_json(COSTS, out_dir, {
        "stage": "costs", "mode": "lazy" if lazy else "eager",
        "hardware": OmegaConf.to_container(hw, resolve=True),
        "transition_cost": TRANSITION_COST, **extra,
        "phase_seconds": timer.seconds, "peak_rss_bytes": runtime.peak_rss_bytes(),
        "git": runtime.git_revision()})
