"""The cost model: per node, the compute cost of each strategy; per graph edge, the
redistribution cost of each pair of placement classes. The objective it prices (the same
words as pipeline/solvers/mrf.py)::

    E(x) = sum_v U_v(x_v) + sum_e B_e(x_u, x_v)

* ``U_v(k)``: compute cost of node v under strategy k, the roofline
  ``max(FLOPs / (peak * eff_c), bytes / (HBM_bw * eff_m))`` on the *local*
  (sharded) shapes, floored at the kernel launch floor, 0 for views
  (pipeline/costmodel/compute.py).
* ``B_e(i, j)`` for edge e = (producer u, consumer v, argument a): the cost of
  redistributing u's output placement under i into v's expected placement for
  argument a under j (pipeline/costmodel/redistribute/; +inf when DTensor
  forbids it), plus the transition cost 1.0 when the two placements differ, plus
  (``costs.fuse_pointwise``) the pointwise-fusion term: minus the launch floor and
  the read of the intermediate a fused consumer saves when both ends are
  elementwise and the redistribution is the identity (pipeline/costmodel/fusion.py).
* ``U_v`` also holds the collectives a strategy issues inside its op: the
  all-reduces of a vocab-parallel softmax (pipeline/costmodel/op_comm.py).

A node's strategies map onto *placement classes*: its distinct output
placements (rows) and, per argument, its distinct expected input placements
(columns). An edge's table is computed over classes, never over strategy
pairs, and a factor is ``(row_cls, col_cls, table)`` (see solvers/mrf.py).

Activation checkpointing (``memory.activation_checkpointing``) makes the recomputed
forward ops and edges of each repeated layer count twice (:class:`CostModel`
``recompute``); FSDP2's collective semantics (buckets, re-gather, reduce dtype) set each
edge's collective policy (pipeline/costmodel/fsdp.py).

Eager costs compute one table per graph edge; lazy costs memoise edge tables by
signature (shape, dtype, placement classes, times paid, collective policy: the edge
classes of :meth:`CostModel.edge_classes`), so the copies of a repeated layer share one
table. How node and edge costs fold into the group MRF is pipeline/costmodel/factors.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.core.dtypes import itemsize, numel
from pipeline.core.ir import TENSOR_REF_RE as _REF_RE
from pipeline.core.ir import decode_shared as _decode_shared
from pipeline.core.ir import tensor_refs as _refs_in
from pipeline.core.ir import with_shapes as _with_shapes
from pipeline.costmodel.compute import is_view_op, op_flops, roofline_us, table_rates
from pipeline.costmodel.fsdp import edge_policy
from pipeline.costmodel.fusion import PointwiseFusion
from pipeline.costmodel.hardware import as_hardware, tables_of
from pipeline.costmodel.model_parallel import (
    activation_edges,
    blocked_pairs,
    cross_node_dims,
    op_comm_blocked,
)
from pipeline.costmodel.op_comm import SOFTMAX_ALL_REDUCES, op_collectives, op_comm_us
from pipeline.costmodel.redistribute import placements_differ, redistribute_table
from pipeline.dtensor.placements import local_shape, parse_output, parse_placements
from pipeline.memory.graph import step_graph
from pipeline.memory.terms import element_text

__all__ = ["TRANSITION_COST", "CostModel", "FactorStats"]

#: Added to an edge's table wherever the two placements differ (``B_e``, module docstring).
TRANSITION_COST = 1.0
_NO_COMPUTE = ("placeholder", "getitem", "output")


@dataclass
class FactorStats:
    """Counters reported in the run record."""

    unary_vectors: int = 0
    edge_tables: int = 0
    group_factors: int = 0


class CostModel:
    """Node-level unary vectors and edge tables over placement classes.

    Args:
        topology: the topology stage's tables (``TopologyTables`` of
            pipeline/stages/topology/artifacts.py: ``read_topology``).
        hw: HardwareConfig (or a DictConfig with the same fields).
        memoise: memoise edge tables by signature (lazy mode); eager mode
            computes one table per graph edge.
        recompute: activation checkpointing's recomputation
            (:meth:`pipeline.memory.graph.StepGraph.recomputed_nodes` / ``recomputed_edges``):
            bool ``[num_nodes]`` and ``[num_edges]``; a recomputed node's compute and a
            recomputed edge's redistribution are paid twice (forward, then again before
            the layer's backward). None: nothing is recomputed.
        collectives: FSDP2's collective semantics
            (:class:`pipeline.costmodel.fsdp.CollectiveOptions`: buckets, re-gather,
            reduce dtype); None: every collective as DTensor issues it alone.
        fuse_pointwise: add the pointwise-fusion term to the edge tables
            (pipeline/costmodel/fusion.py; ``costs.fuse_pointwise``).
        model_parallel: ``constraints.model_parallel``: ``intra_node`` makes every
            activation collective on a mesh dim that crosses nodes ``+inf``
            (pipeline/costmodel/model_parallel.py); None: no restriction.
    """

    def __init__(self, topology: Any, hw: Any, memoise: bool,
                 recompute: tuple[np.ndarray, np.ndarray] | None = None,
                 collectives: Any = None,
                 fuse_pointwise: bool = False, model_parallel: str | None = None):
        self.topology = topology
        self.hw = as_hardware(hw)  # plain attributes: the compute model reads them per op
        self.memoise = memoise
        self.mesh_shape = tuple(int(s) for s in topology.summary["mesh"])
        self.ndim = len(self.mesh_shape)
        n = topology.nodes
        self.num_nodes = len(n["id"])
        self.target = n["target"]
        self.slist = n["slist"]
        # The copies of a repeated layer have equal metadata texts: decode each distinct
        # text once and share the (read-only) result.
        self._in_metas_text = n["in_metas"]
        self._out_metas_text = n["out_metas"]
        self.in_metas = _decode_shared(self._in_metas_text)
        self.out_metas = _decode_shared(self._out_metas_text)
        self.args = n["args"]
        self.kwargs = n["kwargs"]
        self.stats = FactorStats()
        self._out_cls: dict[tuple[int, int], tuple[np.ndarray, list]] = {}
        self._in_cls: dict[tuple[int, int], tuple[np.ndarray, list]] = {}
        self._unary_memo: dict[str, np.ndarray] = {}
        self._unary_of: list[np.ndarray | None] = [None] * self.num_nodes
        self._unary_key: list[str | None] = [None] * self.num_nodes
        self._op_comm_memo: dict[str, np.ndarray | None] = {}
        self._table_memo: dict[tuple, np.ndarray] = {}
        e = topology.edges
        self.edges = list(zip(e["producer"], e["element"], e["consumer"], e["arg"]))
        self._edge_cls: np.ndarray | None = None
        self.fusion = None
        if fuse_pointwise:
            self.fusion = PointwiseFusion(self)
        if recompute is None:
            self.node_times = np.ones(self.num_nodes, dtype=np.int64)
            self.edge_times = np.ones(len(self.edges), dtype=np.int64)
        else:
            self.node_times = 1 + np.asarray(recompute[0], dtype=np.int64)
            self.edge_times = 1 + np.asarray(recompute[1], dtype=np.int64)
            if self.node_times.shape != (self.num_nodes,) or self.edge_times.shape != (
                    len(self.edges),):
                raise ValueError("recompute masks do not match the topology's nodes / edges")
        self.policy = None
        if collectives is not None:
            self.policy = edge_policy(topology, step_graph(topology), collectives,
                                      self.in_metas)
            # a re-gathered weight edge is paid twice; recomputation reads that copy
            self.edge_times = np.maximum(self.edge_times,
                                         1 + self.policy.regather.astype(np.int64))
        self.blocked_dims: frozenset[int] = frozenset()
        self.activation_edge: np.ndarray | None = None
        if model_parallel == "intra_node":
            self.blocked_dims = cross_node_dims(self.mesh_shape, int(self.hw.gpus_per_node))
            if self.blocked_dims:
                self.activation_edge = activation_edges(step_graph(topology), self.in_metas)

    # -- classes ----------------------------------------------------------------------------

    def out_classes(self, node: int, element: int) -> tuple[np.ndarray, list]:
        """(class index per strategy int32 [K], distinct output placements)."""
        s = self.slist[node]
        key = (s, element)
        hit = self._out_cls.get(key)
        if hit is None:
            texts = self.topology.slist_outputs[s]
            if element >= 0:
                texts = [element_text(t, element, self.ndim) for t in texts]
            hit = self._out_cls[key] = _classes(texts, self.ndim)
        return hit

    def in_classes(self, node: int, arg: int) -> tuple[np.ndarray, list]:
        """(class index per strategy int32 [K], distinct expected placements of ``arg``)."""
        s = self.slist[node]
        key = (s, arg)
        hit = self._in_cls.get(key)
        if hit is None:
            texts = [ins[arg] for ins in self.topology.slist_inputs[s]]
            hit = self._in_cls[key] = _classes(texts, self.ndim)
        return hit

    # -- unary ------------------------------------------------------------------------------

    def unary(self, node: int) -> np.ndarray:
        """Compute cost ``U_v`` (µs) per strategy of ``node``, float64 [K]; a node that
        activation checkpointing recomputes runs twice (``node_times``)."""
        hit = self._unary_of[node]
        if hit is not None:
            return hit
        target = self.target[node]
        if target in _NO_COMPUTE:
            return np.zeros(len(self.topology.slist_outputs[self.slist[node]]))
        # Memo key: the arguments with node references blanked (tensor arguments are
        # described by the metadata texts), so the copies of a repeated layer share one
        # vector.
        key = "|".join((target, _REF_RE.sub('{"node": 0}', self.args[node]),
                        _REF_RE.sub('{"node": 0}', self.kwargs[node]),
                        self._in_metas_text[node], self._out_metas_text[node],
                        str(self.slist[node]))) + (
            f"|{self.topology.nodes['phase'][node]}" if tables_of(self.hw) is not None else "")
        times = int(self.node_times[node])
        hit = self._unary_memo.get(key)
        if hit is None:
            hit = self._unary_uncached(node)
            op_comm = self._op_comm_uncached(node)
            if op_comm is not None:  # collectives inside the op (vocab-parallel softmax)
                hit = hit + op_comm
                if self.blocked_dims:  # constraints.model_parallel
                    hit = np.where(self._op_comm_blocked(node), np.inf, hit)
            self._unary_memo[key] = hit
            self._op_comm_memo[key] = op_comm
            self.stats.unary_vectors += 1
        if times != 1:
            once = hit
            hit = self._unary_memo.get(f"{key}|x{times}")
            if hit is None:
                hit = self._unary_memo[f"{key}|x{times}"] = once * times
        self._unary_of[node] = hit
        self._unary_key[node] = key
        return hit

    def op_comm(self, node: int) -> np.ndarray | None:
        """The part of ``unary(node)`` that is communication inside the op (µs per
        strategy, times ``node_times``): the all-reduces of a vocab-parallel softmax
        (pipeline/costmodel/op_comm.py); None when the op issues none."""
        self.unary(node)
        key = self._unary_key[node]
        if key is None:
            return None
        once = self._op_comm_memo.get(key)
        times = int(self.node_times[node])
        return once if once is None or times == 1 else once * times

    def _op_comm_uncached(self, node: int) -> np.ndarray | None:
        target = self.target[node]
        if target not in SOFTMAX_ALL_REDUCES:
            return None
        s = self.slist[node]
        outs, ins = self.topology.slist_outputs[s], self.topology.slist_inputs[s]
        in_meta = self.in_metas[node][0]
        out_meta = next(m for m in self.out_metas[node] if m)
        args = json.loads(self.args[node])
        size = itemsize(out_meta["dtype"])
        memo: dict[str, float] = {}
        costs = np.zeros(len(outs))
        for k, i in enumerate(ins):
            cost = memo.get(i[0])
            if cost is None:
                pl = parse_placements(i[0], self.ndim)
                coll = op_collectives(target, args, in_meta["shape"], pl,
                                      local_shape(in_meta["shape"], pl, self.mesh_shape), size)
                cost = memo[i[0]] = op_comm_us(coll, self.mesh_shape, self.hw)
            costs[k] = cost
        return costs if costs.any() else None

    def _op_comm_blocked(self, node: int) -> np.ndarray:
        """Per strategy, whether its in-op collectives use a cross-node mesh dim that
        ``constraints.model_parallel`` forbids (pipeline/costmodel/model_parallel.py)."""
        s = self.slist[node]
        target = self.target[node]
        args = json.loads(self.args[node])
        in_meta = self.in_metas[node][0]
        size = itemsize(next(m for m in self.out_metas[node] if m)["dtype"])
        out = np.zeros(len(self.topology.slist_outputs[s]), dtype=bool)
        for k, i in enumerate(self.topology.slist_inputs[s]):
            pl = parse_placements(i[0], self.ndim)
            coll = op_collectives(target, args, in_meta["shape"], pl,
                                  local_shape(in_meta["shape"], pl, self.mesh_shape), size)
            out[k] = op_comm_blocked(coll, self.blocked_dims)
        return out

    def _unary_uncached(self, node: int) -> np.ndarray:
        s = self.slist[node]
        outs, ins = self.topology.slist_outputs[s], self.topology.slist_inputs[s]
        target = self.target[node]
        # A non-aten op (a library's custom op, e.g. transformers.grouped_mm_fallback) is
        # replicate-only (topology) and costed as a memory-bound kernel: it is never
        # resolved here, as its library need not be imported in this process.
        aten = target.startswith("aten.")
        if aten and is_view_op(target):
            return np.zeros(len(outs))
        in_metas, out_metas = self.in_metas[node], self.out_metas[node]
        args, kwargs = json.loads(self.args[node]), json.loads(self.kwargs[node])
        n_args = len(_refs_in(args))
        dtype = next((m["dtype"] for m in out_metas if m), in_metas[0]["dtype"] if in_metas
                     else "float32")
        in_size = [itemsize(m["dtype"]) for m in in_metas]
        out_size = [itemsize(m["dtype"]) if m is not None else 0 for m in out_metas]
        # Local shapes depend only on (tensor, placement text): cache them per argument,
        # and memoise the roofline by the tuple of local shapes (far fewer than strategies).
        tables = tables_of(self.hw) is not None  # a measured profile (compute.table_rates)
        phase = str(self.topology.nodes["phase"][node]) if tables else "fwd"
        in_local: list[dict[str, tuple]] = [{} for _ in in_metas]
        out_local: dict[str, tuple] = {}
        memo: dict[tuple, float] = {}
        costs = np.empty(len(outs))
        for k, (o, i) in enumerate(zip(outs, ins)):
            loc_in = []
            for a, text in enumerate(i):
                sh = in_local[a].get(text)
                if sh is None:
                    sh = in_local[a][text] = local_shape(
                        in_metas[a]["shape"], parse_placements(text, self.ndim), self.mesh_shape)
                loc_in.append(sh)
            loc_out = out_local.get(o)
            if loc_out is None:
                out_pl = parse_output(o, self.ndim) if o.startswith("(") else [
                    parse_placements(o, self.ndim)]
                loc_out = out_local[o] = tuple(
                    None if (m is None or p is None) else local_shape(m["shape"], p,
                                                                      self.mesh_shape)
                    for m, p in zip(out_metas, out_pl))
            key = (tuple(loc_in), loc_out)
            cost = memo.get(key)
            if cost is None:
                nbytes = sum(numel(sh) * b for sh, b in zip(loc_in, in_size))
                nbytes += sum(numel(sh) * b for sh, b in zip(loc_out, out_size)
                              if sh is not None)
                flops = op_flops(target, _with_shapes(args, loc_in),
                                 _with_shapes(kwargs, loc_in, n_args),
                                 loc_out if len(loc_out) > 1 else loc_out[0]) if aten else 0.0
                eff, bw = table_rates(target, loc_in, args, kwargs, nbytes, dtype, self.hw,
                                      phase) if tables else (None, None)
                cost = memo[key] = float(roofline_us(flops, nbytes, dtype, self.hw, False,
                                                     eff, bw))
            costs[k] = cost
        return costs

    # -- pairwise ---------------------------------------------------------------------------

    def _edge_key(self, e: int) -> tuple:
        u, element, v, a = self.edges[e]
        meta = self.in_metas[v][a]
        key = (tuple(meta["shape"]), meta["dtype"], self.slist[u], element, self.slist[v], a,
               int(self.edge_times[e]), self.edge_collective_policy(e),
               self.activation_edge is not None and bool(self.activation_edge[e]))
        # pointwise fusion: what its term depends on beyond this key
        return key if self.fusion is None else key + self.fusion.edge_key(e)

    def edge_collective_policy(self, e: int) -> tuple[int, float, bool]:
        """``(reduce_itemsize, latency_scale, flatten)`` of edge ``e``'s collectives
        (:mod:`pipeline.costmodel.fsdp`; ``(0, 1.0, False)``: as DTensor issues them)."""
        return (0, 1.0, False) if self.policy is None else self.policy.of(e)

    def edge_classes(self) -> np.ndarray:
        """Class id per graph edge, int64 ``[E]``, numbered by first occurrence.

        Two edges are in one class when they carry a tensor of the same shape and
        dtype between the same producer strategy list and output element and the same
        consumer strategy list and argument, are paid the same number of times
        (``edge_times``) and under the same collective policy (reduce dtype, bucket
        latency share; the copies of a repeated layer agree on all of these): then
        :meth:`edge_table` gives them equal ``(row_cls, col_cls, table)``.
        """
        if self._edge_cls is None:
            index: dict[tuple, int] = {}
            self._edge_cls = np.fromiter(
                (index.setdefault(self._edge_key(e), len(index)) for e in range(len(self.edges))),
                dtype=np.int64, count=len(self.edges))
        return self._edge_cls

    def forget(self, e: int) -> None:
        """Drop the memoised table of edge ``e``'s class (recomputed if asked again):
        the factor provider calls it once every group factor that reads the class
        exists, so a class's table is not kept beside the group factors built from it."""
        self._table_memo.pop(self._edge_key(e), None)

    def edge_table(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(row_cls [K_u], col_cls [K_v], table [R, C])`` of graph edge ``e`` (µs): the
        redistribution times ``edge_times[e]``, plus the transition cost, plus the
        pointwise-fusion term when it is on."""
        u, element, v, a = self.edges[e]
        row_cls, srcs = self.out_classes(u, element)
        col_cls, dsts = self.in_classes(v, a)
        meta = self.in_metas[v][a]
        key = self._edge_key(e)
        table = self._table_memo.get(key) if self.memoise else None
        if table is None:
            reduce_itemsize, latency_scale, flatten = self.edge_collective_policy(e)
            table = redistribute_table(meta["shape"], itemsize(meta["dtype"]), srcs, dsts,
                                       self.mesh_shape, self.hw,
                                       reduce_itemsize=reduce_itemsize,
                                       latency_scale=latency_scale, flatten=flatten)
            times = int(self.edge_times[e])
            if times != 1:
                table = table * times
            differ = placements_differ(srcs, dsts)
            table = table + np.where(differ, TRANSITION_COST, 0.0)
            if self.activation_edge is not None and self.activation_edge[e]:
                # constraints.model_parallel=intra_node (pipeline/costmodel/model_parallel.py)
                table = np.where(blocked_pairs(srcs, dsts, self.blocked_dims), np.inf, table)
            # ---- pointwise fusion (pipeline/costmodel/fusion.py): its term, one call ----
            if self.fusion is not None:
                table = self.fusion.add_term(e, table, srcs, dsts)
            self.stats.edge_tables += 1
            if self.memoise:
                self._table_memo[key] = table
        return row_cls, col_cls, table

    def edge_terms(self, e: int, comm: bool = True
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(row_cls, col_cls, comm, transition, fusion)`` of graph edge ``e``: the three
        terms of :meth:`edge_table` (µs, ``[R, C]`` each) kept apart, for objectives that
        weigh them differently (pipeline/costmodel/reweight.py). ``comm`` is the
        redistribution times ``edge_times[e]`` (``+inf`` on a forbidden pair),
        ``transition`` the transition cost where the placements differ, ``fusion`` the
        pointwise-fusion term (``<= 0``, zeros when off). ``comm=False``: ``comm`` is zeros
        (no redistribution is planned). Not memoised."""
        u, element, v, a = self.edges[e]
        row_cls, srcs = self.out_classes(u, element)
        col_cls, dsts = self.in_classes(v, a)
        meta = self.in_metas[v][a]
        if comm:
            reduce_itemsize, latency_scale, flatten = self.edge_collective_policy(e)
            table = redistribute_table(meta["shape"], itemsize(meta["dtype"]), srcs, dsts,
                                       self.mesh_shape, self.hw, reduce_itemsize=reduce_itemsize,
                                       latency_scale=latency_scale, flatten=flatten)
            times = int(self.edge_times[e])
            if times != 1:
                table = table * times
        else:
            table = np.zeros((len(srcs), len(dsts)))
        transition = np.where(placements_differ(srcs, dsts), TRANSITION_COST, 0.0)
        fusion = np.zeros(table.shape)
        if self.fusion is not None:
            fusion = self.fusion.add_term(e, fusion, srcs, dsts)
        return row_cls, col_cls, table, transition, fusion


def _classes(texts: list[str], ndim: int) -> tuple[np.ndarray, list]:
    """(class index per text int32 [len(texts)], the distinct texts parsed, numbered by
    first occurrence)."""
    index: dict[str, int] = {}
    cls = np.empty(len(texts), dtype=np.int32)
    for k, t in enumerate(texts):
        cls[k] = index.setdefault(t, len(index))
    placements = [parse_placements(t, ndim) for t in index]
    return cls, placements

