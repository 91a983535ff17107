"""Stage 4 - solve: choose a strategy per group and write the plan and run record.

Solvers (pipeline/solvers/, all on the complete MRF the costs stage hands over,
:func:`pipeline.stages.costs.stage.load_costs`: factors and the parameter-memory row):

* ``approx``: TRW-S (Kolmogorov 2006) then local-search polish; status
  ``Heuristic`` unless its lower bound certifies the objective (``Optimal``); a
  constraint row goes through Lagrangian relaxation. Never imports PuLP unless
  ``optimality_check=true``.
* ``ilp``: the exact integer program, built in numpy (pipeline/solvers/ilp.py) and
  solved by HiGHS or CBC; ``lp``: its LP relaxation, accepted only when integral.
  With ``solver.prune`` (the default) TRW-S runs first and exact reduced-cost fixing
  (pipeline/solvers/pruning.py) drops labels that are in no plan as cheap as
  TRW-S's; the ``presolve`` field of the record says how many.

The lower bound is for the problem *as posed*: the tied groups, all constraints,
every candidate strategy. Pruning removes only labels no optimal plan uses, so a
bound of the pruned program is one of the full problem.

The per-node cost parts and the redistributions of the plan come from the costs
stage (pipeline/costmodel/breakdown.py); this stage solves and records.

Outputs (in the solve directory): ``solution.parquet`` (one row per node: the
placements table), ``redistributions.parquet`` (one row per edge whose placements
differ: the collectives of the plan), ``plan.json`` (the loadable plan file,
pipeline/plan/format.py) and ``run.json`` (the run record, written last); names and schema
versions in pipeline/core/artifacts.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.config import config_hash, stage_keys
from pipeline.config.readers import workers_config
from pipeline.core import artifacts, progress, runtime
from pipeline.core.artifacts import (  # noqa: F401 - file names, re-exported
    GRAPH,
    PLAN,
    REDISTRIBUTIONS,
    REDISTRIBUTIONS_FILE,
    RUN,
    RUN_FILE,
    SOLUTION,
    SOLUTION_FILE,
)
from pipeline.core.errors import PlanError
from pipeline.core.ir import load_nodes, read_graph
from pipeline.costmodel.breakdown import plan_breakdown
from pipeline.costmodel.factors import PARALLEL_MIN_WORK, group_structure
from pipeline.costmodel.hardware import tables_of
from pipeline.memory.fit import fit_fields, fit_warning
from pipeline.plan.format import build_plan, write_plan
from pipeline.solvers.ilp.fallback import no_plan_message
from pipeline.solvers.lagrangian import allowed_unaries
from pipeline.solvers.warm import WarmStart
from pipeline.stages.costs.stage import Costs, load_costs
from pipeline.stages.topology import TopologyTables, find_logits, read_topology

log = logging.getLogger(__name__)

#: The problem ``lower_bound`` holds for (``lower_bound_problem`` in the run record).
BOUND_PROBLEM = "as posed (tied groups, all constraints, every candidate strategy)"



#: Run-record keys written only when set (``recipe``, ``backend`` for the ILP / LP,
#: ``revision_label`` of a profile run): absent, not null, otherwise.
OPTIONAL_RECORD_KEYS: tuple[str, ...] = ("recipe", "backend", "revision_label")

def placement_hash(names: list[str], outputs: list[str], inputs: list[list[str]]) -> str:
    """SHA-256 over node names with their chosen output and input placements, graph order."""
    h = hashlib.sha256()
    for n, o, i in zip(names, outputs, inputs):
        h.update(f"{n}\t{o}\t{','.join(i)}\n".encode())
    return h.hexdigest()


def redistribution_table(run_id: str, rows: list[dict[str, Any]],
                         node_names: list[str]) -> pa.Table:
    """``redistributions.parquet``: one row per graph edge whose producer's output
    placement differs from the placement the consumer expects.

    Columns: run_id; producer / consumer node ids and names, producer output element
    and consumer argument index; the tensor's global shape and dtype; src and dst
    placements (compact notation); ``collectives``, the DTensor redistribute steps
    that are collectives, in order, each as ``kind(mesh dim name)`` (e.g.
    ``reduce_scatter(dp)``; an empty list is a local slice or a layout change only);
    ``bytes`` each device sends (alpha-beta ``S``, summed over steps, one run);
    ``reduce_dtype``, the dtype its reduce-scatters / all-reduces run in (a parameter
    gradient's ``model.reduce_dtype`` under FSDP2's policy, pipeline/costmodel/fsdp.py;
    null without a reduction); ``times``, the runs per step (2 for a forward edge that
    activation checkpointing recomputes or a weight edge FSDP re-gathers for backward,
    else 1); ``comm_us`` (every run: the same number the solver used; ``inf``
    for an illegal pair).
    """
    def col(k: str) -> list[Any]:
        return [r[k] for r in rows]

    return pa.table({
        "run_id": [run_id] * len(rows),
        "producer": pa.array(col("producer"), pa.int32()),
        "producer_name": [node_names[u] for u in col("producer")],
        "element": pa.array(col("element"), pa.int32()),
        "consumer": pa.array(col("consumer"), pa.int32()),
        "consumer_name": [node_names[v] for v in col("consumer")],
        "arg": pa.array(col("arg"), pa.int32()),
        "shape": pa.array(col("shape"), pa.list_(pa.int64())),
        "dtype": pa.array(col("dtype"), pa.string()),
        "reduce_dtype": pa.array(col("reduce_dtype"), pa.string()),
        "src_placement": pa.array(col("src_placement"), pa.string()),
        "dst_placement": pa.array(col("dst_placement"), pa.string()),
        "collectives": pa.array(col("collectives"), pa.list_(pa.string())),
        "bytes": pa.array(col("bytes"), pa.int64()),
        "times": pa.array(col("times"), pa.int32()),
        "comm_us": pa.array(col("comm_us"), pa.float64()),
    })


def collective_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Count, bytes and µs of the plan's collectives, keyed ``kind(mesh dim)``
    (e.g. ``reduce_scatter(dp)``), summed per step of every redistribution and run
    (``times``: a recomputed edge runs its collectives twice)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        times = int(r.get("times", 1))
        for name, st in zip(r["collectives"], r["collective_steps"]):
            d = out.setdefault(name, {"count": 0, "bytes": 0, "us": 0.0})
            d["count"] += times
            d["bytes"] += times * int(st.bytes)
            d["us"] += times * float(st.us)
    return dict(sorted(out.items()))


@contextlib.contextmanager
def _lazy_factor_progress(mrf: Any, factor_provider: Any) -> Iterator[Any]:
    """Yield ``mrf`` with a ``factor`` that advances a progress bar while the lazy
    factors are built (on a terminal only, pipeline/core/progress.py); the bar closes when
    every group factor exists. Values and call order are unchanged."""
    if factor_provider is None or not progress.enabled():
        yield mrf
        return
    start = factor_provider.num_built
    todo = mrf.num_edges - start
    with progress.bar(total=todo, desc="solve: factors (lazy)", unit="factor") as bar:
        def factor(e: int) -> Any:
            f = factor_provider.factor(e)
            if not bar.disable:  # disabled once closed
                bar.update(factor_provider.num_built - start - bar.n)
                if bar.n >= todo:
                    bar.close()
            return f

        yield dataclasses.replace(mrf, factor=factor)


def _approx(cfg: Any, mrf: Any, *, label_bounds: bool = False, fp: Any = None,
            warm: Any = None) -> Any:
    """TRW-S + local search (registry ``approx``) with the configured options; linear
    rows go through the Lagrangian wrapper (registry ``lagrangian``). ``fp``: the lazy
    factor provider behind ``mrf`` (progress bar), else None; ``warm``: every TRW-S solve's
    :class:`~pipeline.solvers.warm.WarmStart` (pipeline/solvers/warm.py), else None."""
    from pipeline.solvers.registry import get_solver

    approx = get_solver("approx")
    options = approx.options(cfg.solver, label_bounds=label_bounds, warm=warm)

    def inner(m: Any) -> Any:
        with progress.BoundProgress(options.max_iters) as bound_bar:
            return approx.solve(m, dataclasses.replace(options, progress=bound_bar))

    if approx.honours_rows or not mrf.linear_constraints:
        with _lazy_factor_progress(mrf, fp) as m:
            return inner(m)
    lagrangian = get_solver("lagrangian")
    with progress.CallbackBar("solve: Lagrangian", unit="solve", delay=0) as row_bar:
        def row_progress(solves: int, lam: float, value: float, ok: bool) -> None:
            if solves >= 2:  # a multiplier search: the first solve was infeasible
                row_bar.update_to(solves, f"lambda={lam:.3g} row={value:.4g} "
                                          f"{'feasible' if ok else 'infeasible'}")

        with _lazy_factor_progress(mrf, fp) as m:
            return lagrangian.solve(m, lagrangian.options(cfg.solver, inner=inner,
                                                          progress=row_progress))


def _pruned(mrf: Any, result: Any) -> tuple[Any, dict[str, Any] | None]:
    """Exact reduced-cost fixing (pipeline/solvers/pruning.py) against ``result``'s
    plan; the MRF unchanged (and ``None``) when ``result`` has no label bounds or
    no finite plan."""
    from pipeline.solvers.pruning import prune

    if result is None or result.label_bounds is None or not math.isfinite(result.objective):
        return mrf, None
    start = time.perf_counter()
    reduced, stats = prune(mrf, result.label_bounds, float(result.objective))
    return reduced, {
        "method": "reduced-cost fixing from the TRW-S dual (pipeline/solvers/pruning.py)",
        "labels_before": stats.labels_before, "labels_after": stats.labels_after,
        "upper_bound": stats.upper_bound, "tolerance": stats.tolerance,
        "trws_objective": float(result.objective), "trws_bound": float(result.lower_bound),
        "seconds": time.perf_counter() - start}


def _solve(cfg: Any, mrf: Any, out_dir: Path, fp: Any = None, warm: Any = None
           ) -> tuple[Any, dict[str, Any] | None]:
    """Run the configured solver (pipeline/solvers/registry.py); returns ``(result,
    presolve record or None)``.

    approx: TRW-S (side rows by Lagrangian relaxation). ilp/lp: side rows are rows
    of the program; with ``solver.prune`` TRW-S runs first and its dual bounds
    remove labels that are in no optimal plan before the program is built.
    ``fp``: the lazy factor provider (progress bar) or None; ``warm``: as for :func:`_approx`."""
    from pipeline.solvers.registry import get_solver

    s = cfg.solver
    solver = get_solver(str(s.name))
    if not solver.exact:  # approx: no presolve
        return _approx(cfg, mrf, label_bounds=bool(cfg.optimality_check and s.prune), fp=fp,
                       warm=warm), None
    presolve = first = None
    if bool(s.prune):
        from pipeline.solvers.errors import NoFeasibleLabelingError

        start = time.perf_counter()
        try:
            first = _approx(cfg, mrf, label_bounds=True, warm=warm)
        except NoFeasibleLabelingError:
            first = None  # TRW-S found no plan: nothing to prune against
        mrf, presolve = _pruned(mrf, first)
        if presolve is not None:
            presolve["seconds"] = time.perf_counter() - start
    # stopped without a plan (time limit): TRW-S's plan, Heuristic (solvers/ilp/fallback.py)
    result = solver.solve(mrf, solver.options(s, mps_path=out_dir / "model.mps", fallback=first))
    if not math.isfinite(result.objective):
        raise PlanError(no_plan_message(str(s.name), result, s.time_limit_s, bool(s.prune)))
    return result, presolve


def _solve_fitting(cfg: Any, costs: Costs, out_dir: Path, warm: Any) -> tuple[Any, Any, Any]:
    """:func:`_solve`, and with ``constraints.device_memory`` the fit loop of
    pipeline/memory/constraint.py: solve with the device-memory row, walk the plan, add
    a cut for the moment of its peak until the plan fits. Returns ``(result, presolve,
    fit)`` with ``fit`` None without a limit (else ``fit.rows`` are the memory rows of
    the last solve). ``warm``: given to every :func:`_solve`."""
    from pipeline.memory.constraint import fit_plan, is_memory_row

    mrf, provider, model = costs.mrf, costs.factor_provider, costs.memory
    row = next((r for r in mrf.linear_constraints if is_memory_row(r)), None)
    if model is None or model.limit is None or row is None:
        result, presolve = _solve(cfg, mrf, out_dir, provider, warm)
        return result, presolve, None
    others = [r for r in mrf.linear_constraints if not is_memory_row(r)]
    presolves: list[Any] = []

    def solve(rows: list[Any]) -> Any:
        res, pre = _solve(cfg, dataclasses.replace(mrf, linear_constraints=others + rows),
                          out_dir, provider, warm)
        presolves.append(pre)
        return res

    names = costs.topology.nodes["name"]
    allowed = allowed_unaries(dataclasses.replace(mrf, linear_constraints=others))
    fit = fit_plan(solve, model.walk_labels, model.peak_coef, row.coef, float(model.limit),
                   allowed, str(model.limit_text), node_name=names.__getitem__,
                   reserve_fraction=model.options.reserve_fraction)
    fit.rows = others + fit.rows
    return fit.result, presolves[-1], fit


def _upstream_records(dirs: Any, topology: TopologyTables, costs: Costs
                      ) -> list[dict[str, Any]]:
    """The records of the trace, topology and costs stages, each read once: the
    ``pipeline`` metadata of ``graph.parquet`` (its footer only), ``topology.json``
    (read with the topology) and ``costs.json`` (read with the costs)."""
    return [artifacts.table_metadata(GRAPH, dirs.trace), topology.summary, costs.record]


def _upstream_seconds(records: list[dict[str, Any]]) -> dict[str, float]:
    """Phase seconds recorded by the earlier stages (trace, topology, costs)."""
    trace, topology, costs = records
    out: dict[str, float] = {"trace": float(trace.get("seconds", {}).get("trace", 0.0)),
                             "topology": float(topology.get("phase_seconds", {})
                                               .get("topology", 0.0))}
    for k, v in costs.get("phase_seconds", {}).items():
        out[k] = out.get(k, 0.0) + float(v)
    return out


def _model_info(dirs: Any) -> dict[str, Any]:
    """The model facts the trace stage recorded (graph metadata; see
    pipeline.stages.trace.stage), with
    the tied parameter names; ``{}`` for a graph traced before they were recorded."""
    meta = artifacts.table_metadata(GRAPH, dirs.trace)
    info = dict(meta.get("model_info") or {})
    if info:
        info["tied_parameters"] = sorted(meta.get("tied_parameters") or {})
    return info


def plan_of_run(cfg: Any, dirs: Any, record: dict[str, Any], solution: Any,
                fallback: Sequence[bool] | None = None) -> dict[str, Any]:
    """The plan document (:func:`pipeline.plan.format.build_plan`) of a resolved config,
    its stage directories, its run record and ``solution.parquet`` as a table."""
    from omegaconf import OmegaConf

    table, _ = read_graph(Path(dirs.trace))
    nodes = load_nodes(table)
    return build_plan(graph_table=table, nodes=nodes, solution=solution,
                      record=record, mesh_shape=list(cfg.mesh),
                      mesh_names=list(cfg.mesh_names),
                      config_hash=config_hash(stage_keys(cfg, "solve")),
                      logits=find_logits(nodes), fallback=fallback,
                      model_config=OmegaConf.to_container(cfg.model, resolve=True))


def run_solve(cfg: Any, dirs: Any) -> None:
    """Stage entry point: solve, then write ``solution.parquet``,
    ``redistributions.parquet`` and ``run.json`` (last)."""
    from omegaconf import OmegaConf

    timer = runtime.PhaseTimer()
    out_dir = Path(dirs.solve)
    with timer.phase("cost_build"):
        topology = read_topology(Path(dirs.topology))
        costs = load_costs(cfg, topology, Path(dirs.costs))
    mrf, provider = costs.mrf, costs.factor_provider
    built_before = provider.factor_seconds if provider is not None else 0.0
    start = time.perf_counter()
    if provider is not None:  # lazy costs: every factor is needed; build them in parallel
        provider.hold_caches = str(cfg.solver.objective) == "step_time"  # objective.py
        provider.build_parallel(workers_config(cfg), PARALLEL_MIN_WORK)
    seed = WarmStart(load=False)  # the additive solve's messages, for the rounds (cold)
    result, presolve, fit = _solve_fitting(cfg, costs, out_dir, seed)
    if fit is not None:
        mrf = costs.mrf = dataclasses.replace(mrf, linear_constraints=fit.rows)
    outcome = None
    if str(cfg.solver.objective) == "step_time":  # pipeline/stages/solve/objective.py
        from pipeline.solvers.registry import get_solver
        from pipeline.stages.solve.objective import step_time_search

        exact = get_solver(str(cfg.solver.name)).exact  # re-solves by TRW-S (objective.py)
        outcome = step_time_search(cfg, costs, mrf, result,
                                   lambda m: _solve(cfg, m, out_dir)[0],
                                   _weight_derived(costs, topology),
                                   resolve=lambda m, warm: _approx(cfg, m, warm=warm),
                                   round_solver="approx" if exact else None, seed=seed)
        result = outcome.result
        timer.add("step_time_bound", outcome.record["bound"]["seconds"])
    solve_wall = time.perf_counter() - start - (
        outcome.record["bound"]["seconds"] if outcome is not None else 0.0)
    # lazy costs: the factors built inside the solver are factor_build, not solve
    lazy_factor = (provider.factor_seconds - built_before) if provider is not None else 0.0
    timer.add("factor_build", lazy_factor)
    timer.add("solve", solve_wall - lazy_factor)

    lp_bound = None
    if bool(cfg.optimality_check) and math.isfinite(result.objective):
        from pipeline.solvers.ilp import lp_lower_bound

        with timer.phase("optimality_check"):
            lp_mrf = mrf
            if cfg.solver.name == "approx" and bool(cfg.solver.prune):
                lp_mrf, presolve = _pruned(mrf, result)
            lp_bound = lp_lower_bound(lp_mrf, backend=str(cfg.solver.backend)).lower_bound

    upstream = _upstream_records(dirs, topology, costs)
    with timer.phase("report"):
        record, table, redist = _record(cfg, dirs, topology, costs, result, lp_bound, timer,
                                        _upstream_seconds(upstream), fit, outcome)
        if presolve is not None:  # absent, not null: runs.parquet then has no null column
            record["presolve"] = presolve
        plan = plan_of_run(cfg, dirs, record, table, topology.nodes["fallback"])
    record["phases"]["report"] = timer.seconds["report"]
    artifacts.write_table(REDISTRIBUTIONS, out_dir, redist, metadata={"run_id": record["run_id"]})
    artifacts.write_table(SOLUTION, out_dir, table,
                          metadata={"run_id": record["run_id"],
                                    "placement_hash": record["placement_hash"]})
    record["peak_rss_bytes"] = runtime.peak_rss_bytes()
    # each earlier stage may have run in its own process (Snakemake)
    record["peak_rss_bytes"]["stages_max"] = max(
        [record["peak_rss_bytes"]["max"]]
        + [int(r.get("peak_rss_bytes", {}).get("max", 0)) for r in upstream])
    record["config"] = OmegaConf.to_container(cfg, resolve=True)
    record.update(fit_fields(record.get("memory"), int(cfg.hardware.device_memory_bytes)))
    write_plan(PLAN.path(out_dir), plan)
    artifacts.write_json(RUN, out_dir, record)
    log.info("solve: %s objective %.3f µs bound %.3f gap %.3g status %s", cfg.solver.name,
             record["objective"], record["lower_bound"], record["gap"], record["status"])
    warning = fit_warning(record.get("memory"), int(cfg.hardware.device_memory_bytes),
                          str(cfg.hardware.name),
                          cfg.constraints.get("device_memory") is not None)
    if warning:
        log.warning("solve: %s", warning)


def _weight_derived(costs: Costs, topology: TopologyTables) -> list[bool]:
    """Per node, a forward op computed from parameters only
    (:attr:`pipeline.memory.graph.StepGraph.weight_derived`)."""
    if costs.memory is not None:
        return list(costs.memory.graph.weight_derived)
    from pipeline.memory.graph import step_graph

    return list(step_graph(topology).weight_derived)


def _step_time(cfg: Any, topology: TopologyTables, costs: Costs, cost_model: Any,
               strategy: np.ndarray, parts: Any) -> dict[str, Any]:
    """The overlap-aware step time of the plan (pipeline/costmodel/steptime.py), as run-record
    fields: ``step_time`` (the whole entry) and its ``step_time_us``,
    ``exposed_comm_us`` and ``tokens_per_s_per_device`` at the top level."""
    from pipeline.costmodel.steptime import (
        global_tokens,
        plan_step_inputs,
        simulate,
        step_time_record,
    )

    inputs = plan_step_inputs(topology, cost_model, strategy, parts,
                              _weight_derived(costs, topology))
    entry = step_time_record(simulate(inputs), [str(m) for m in cfg.mesh_names],
                             global_tokens(cfg.model), math.prod(int(m) for m in cfg.mesh),
                             overlap=inputs.overlap)
    return {"step_time_us": entry["step_time_us"], "exposed_comm_us": entry["exposed_comm_us"],
            "tokens_per_s_per_device": entry["tokens_per_s_per_device"], "step_time": entry,
            "_inputs": inputs}


def _record(cfg: Any, dirs: Any, topology: TopologyTables, costs: Costs, result: Any,
            lp_bound: float | None, timer: runtime.PhaseTimer, upstream: dict[str, float],
            fit: Any = None, outcome: Any = None) -> tuple[dict[str, Any], pa.Table, pa.Table]:
    from pipeline.solvers.result import is_certified, relative_gap
    from pipeline.solvers.status import HEURISTIC, OPTIMAL

    mrf, budget = costs.mrf, costs.budget
    groups = group_structure(topology)
    labels = np.asarray(result.labels, dtype=np.int64)
    strategy = labels[groups.group_of]
    cost_model = costs.cost_model()
    parts = plan_breakdown(cost_model, strategy, [str(m) for m in cfg.mesh_names])
    nodes = topology.nodes
    names = nodes["name"]
    outs = [topology.slist_outputs[s][k] for s, k in zip(nodes["slist"], strategy.tolist())]
    ins = [topology.slist_inputs[s][k] for s, k in zip(nodes["slist"], strategy.tolist())]
    phash = placement_hash(names, outs, ins)

    objective = float(result.objective)
    bound, source = float(result.lower_bound), str(result.lower_bound_source)
    if lp_bound is not None and lp_bound > bound:
        bound, source = float(lp_bound), "lp"
    # the additive certificate is the additive solve's (with the step-time objective, its
    # plan is candidate 0 of the search: pipeline/stages/solve/objective.py)
    additive_plan = objective if outcome is None else float(outcome.additive_plan_us)
    certified = bool(is_certified(additive_plan, bound))
    status = str(result.status)
    if cfg.solver.name == "approx":
        status = OPTIMAL if certified else HEURISTIC
    run_id = config_hash({"dir": str(dirs.solve)})
    phases = dict(upstream)
    for k, v in timer.seconds.items():
        phases[k] = phases.get(k, 0.0) + v
    phases["search_total"] = sum(phases.get(k, 0.0) for k in
                                 ("trace", "topology", "cost_build", "factor_build", "solve"))
    import pipeline

    phases["wall"] = time.perf_counter() - pipeline.PROCESS_START
    topo_counts = topology.summary["counts"]
    record: dict[str, Any] = {
        "run_id": run_id,
        "solve_dir": str(dirs.solve),
        "model": str(cfg.model.name),
        # family, architecture, parameter count, layer count, width: from the trace
        "model_info": _model_info(dirs),
        "mesh": "x".join(str(m) for m in cfg.mesh),
        "mesh_names": list(cfg.mesh_names),
        "hardware": str(cfg.hardware.name),
        "cost_mode": "lazy" if cfg.lazy_costs else "eager",
        "solver": str(cfg.solver.name),
        # a hand-written plan pinned by config ``recipe`` (pipeline/stages/topology/pins.py)
        "recipe": cfg.get("recipe"),
        "backend": str(cfg.solver.backend) if cfg.solver.name != "approx" else None,
        "status": status,
        "objective": objective,
        "compute_us": float(parts.compute_us.sum()),
        "comm_us": float(parts.comm_us.sum()),
        "transition_us": float(parts.transition_us.sum()),
        "fusion_us": float(parts.fusion_us.sum()),
        "lower_bound": bound,
        "lower_bound_source": source,
        "lower_bound_problem": BOUND_PROBLEM,
        "gap": relative_gap(additive_plan, bound),
        "certified": certified,
        "placement_hash": phash,
        "iterations": int(result.iterations),
        "collectives": collective_summary(parts.redistributions),
        "counts": {
            "nodes": topo_counts["nodes"], "edges": topo_counts["edges"],
            "groups": mrf.num_groups, "group_edges": mrf.num_edges,
            "strategies": topo_counts["strategies"],
            "group_strategies": int(np.asarray(mrf.domain_sizes).sum()),
            "fallback_nodes": topo_counts.get("fallback_nodes", 0),
            "factors_materialised": costs.factor_counts()},
        "phases": phases,
        "solver_extra": {k: v for k, v in (result.extra or {}).items()
                         if isinstance(v, (int, float, str, bool, type(None)))},
        "bound_history": [float(b) for b in (result.bound_history or [])][-50:],
        "environment": runtime.environment(),
        "git": runtime.git_revision(),
        "revision_label": cfg.get("revision_label"),
        "fallback_ops": topology.summary.get("fallback_ops", {}),
    }
    # optional fields only when they say something (no all-null runs.parquet columns):
    # the recipe of a pinned run, the ILP / LP backend, a profile's revision label
    for key in OPTIONAL_RECORD_KEYS:
        if record.get(key) is None:
            record.pop(key, None)
    if lp_bound is not None:
        record["lp_bound"] = float(lp_bound)
    record.update(_step_time(cfg, topology, costs, cost_model, strategy, parts))
    # the step-time objective (pipeline/stages/solve/objective.py): its bound and gap;
    # ``status`` is Optimal only where the step-time gap closes; the additive
    # certificate (lower_bound, gap, certified, additive_status) is the additive solve's,
    # of its plan's objective ``additive_plan_us``; ``objective`` = ``additive_us`` is the
    # chosen plan's additive objective
    record["additive_us"] = objective
    record["additive_plan_us"] = additive_plan
    record["additive_status"] = status
    if outcome is not None:
        from pipeline.stages.solve.objective import step_time_fields

        record.update(step_time_fields(record["step_time_us"], outcome))
        record["step_time_search"] = outcome.record
        if record["step_time_certified"]:
            record["status"] = OPTIMAL
        elif status == OPTIMAL:
            record["status"] = HEURISTIC
    tables = tables_of(cost_model.hw)
    if tables is not None:  # a measured profile: its header and the lookups this run made
        record["hardware_tables"] = tables.record()
    memory_cols: dict[str, Any] = {}
    inputs = record.pop("_inputs")  # the per-layer profile (pipeline/stages/solve/profile.py)
    if costs.memory is not None:
        from pipeline.memory.record import memory_columns, memory_record

        model = costs.memory
        live = fit.peak if fit is not None else model.walk(strategy)
        record["memory"] = memory_record(model.graph, model.terms, live, strategy, list(names),
                                         model.limit, fit.rounds if fit is not None else None)
        memory_cols = memory_columns(model.terms, live, strategy, len(names))
        cuts = [r.name.split("@", 1)[1] for r in (fit.rows if fit is not None else [])
                if r.name.startswith("device_memory@")]
        if cuts:
            record["lower_bound_problem"] = (
                f"{BOUND_PROBLEM}, with the memory live at {', '.join(cuts)} bounded by the "
                "device-memory limit (the cuts the liveness check added)")
    from pipeline.stages.solve.profile import plan_profile

    record["layer_profile"] = plan_profile(inputs, topology, cost_model, costs.memory,
                                           strategy, record.get("memory"), memory_cols)
    if budget is not None:
        from pipeline.memory.budget import used_memory

        used = used_memory(budget, strategy)
        record["param_memory"] = {
            "low": budget.low, "high": budget.high, "ratio_sum": used["ratio_sum"],
            "bytes_per_device": used["bytes_per_device"], "full_bytes": used["full_bytes"],
            "parameters": len(budget.params), "excluded": budget.excluded,
            "multiplier": float((result.extra or {}).get("multiplier", 0.0)),
            "weighting": "parameter count"}
    table = pa.table({
        "run_id": [run_id] * len(names),
        "node": pa.array(nodes["id"], pa.int32()),
        "name": names,
        "op": nodes["target"],
        "layer": nodes["layer"],
        "role": nodes["role"],
        "phase": nodes["phase"],
        "group": pa.array(nodes["group"], pa.int32()),
        "strategy": pa.array(strategy, pa.int32()),
        "output_placement": outs,
        "input_placements": pa.array(ins, pa.list_(pa.string())),
        "compute_us": parts.compute_us,
        "comm_us": parts.comm_us,
        "transition_us": parts.transition_us,
        "fusion_us": parts.fusion_us,
        **{k: (pa.array(v, pa.string()) if k == "memory_kind" else v)
           for k, v in memory_cols.items()},
    })
    return record, table, redistribution_table(run_id, parts.redistributions, list(names))
