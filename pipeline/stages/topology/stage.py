"""The topology stage: the placement problem built from the graph IR, and its entry point."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from pipeline.core import artifacts, runtime
from pipeline.core.artifacts import GRAPH
from pipeline.core.ir import IRNode, read_nodes
from pipeline.core.parallel import resolve_workers
from pipeline.stages.topology.artifacts import write_topology
from pipeline.stages.topology.groups import group_nodes
from pipeline.stages.topology.pins import apply_pins, parse_pins, pin_requests, recipe_of
from pipeline.stages.topology.problem import (
    StrategyTable,
    Topology,
    add_output_sinks,
    graph_problem_nodes,
    problem_edges,
    set_param_ratios,
)
from pipeline.stages.topology.recipe_domains import recipe_contexts, recipe_domains
from pipeline.stages.topology.recipe_pins import apply_dim_pins, dim_pins
from pipeline.stages.topology.strategies import StrategyEnumerator


def build_topology(nodes: list[IRNode], mesh: Any, mesh_shape: tuple[int, ...],
                   mesh_names: tuple[str, ...], constraints: dict[str, Any],
                   tie_repeated_layers: bool, tied_params: dict[str, str] | None = None,
                   workers: int = 1, recipes: list[dict[str, Any]] | None = None) -> Topology:
    """Build the placement problem from the decoded graph (see pipeline/stages/topology/).

    ``constraints`` keys used here: ``inputs``, ``outputs`` and ``nodes`` (pins,
    pipeline/stages/topology/pins.py) and ``fwd_bwd_consistency`` (tie parameters to their
    gradient sinks, default true). ``tie_repeated_layers`` ties the copies of each
    repeated layer (config ``repeated_layers``). ``tied_params``: ``{alias:
    parameter}`` of tied parameters (graph metadata), so a pin naming an alias pins the
    one placeholder of the tensor. ``workers``: processes that enumerate the DTensor
    strategies of the distinct op signatures (:meth:`StrategyEnumerator.prefetch`).
    Raises TopologyError for a pin that matches nothing or no strategy.
    """
    start = time.perf_counter()
    pin_spec = parse_pins(constraints, len(mesh_shape))
    enumerator = StrategyEnumerator(mesh, mesh_shape)
    table = StrategyTable()
    enumerator.prefetch(nodes, workers)
    problem, fallback_ops = graph_problem_nodes(nodes, enumerator, table)
    strategies_seconds = time.perf_counter() - start
    add_output_sinks(nodes, problem, table, len(mesh_shape))
    requests = pin_requests(pin_spec, nodes, problem, tied_params)
    edges = problem_edges(problem)
    grouping = group_nodes(nodes, problem, table,
                           tie_fwd_bwd=bool(constraints.get("fwd_bwd_consistency", True)),
                           tie_repeated_layers=tie_repeated_layers)
    set_param_ratios(problem, table, mesh_shape)
    before = [m.strategy_list for m in problem]
    pins = apply_pins(requests, problem, table, grouping)
    if pin_spec.recipe is not None:  # every other node the recipe fixes, per mesh dim
        per_dim = dim_pins(pin_spec.recipe, problem, table, nodes, pin_spec.inputs)
        pins = {**apply_dim_pins(per_dim, problem, table, grouping, len(mesh_shape)), **pins}
    domains_start = time.perf_counter()
    domains = recipe_domains(recipes or [], constraints, nodes, problem, table, before,
                             grouping, len(mesh_shape), tied_params)
    domains_seconds = time.perf_counter() - domains_start
    return Topology(
        mesh_shape=mesh_shape, mesh_names=mesh_names, nodes=problem,
        strategy_lists=table.lists, edges=edges, group_of=grouping.group_of,
        groups=grouping.groups, fallback_ops=fallback_ops, pins=pins,
        repeated_layers=grouping.repeated_layers,
        seconds={"strategies": strategies_seconds, "total": time.perf_counter() - start,
                 "dtensor_enumeration": enumerator.seconds, "recipe_domains": domains_seconds},
        strategy_rejections=enumerator.rejections(), recipe_domains=domains)


def device_mesh(mesh_shape: tuple[int, ...], mesh_names: tuple[str, ...]) -> Any:
    """A DeviceMesh on the fake process group (initialised to the mesh size)."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline.stages.trace.stage import fake_process_group

    fake_process_group(math.prod(mesh_shape))
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)


def run_topology(cfg: Any, trace_dir: Path, out_dir: Path) -> None:
    """Stage entry point: read ``graph.parquet`` from ``trace_dir``, write the topology."""
    from omegaconf import OmegaConf

    timer = runtime.PhaseTimer()
    with timer.phase("topology"):
        nodes = read_nodes(Path(trace_dir))
        tied = artifacts.table_metadata(GRAPH, Path(trace_dir)).get("tied_parameters") or {}
        mesh_shape = tuple(int(s) for s in cfg.mesh)
        mesh_names = tuple(cfg.mesh_names)
        constraints = OmegaConf.to_container(cfg.constraints, resolve=True) or {}
        constraints["recipe"] = recipe_of(cfg)
        mesh = device_mesh(mesh_shape, mesh_names)
        topo = build_topology(nodes, mesh, mesh_shape, mesh_names, constraints,
                              bool(cfg.repeated_layers), tied_params=tied,
                              workers=resolve_workers(int(cfg.get("workers", 1))),
                              recipes=recipe_contexts(cfg))
    write_topology(topo, Path(out_dir), {
        "stage": "topology", "tied_parameters": tied, "phase_seconds": timer.seconds,
        "peak_rss_bytes": runtime.peak_rss_bytes(), "git": runtime.git_revision()})

