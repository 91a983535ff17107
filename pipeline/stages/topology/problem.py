"""The placement problem before costs: its nodes, strategy lists, edges and groups.

A :class:`ProblemNode` is one node of the placement problem: a graph node (in graph
order) or an output sink. Its domain is a :class:`~pipeline.stages.topology.candidates.StrategyList`
held once in a :class:`StrategyTable` (the copies of a repeated layer share theirs).
Besides the ops (pipeline/stages/topology/strategies.py):

* placeholders (parameters, buffers, inputs, tangents) get every valid
  non-Partial placement;
* ``getitem`` selects one element of its producer's tuple strategies;
* the graph output becomes one *sink* per element: the loss, whose sink accepts
  only Replicate (the 0-d loss is the same on every rank), and each gradient,
  whose sink has its parameter's placements. The op producing the loss may output
  Partial (a batch-sharded mean) and the edge into the sink then pays the
  all-reduce, as gradient sinks pay their reduce-scatter.

An edge ``(producer, element, consumer, arg)`` is one use of a tensor argument.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.core import progress
from pipeline.core.errors import PlanError
from pipeline.core.ir import IRNode, graph_outputs, is_tensor_ref, output_meta
from pipeline.dtensor.placements import local_shape
from pipeline.stages.topology.candidates import StrategyList
from pipeline.stages.topology.strategies import StrategyEnumerator


class TopologyError(PlanError):
    """A constraint or graph fact that makes the placement problem ill-posed."""


@dataclass
class ProblemNode:
    """A node of the placement problem: a graph node or an output sink."""

    id: int
    name: str
    target: str
    role: str
    layer: str | None
    phase: str
    strategy_list: int  # index of its StrategyList in Topology.strategy_lists
    producers: list[tuple[int, int]]  # (producer id, element or -1) per tensor arg
    in_metas: list[dict]
    out_metas: list[dict | None]
    args: Any = None
    kwargs: Any = None
    graph_idx: int | None = None
    fqn: str | None = None
    tied_to: int | None = None  # fwd/bwd twin (gradient sink -> parameter)
    min_ratio: float | None = None  # parameters: smallest local/full size, before pins
    args_text: str | None = None  # json.dumps(args) when known (the graph IR's text)
    kwargs_text: str | None = None


@dataclass
class Topology:
    """The extracted placement problem (before costs).

    Attributes:
        mesh_shape, mesh_names: the device mesh.
        nodes: problem nodes (graph nodes in graph order, then sinks).
        strategy_lists: distinct strategy lists; ``nodes[i].strategy_list`` indexes it.
        edges: ``(producer, element, consumer, arg)`` per tensor argument use.
        group_of: group index per node; groups are numbered by first member.
        groups: per group, its member node ids (first member first).
        fallback_ops: targets that fell back to replicate-only, with their counts.
        pins: applied pins ``{node name: placement text}``.
        repeated_layers: per repeated layer, its copies and how many pairs were tied.
        seconds: phase timings.
        strategy_rejections: per op, the strategy-function calls DTensor refused
            (:meth:`StrategyEnumerator.rejections`).
        recipe_domains: a planner run's recipes as restrictions of its domains
            (:class:`~pipeline.stages.topology.recipe_domains.RecipeDomain`).
    """

    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    nodes: list[ProblemNode]
    strategy_lists: list[StrategyList]
    edges: list[tuple[int, int, int, int]]
    group_of: list[int]
    groups: list[list[int]]
    fallback_ops: dict[str, int]
    pins: dict[str, str]
    repeated_layers: list[dict]
    seconds: dict[str, float]
    strategy_rejections: dict[str, int] = field(default_factory=dict)
    recipe_domains: list[Any] = field(default_factory=list)


class StrategyTable:
    """The distinct strategy lists of a problem, numbered in order of first use.

    Lists are told apart by identity: the enumerator returns one object per node
    signature and :meth:`shared` one object per key, so the copies of a repeated
    layer refer to one list.
    """

    def __init__(self) -> None:
        self.lists: list[StrategyList] = []
        self._index: dict[int, int] = {}
        self._shared: dict[tuple, StrategyList] = {}

    def intern(self, strategies: StrategyList) -> int:
        """The index of ``strategies``, appending it on first use."""
        key = id(strategies)
        if key not in self._index:
            self._index[key] = len(self.lists)
            self.lists.append(strategies)
        return self._index[key]

    def shared(self, key: tuple, make: Callable[[], StrategyList]) -> StrategyList:
        """The one list for ``key`` (placeholder shape, getitem element, sink kind),
        ``make()`` on first use."""
        hit = self._shared.get(key)
        if hit is None:
            hit = self._shared[key] = make()
        return hit

    def __getitem__(self, index: int) -> StrategyList:
        return self.lists[index]

    def copy(self) -> StrategyTable:
        """A table with the same lists at the same indices; lists interned into the copy
        are not added to this one."""
        out = StrategyTable()
        out.lists = list(self.lists)
        out._index = dict(self._index)
        out._shared = dict(self._shared)
        return out


def graph_problem_nodes(nodes: list[IRNode], enumerator: StrategyEnumerator,
                        table: StrategyTable) -> tuple[list[ProblemNode], dict[str, int]]:
    """One problem node per graph node but the output, with its strategies.

    Returns the nodes (graph order) and the fallback counts ``{target: nodes}`` of
    ops without a DTensor strategy.
    """
    replicate = _replicate(len(enumerator.mesh_shape))
    problem: list[ProblemNode] = []
    fallback: dict[str, int] = {}
    id_of: dict[int, int] = {}
    for n in progress.bar(nodes, desc="topology: strategies", unit="node"):
        if n.kind == "output":
            continue
        if n.kind == "call_function" and n.target == "getitem":
            element = int(n.args[1])
            producers = [(id_of[n.refs[0]], element)]
            metas = [output_meta(nodes, n.refs[0], element)]
        else:
            producers = [(id_of[r], -1) for r in n.refs]
            metas = [nodes[r].outputs[0] for r in n.refs]
        if n.kind == "placeholder":
            meta = n.outputs[0]
            strategies = (_placeholder_strategies(meta["shape"], enumerator, table)
                          if meta is not None else StrategyList((replicate,), ((),)))
        elif n.target == "getitem":
            strategies = _getitem_strategies(problem[producers[0][0]], producers[0][1], table,
                                             replicate)
        else:
            strategies = enumerator.op_strategies(n, metas)
            if strategies.fallback:
                fallback[n.target] = fallback.get(n.target, 0) + 1
        id_of[n.idx] = len(problem)
        problem.append(ProblemNode(
            id=len(problem), name=n.name, target=n.target, role=n.role, layer=n.layer,
            phase=n.phase, strategy_list=table.intern(strategies), producers=producers,
            in_metas=metas, out_metas=n.outputs, args=n.args, kwargs=n.kwargs, graph_idx=n.idx,
            fqn=n.fqn, args_text=n.args_text, kwargs_text=n.kwargs_text))
    return problem, fallback


def problem_id_of(problem: list[ProblemNode]) -> dict[int, int]:
    """Graph index -> problem node id, for the nodes that come from the graph."""
    return {m.graph_idx: m.id for m in problem if m.graph_idx is not None}


def _replicate(ndim: int) -> tuple:
    from torch.distributed.tensor import Replicate

    return (Replicate(),) * ndim


def _placeholder_strategies(shape: list[int], enumerator: StrategyEnumerator,
                            table: StrategyTable) -> StrategyList:
    """Every valid non-Partial placement, no inputs; one list per shape."""
    def make() -> StrategyList:
        placements = enumerator.placements_of(shape, partial=False)
        return StrategyList(tuple(placements), tuple(() for _ in placements))

    return table.shared(tuple(shape), make)


def _getitem_strategies(producer: ProblemNode, element: int, table: StrategyTable,
                        replicate: tuple) -> StrategyList:
    """The distinct placements of one element of the producer's tuple outputs."""
    def make() -> StrategyList:
        seen: dict[tuple, None] = {}
        for o in table[producer.strategy_list].outputs:
            p = o[element] if isinstance(o[0], tuple) or o[0] is None else o
            if p is not None:
                seen.setdefault(p, None)
        placements = list(seen) or [replicate]
        return StrategyList(tuple(placements), tuple((p,) for p in placements))

    return table.shared(("getitem", producer.strategy_list, element), make)


def add_output_sinks(nodes: list[IRNode], problem: list[ProblemNode], table: StrategyTable,
                     ndim: int) -> None:
    """Append one sink per element of the graph output (see module docstring)."""
    id_of = problem_id_of(problem)
    replicate = _replicate(ndim)
    param_of = {m.fqn: m.id for m in problem if m.role == "param"}
    for k, (ref, desc) in enumerate(graph_outputs(nodes)):
        if not is_tensor_ref(ref):
            continue
        src = id_of[ref["node"]]
        meta = nodes[ref["node"]].outputs[0]
        if meta is None:
            continue
        if desc["kind"] == "grad" and desc.get("grad_of") in param_of:
            param = problem[param_of[desc["grad_of"]]]
            strategies = table.shared(("sink", param.strategy_list), functools.partial(
                _sink_strategies, table[param.strategy_list].outputs))
            name, role, layer, tied = f"output:grad:{param.fqn}", "grad", param.layer, param.id
        else:
            strategies = table.shared(("loss",), functools.partial(_sink_strategies,
                                                                   (replicate,)))
            name, role, layer, tied = f"output:{k}", "output", None, None
        problem.append(ProblemNode(
            id=len(problem), name=name, target="output", role=role, layer=layer, phase="bwd",
            strategy_list=table.intern(strategies), producers=[(src, -1)], in_metas=[meta],
            out_metas=[meta], tied_to=tied, fqn=desc.get("grad_of")))


def _sink_strategies(placements: tuple) -> StrategyList:
    """A sink accepting exactly ``placements`` (its output is its input)."""
    return StrategyList(placements, tuple((p,) for p in placements))


def problem_edges(problem: list[ProblemNode]) -> list[tuple[int, int, int, int]]:
    """``(producer, element, consumer, arg)`` per tensor argument, consumer order."""
    return [(p, element, m.id, a) for m in problem
            for a, (p, element) in enumerate(m.producers)]


def set_param_ratios(problem: list[ProblemNode], table: StrategyTable,
                     mesh_shape: tuple[int, ...]) -> None:
    """``min_ratio`` of every parameter: its smallest local / full size over its
    strategies (read by the parameter-memory budget; computed before pins)."""
    for m in problem:
        if m.role == "param" and m.out_metas and m.out_metas[0] is not None:
            m.min_ratio = min(_local_ratio(m.out_metas[0]["shape"], o, mesh_shape)
                              for o in table[m.strategy_list].outputs)


def _local_ratio(shape: list[int], placements: tuple, mesh_shape: tuple[int, ...]) -> float:
    """Local elements / full elements of a tensor under ``placements``."""
    if not shape:
        return 1.0
    return math.prod(local_shape(shape, placements, mesh_shape)) / math.prod(shape)
