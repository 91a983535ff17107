"""The topology stage's artifacts: writing them and reading them back.

In the stage directory:

* ``nodes.parquet``: one row per problem node (graph nodes and sinks): name,
  target, role, layer, phase, fqn, graph index, group, strategy list index
  (``slist``), its length, fallback flag, the parameters' smallest local/full
  size ratio, and the JSON texts of args, kwargs, input and output metadata;
* ``strategies.parquet``: one row per strategy of each distinct strategy list
  (``slist``, ``strategy``, ``output`` placement text, ``inputs`` texts);
* ``edges.parquet``: ``producer, element, consumer, arg`` per tensor argument use;
* ``topology.json``: counts, fallback ops, the strategy-function calls DTensor
  refused per op (``strategy_rejections``, absent in older files: read it with
  ``.get``), applied pins, the repeated layers (key ``repeated_blocks``), timings, and a
  planner run's recipes as restrictions of its domains (``recipe_domains``: per recipe
  the labels it keeps of each group it restricts, or why it is skipped; recipe_domains.py);
  written last, the stage's sentinel.

The cost stage reads them with :func:`read_topology` (plain Python / numpy, no
DTensor objects).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.core import runtime
from pipeline.core.artifacts import EDGES_FILE, NODES_FILE, STRATEGIES_FILE, TOPOLOGY_FILE
from pipeline.dtensor.placements import format_placements, format_strategy_output
from pipeline.stages.topology.problem import Topology


def write_topology(topo: Topology, out_dir: Path, meta: dict[str, Any]) -> None:
    """Write the topology artifacts; ``topology.json`` last (the sentinel)."""
    out_dir = Path(out_dir)
    runtime.write_parquet(out_dir / NODES_FILE, _nodes_table(topo))
    runtime.write_parquet(out_dir / STRATEGIES_FILE, _strategies_table(topo))
    runtime.write_parquet(out_dir / EDGES_FILE, _edges_table(topo))
    runtime.write_json(out_dir / TOPOLOGY_FILE, _summary(topo, meta))


def _nodes_table(topo: Topology) -> pa.Table:
    nodes = topo.nodes
    lists = topo.strategy_lists
    # json.dumps of the metadata, once per object (copies of a layer share them); the
    # nodes keep the objects alive, so their ids stay unique meanwhile.
    texts: dict[int, str] = {}

    def dumps(obj: Any) -> str:
        hit = texts.get(id(obj))
        if hit is None:
            hit = texts[id(obj)] = json.dumps(obj)
        return hit

    return pa.table({
        "id": pa.array([m.id for m in nodes], pa.int32()),
        "name": [m.name for m in nodes],
        "target": [m.target for m in nodes],
        "role": [m.role for m in nodes],
        "layer": [m.layer for m in nodes],
        "phase": [m.phase for m in nodes],
        "fqn": [m.fqn for m in nodes],
        "graph_idx": pa.array([m.graph_idx for m in nodes], pa.int32()),
        "group": pa.array(topo.group_of, pa.int32()),
        "slist": pa.array([m.strategy_list for m in nodes], pa.int32()),
        "num_strategies": pa.array([len(lists[m.strategy_list]) for m in nodes], pa.int32()),
        "fallback": [lists[m.strategy_list].fallback for m in nodes],
        "min_param_ratio": pa.array([m.min_ratio for m in nodes], pa.float64()),
        "args": [m.args_text if m.args_text is not None else json.dumps(m.args) for m in nodes],
        "kwargs": [m.kwargs_text if m.kwargs_text is not None else json.dumps(m.kwargs)
                   for m in nodes],
        # json.dumps of a list is its items' texts joined by ", " in brackets
        "in_metas": ["[" + ", ".join(dumps(x) for x in m.in_metas) + "]" for m in nodes],
        "out_metas": [dumps(m.out_metas) for m in nodes],
    })


def _strategies_table(topo: Topology) -> pa.Table:
    list_col, strategy_col, output_col, inputs_col = [], [], [], []
    # The same placement tuples recur in every list: format each distinct one once.
    texts: dict[Any, str] = {}

    def text(placements: Any, fmt: Any) -> str:
        key = (fmt, placements) if isinstance(placements, tuple) else None
        hit = texts.get(key) if key is not None else None
        if hit is None:
            hit = fmt(placements)
            if key is not None:
                texts[key] = hit
        return hit

    for s, strategies in enumerate(topo.strategy_lists):
        for k in range(len(strategies)):
            list_col.append(s)
            strategy_col.append(k)
            output_col.append(text(strategies.outputs[k], format_strategy_output))
            inputs_col.append([text(p, format_placements) for p in strategies.inputs[k]])
    return pa.table({
        "slist": pa.array(list_col, pa.int32()), "strategy": pa.array(strategy_col, pa.int32()),
        "output": pa.array(output_col).dictionary_encode(),
        "inputs": pa.array(inputs_col, pa.list_(pa.string()))})


def _edges_table(topo: Topology) -> pa.Table:
    e = topo.edges
    return pa.table({
        "producer": pa.array([x[0] for x in e], pa.int32()),
        "element": pa.array([x[1] for x in e], pa.int32()),
        "consumer": pa.array([x[2] for x in e], pa.int32()),
        "arg": pa.array([x[3] for x in e], pa.int32())})


def _summary(topo: Topology, meta: dict[str, Any]) -> dict[str, Any]:
    nodes, lists = topo.nodes, topo.strategy_lists
    summary = dict(meta)
    summary.update({
        "mesh": list(topo.mesh_shape), "mesh_names": list(topo.mesh_names),
        "counts": {
            "nodes": len(nodes), "edges": len(topo.edges), "groups": len(topo.groups),
            "strategy_lists": len(lists),
            "strategies": sum(len(lists[m.strategy_list]) for m in nodes),
            "group_strategies": sum(len(lists[nodes[g[0]].strategy_list]) for g in topo.groups),
            "fallback_nodes": sum(topo.fallback_ops.values())},
        "fallback_ops": topo.fallback_ops, "strategy_rejections": topo.strategy_rejections,
        "pins": topo.pins,
        "repeated_blocks": topo.repeated_layers, "seconds": topo.seconds,
        "recipe_domains": {d.recipe: d.to_record() for d in topo.recipe_domains}})
    return summary


@dataclass
class TopologyTables:
    """The topology artifacts read back (plain Python / numpy; no DTensor objects)."""

    summary: dict
    nodes: dict[str, list]
    slist_outputs: list[list[str]]
    slist_inputs: list[list[list[str]]]
    edges: dict[str, list]


def read_topology(topology_dir: Path) -> TopologyTables:
    """Load the topology artifacts written by :func:`write_topology`."""
    d = Path(topology_dir)
    summary = json.loads((d / TOPOLOGY_FILE).read_text())
    nodes = runtime.read_parquet(d / NODES_FILE).to_pydict()
    strategies = runtime.read_parquet(d / STRATEGIES_FILE)
    list_index = strategies.column("slist").to_numpy()
    outputs = strategies.column("output").to_pylist()
    inputs = strategies.column("inputs").to_pylist()
    n_lists = int(list_index.max()) + 1 if len(list_index) else 0
    slist_outputs: list[list[str]] = [[] for _ in range(n_lists)]
    slist_inputs: list[list[list[str]]] = [[] for _ in range(n_lists)]
    for s, o, i in zip(list_index.tolist(), outputs, inputs):
        slist_outputs[s].append(o)
        slist_inputs[s].append(i)
    edges = runtime.read_parquet(d / EDGES_FILE).to_pydict()
    return TopologyTables(summary, nodes, slist_outputs, slist_inputs, edges)
