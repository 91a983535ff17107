"""Stage 4 - solve: choose a strategy per group and write the plan and run record.

Solvers (pipeline/solvers/, all on the flat MRF of pipeline/costs.py):

* ``approx``: TRW-S (Kolmogorov 2006) then local-search polish; status
  ``Heuristic`` unless its lower bound certifies the objective (``Optimal``).
  Never imports PuLP unless ``optimality_check=true``.
* ``ilp``: the exact integer program (PuLP/CBC or HiGHS); ``lp``: its LP
  relaxation, accepted only when integral.

The lower bound is for the problem *as posed*: the tied groups, all
constraints, every candidate strategy (no pruning).

Outputs (in the solve directory): ``solution.parquet`` (one row per node: the
placements table), ``redistributions.parquet`` (one row per edge whose placements
differ: the collectives of the plan), ``plan.json`` (the loadable plan file,
pipeline/plan.py) and ``run.json`` (the run record, written last).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline import progress, runtime
from pipeline.costs import (
    COSTS_FILE,
    FACTORS_FILE,
    TRANSITION_COST,
    CostModel,
    build_mrf,
    group_structure,
    load_factors,
)
from pipeline.topology import TOPOLOGY_FILE, TopologyTables, read_topology

log = logging.getLogger(__name__)

SOLUTION_FILE = "solution.parquet"
REDISTRIBUTIONS_FILE = "redistributions.parquet"
RUN_FILE = "run.json"
BOUND_PROBLEM = "as posed (tied groups, all constraints, no candidate pruning)"


def placement_hash(names: list[str], outputs: list[str], inputs: list[list[str]]) -> str:
    """SHA-256 over node names with their chosen output and input placements, graph order."""
    h = hashlib.sha256()
    for n, o, i in zip(names, outputs, inputs):
        h.update(f"{n}\t{o}\t{','.join(i)}\n".encode())
    return h.hexdigest()


def node_costs(cm: CostModel, strategy: np.ndarray,
               mesh_names: list[str] | None = None) -> dict[str, Any]:
    """Per-node cost parts of a plan (µs): compute, and over incoming edges the
    redistribution (comm) and transition parts; ``inf`` comm for an illegal edge.

    Each edge is costed for its chosen pair with the scalar ``redistribute_steps``
    (bit-identical to the table entries the solver used), once per (edge class,
    source class, destination class) (:meth:`CostModel.edge_classes`: the copies of a
    repeated layer share one costing).
    Also returns ``"redistributions"``: one row per graph edge whose producer and
    consumer placements differ (see :func:`redistribution_table`).
    """
    from pipeline.costmodel.redistribute import KINDS, redistribute_steps
    from pipeline.costs import itemsize
    from pipeline.placements import format_placements

    COLLECTIVES = KINDS[:4]  # noqa: N806 - all_gather, reduce_scatter, all_reduce, all_to_all
    names = mesh_names or [str(i) for i in range(len(cm.mesh_shape))]
    n = cm.num_nodes
    strat = strategy.tolist()
    compute = np.array([cm.unary(v)[strat[v]] for v in range(n)])
    comm = np.zeros(n)
    trans = np.zeros(n)
    rows: list[dict[str, Any]] = []
    classes = cm.edge_classes().tolist()
    # (edge class, src class, dst class) -> (µs, differ, row fields of a redistribution)
    memo: dict[tuple[int, int, int], tuple[float, bool, dict[str, Any] | None]] = {}
    for (u, element, v, a), ec in zip(cm.edges, classes):
        r, srcs = cm.out_classes(u, element)
        c, dsts = cm.in_classes(v, a)
        i, j = int(r[strat[u]]), int(c[strat[v]])
        hit = memo.get((ec, i, j))
        if hit is None:
            src, dst = srcs[i], dsts[j]
            meta = cm.in_metas[v][a]
            steps = redistribute_steps(meta["shape"], itemsize(meta["dtype"]), src, dst,
                                       cm.mesh_shape, cm.hw)
            us = math.inf if steps is None else 0.0
            for st in steps or ():
                us += st.us
            fields = None
            if src != dst:
                coll = [st for st in steps or () if st.kind in COLLECTIVES]
                fields = {
                    "shape": [int(x) for x in meta["shape"]], "dtype": str(meta["dtype"]),
                    "src_placement": format_placements(src),
                    "dst_placement": format_placements(dst),
                    "collectives": [f"{st.kind}({names[st.mesh_dim]})" for st in coll],
                    "_collective_steps": coll,
                    "bytes": 0 if steps is None else int(sum(st.bytes for st in steps)),
                    "comm_us": us}
            hit = memo[(ec, i, j)] = (us, src != dst, fields)
        us, differ, fields = hit
        comm[v] += us
        if differ:
            trans[v] += TRANSITION_COST
            rows.append({"producer": int(u), "element": int(element), "consumer": int(v),
                         "arg": int(a), **fields})
    return {"compute_us": compute, "comm_us": comm, "transition_us": trans,
            "redistributions": rows}


def redistribution_table(run_id: str, rows: list[dict[str, Any]],
                         node_names: list[str]) -> pa.Table:
    """``redistributions.parquet``: one row per graph edge whose producer's output
    placement differs from the placement the consumer expects.

    Columns: run_id; producer / consumer node ids and names, producer output element
    and consumer argument index; the tensor's global shape and dtype; src and dst
    placements (compact notation); ``collectives``, the DTensor redistribute steps
    that are collectives, in order, each as ``kind(mesh dim name)`` (e.g.
    ``reduce_scatter(dp)``; an empty list is a local slice or a layout change only);
    ``bytes`` each device sends (alpha-beta ``S``, summed over steps); ``comm_us``
    (the same number the solver used; ``inf`` for an illegal pair).
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
        "src_placement": pa.array(col("src_placement"), pa.string()),
        "dst_placement": pa.array(col("dst_placement"), pa.string()),
        "collectives": pa.array(col("collectives"), pa.list_(pa.string())),
        "bytes": pa.array(col("bytes"), pa.int64()),
        "comm_us": pa.array(col("comm_us"), pa.float64()),
    })


def collective_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Count, bytes and µs of the plan's collectives, keyed ``kind(mesh dim)``
    (e.g. ``reduce_scatter(dp)``), summed per step of every redistribution."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        for name, st in zip(r["collectives"], r["_collective_steps"]):
            d = out.setdefault(name, {"count": 0, "bytes": 0, "us": 0.0})
            d["count"] += 1
            d["bytes"] += int(st.bytes)
            d["us"] += float(st.us)
    return dict(sorted(out.items()))


@contextlib.contextmanager
def _lazy_factor_progress(mrf: Any, fp: Any) -> Iterator[Any]:
    """Yield ``mrf`` with a ``factor`` that advances a progress bar while the lazy
    factors are built (on a terminal only, pipeline/progress.py); the bar closes when
    every group factor exists. Values and call order are unchanged."""
    if fp is None or not progress.enabled():
        yield mrf
        return
    stats = fp.cm.stats
    start = stats.group_factors
    todo = mrf.num_edges - start
    with progress.bar(total=todo, desc="solve: factors (lazy)", unit="factor") as bar:
        def factor(e: int) -> Any:
            f = fp.factor(e)
            if not bar.disable:  # disabled once closed
                bar.update(stats.group_factors - start - bar.n)
                if bar.n >= todo:
                    bar.close()
            return f

        yield dataclasses.replace(mrf, factor=factor)


def _trws(cfg: Any, mrf: Any, *, label_bounds: bool = False, fp: Any = None) -> Any:
    """TRW-S with the configured options; a parameter-memory row goes through
    Lagrangian relaxation (pipeline/solvers/lagrangian.py). ``fp``: the lazy factor
    provider behind ``mrf`` (for its progress bar), else None."""
    from pipeline.solvers.trws import solve_trws

    s = cfg.solver

    def trws(m: Any) -> Any:
        with progress.BoundProgress(int(s.max_iters)) as bound_bar:
            return solve_trws(m, max_iters=int(s.max_iters), tol=float(s.tol),
                              local_search_rounds=int(s.local_search_rounds),
                              time_limit_s=s.time_limit_s, progress=bound_bar,
                              label_bounds=label_bounds)

    if mrf.linear_constraints:
        from pipeline.solvers.lagrangian import solve_with_row

        (row,) = mrf.linear_constraints
        with progress.CallbackBar("solve: Lagrangian", unit="solve", delay=0) as row_bar:
            def row_progress(solves: int, lam: float, value: float, ok: bool) -> None:
                if solves >= 2:  # a multiplier search: the first solve was infeasible
                    row_bar.update_to(solves, f"lambda={lam:.3g} row={value:.4g} "
                                              f"{'feasible' if ok else 'infeasible'}")

            with _lazy_factor_progress(mrf, fp) as m:
                return solve_with_row(m, row, trws, progress=row_progress)
    with _lazy_factor_progress(mrf, fp) as m:
        return trws(m)


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


def _solve(cfg: Any, mrf: Any, out_dir: Path, fp: Any = None
           ) -> tuple[Any, dict[str, Any] | None]:
    """Run the configured solver; returns ``(result, presolve record or None)``.

    approx: TRW-S (side rows by Lagrangian relaxation). ilp/lp: side rows are rows
    of the program; with ``solver.prune`` TRW-S runs first and its dual bounds
    remove labels that are in no optimal plan before the program is built.
    ``fp``: the lazy factor provider behind ``mrf`` (progress bar), else None.
    """
    s = cfg.solver
    if s.name == "approx":
        return _trws(cfg, mrf, label_bounds=bool(cfg.optimality_check and s.prune), fp=fp), None
    from pipeline.solvers.ilp import solve_ilp

    presolve = None
    if bool(s.prune):
        from pipeline.solvers.errors import NoFeasibleLabelingError

        start = time.perf_counter()
        try:
            first = _trws(cfg, mrf, label_bounds=True)
        except NoFeasibleLabelingError:
            first = None  # TRW-S found no plan: nothing to prune against
        mrf, presolve = _pruned(mrf, first)
        if presolve is not None:
            presolve["seconds"] = time.perf_counter() - start
    result = solve_ilp(mrf, backend=str(s.backend), relax=s.name == "lp",
                       time_limit_s=s.time_limit_s, mip_gap=float(s.mip_gap),
                       threads=int(s.threads), mps_path=out_dir / "model.mps")
    return result, presolve


def _stage_seconds(dirs: Any) -> dict[str, float]:
    """Phase seconds recorded by the earlier stages' artifacts."""
    from pipeline.trace import read_graph

    out: dict[str, float] = {}
    _, meta = read_graph(dirs.trace)
    out["trace"] = float(meta.get("seconds", {}).get("trace", 0.0))
    topo = json.loads((Path(dirs.topology) / TOPOLOGY_FILE).read_text())
    out["topology"] = float(topo.get("phase_seconds", {}).get("topology", 0.0))
    costs = json.loads((Path(dirs.costs) / COSTS_FILE).read_text())
    for k, v in costs.get("phase_seconds", {}).items():
        out[k] = out.get(k, 0.0) + float(v)
    return out


def _stage_rss(dirs: Any) -> list[int]:
    """Peak RSS recorded by the trace, topology and costs artifacts (bytes): each stage
    may have run in its own process (Snakemake)."""
    from pipeline.trace import read_graph

    out = [int(read_graph(dirs.trace)[1].get("peak_rss_bytes", {}).get("max", 0))]
    for path in (Path(dirs.topology) / TOPOLOGY_FILE, Path(dirs.costs) / COSTS_FILE):
        out.append(int(json.loads(path.read_text()).get("peak_rss_bytes", {}).get("max", 0)))
    return out


def run_solve(cfg: Any, dirs: Any) -> None:
    """Stage entry point: solve, then write ``solution.parquet`` and ``run.json``."""
    from omegaconf import OmegaConf

    timer = runtime.PhaseTimer()
    out_dir = Path(dirs.solve)
    lazy = bool(cfg.lazy_costs)
    with timer.phase("cost_build"):
        tt = read_topology(Path(dirs.topology))
        if lazy:
            mrf, fp = build_mrf(tt, cfg.hardware, lazy=True)
            build_factor_seconds = fp.seconds
        else:
            mrf = load_factors(Path(dirs.costs) / FACTORS_FILE)
            fp = None
            build_factor_seconds = 0.0
    budget = _budget(cfg, tt, mrf)
    start = time.perf_counter()
    result, presolve = _solve(cfg, mrf, out_dir, fp)
    solve_wall = time.perf_counter() - start
    lazy_factor = (fp.seconds - build_factor_seconds) if fp is not None else 0.0
    timer.add("factor_build", lazy_factor)
    timer.add("solve", solve_wall - lazy_factor)

    lp_bound = None
    if bool(cfg.optimality_check) and math.isfinite(result.objective):
        from pipeline.solvers.ilp import lp_lower_bound

        with timer.phase("optimality_check"):
            lp_mrf = mrf
            if cfg.solver.name == "approx" and bool(cfg.solver.prune):
                lp_mrf, presolve = _pruned(mrf, result)
            lp_bound = lp_lower_bound(lp_mrf, backend=str(cfg.solver.backend))

    with timer.phase("report"):
        record, table, redist = _record(cfg, dirs, tt, mrf, result, lp_bound, timer, fp,
                                        budget)
        if presolve is not None:  # absent, not null: runs.parquet then has no null column
            record["presolve"] = presolve
        from pipeline.plan import PLAN_FILE, plan_of_run, write_plan

        plan = plan_of_run(cfg, dirs, record, table, tt.nodes["fallback"])
    record["phases"]["report"] = timer.seconds["report"]
    runtime.write_parquet(out_dir / REDISTRIBUTIONS_FILE, redist,
                          metadata={"run_id": record["run_id"]})
    runtime.write_parquet(out_dir / SOLUTION_FILE, table,
                          metadata={"run_id": record["run_id"],
                                    "placement_hash": record["placement_hash"]})
    record["peak_rss_bytes"] = runtime.peak_rss_bytes()
    record["peak_rss_bytes"]["stages_max"] = max(
        [record["peak_rss_bytes"]["max"]] + _stage_rss(dirs))
    record["config"] = OmegaConf.to_container(cfg, resolve=True)
    write_plan(out_dir / PLAN_FILE, plan)
    runtime.write_json(out_dir / RUN_FILE, record)
    log.info("solve: %s objective %.3f µs bound %.3f gap %.3g status %s", cfg.solver.name,
             record["objective"], record["lower_bound"], record["gap"], record["status"])


def _budget(cfg: Any, tt: TopologyTables, mrf: Any) -> Any:
    """Attach the parameter-memory row to ``mrf`` (pipeline/constraints.py); fail fast
    with a PlanError when the pins make it infeasible."""
    from omegaconf import OmegaConf

    from pipeline.constraints import check_budget_feasible, param_budget

    pm = cfg.constraints.param_memory
    if pm is None:
        return None
    gs_group = np.asarray(tt.nodes["group"], dtype=np.int64)
    pins = tt.summary.get("pins", {})
    budget = param_budget(tt, gs_group, np.asarray(mrf.domain_sizes),
                          OmegaConf.to_container(pm, resolve=True), set(pins))
    if budget is not None and budget.constraint is not None:
        check_budget_feasible(budget, mrf.unary, pins)
        mrf.linear_constraints = [budget.constraint]
    return budget


def _record(cfg: Any, dirs: Any, tt: TopologyTables, mrf: Any, result: Any,
            lp_bound: float | None, timer: runtime.PhaseTimer, fp: Any, budget: Any = None
            ) -> tuple[dict[str, Any], pa.Table, pa.Table]:
    from pipeline.config import config_hash
    from pipeline.solvers.result import is_certified, relative_gap

    gs = group_structure(tt)
    labels = np.asarray(result.labels, dtype=np.int64)
    strategy = labels[gs.group_of]
    cm = fp.cm if fp is not None else CostModel(tt, cfg.hardware, memoise=True)
    parts = node_costs(cm, strategy, [str(m) for m in cfg.mesh_names])
    nodes = tt.nodes
    names = nodes["name"]
    outs = [tt.slist_outputs[s][k] for s, k in zip(nodes["slist"], strategy.tolist())]
    ins = [tt.slist_inputs[s][k] for s, k in zip(nodes["slist"], strategy.tolist())]
    phash = placement_hash(names, outs, ins)

    objective = float(result.objective)
    bound, source = float(result.lower_bound), str(result.lower_bound_source)
    if lp_bound is not None and lp_bound > bound:
        bound, source = float(lp_bound), "lp"
    certified = bool(is_certified(objective, bound))
    status = str(result.status)
    if cfg.solver.name == "approx":
        status = "Optimal" if certified else "Heuristic"
    run_id = config_hash({"dir": str(dirs.solve)})
    seconds = _stage_seconds(dirs)
    phases = dict(seconds)
    for k, v in timer.seconds.items():
        phases[k] = phases.get(k, 0.0) + v
    phases["search_total"] = sum(phases.get(k, 0.0) for k in
                                 ("trace", "topology", "cost_build", "factor_build", "solve"))
    import pipeline

    phases["wall"] = time.perf_counter() - pipeline.PROCESS_START
    stats = fp.cm.stats if fp is not None else None
    costs_meta = json.loads((Path(dirs.costs) / COSTS_FILE).read_text())
    factor_counts = (
        {"unary_vectors": stats.unary_vectors, "edge_tables": stats.edge_tables,
         "group_factors": stats.group_factors} if stats is not None
        else costs_meta.get("counts", {}))
    factor_counts = {k: factor_counts.get(k) for k in
                     ("unary_vectors", "edge_tables", "group_factors")}
    factor_counts["total"] = sum(v or 0 for v in factor_counts.values())
    topo_counts = tt.summary["counts"]
    record: dict[str, Any] = {
        "run_id": run_id,
        "solve_dir": str(dirs.solve),
        "model": str(cfg.model.name),
        "mesh": "x".join(str(m) for m in cfg.mesh),
        "mesh_names": list(cfg.mesh_names),
        "hardware": str(cfg.hardware.name),
        "cost_mode": "lazy" if cfg.lazy_costs else "eager",
        "solver": str(cfg.solver.name),
        "backend": str(cfg.solver.backend) if cfg.solver.name != "approx" else None,
        "status": status,
        "objective": objective,
        "compute_us": float(parts["compute_us"].sum()),
        "comm_us": float(parts["comm_us"].sum()),
        "transition_us": float(parts["transition_us"].sum()),
        "lower_bound": bound,
        "lower_bound_source": source,
        "lower_bound_problem": BOUND_PROBLEM,
        "gap": relative_gap(objective, bound),
        "certified": certified,
        "placement_hash": phash,
        "iterations": int(result.iterations),
        "collectives": collective_summary(parts["redistributions"]),
        "counts": {
            "nodes": topo_counts["nodes"], "edges": topo_counts["edges"],
            "groups": mrf.num_groups, "group_edges": mrf.num_edges,
            "strategies": topo_counts["strategies"],
            "group_strategies": int(np.asarray(mrf.domain_sizes).sum()),
            "fallback_nodes": topo_counts.get("fallback_nodes", 0),
            "factors_materialised": factor_counts},
        "phases": phases,
        "solver_extra": {k: v for k, v in (result.extra or {}).items()
                         if isinstance(v, (int, float, str, bool, type(None)))},
        "bound_history": [float(b) for b in (result.bound_history or [])][-50:],
        "environment": runtime.environment(),
        "git": runtime.git_revision(),
        "revision_label": cfg.get("revision_label"),
        "fallback_ops": tt.summary.get("fallback_ops", {}),
    }
    if lp_bound is not None:
        record["lp_bound"] = float(lp_bound)
    if budget is not None:
        from pipeline.constraints import used_memory

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
        "compute_us": parts["compute_us"],
        "comm_us": parts["comm_us"],
        "transition_us": parts["transition_us"],
    })
    return record, table, redistribution_table(run_id, parts["redistributions"], list(names))
