"""Stage 3 - costs: the placement MRF, complete: unary and pairwise factors and the
constraint rows.

Objective (the same words as pipeline/solvers/mrf.py)::

    E(x) = sum_v U_v(x_v) + sum_e B_e(x_u, x_v)

* ``U_v(k)``: compute cost of node v under strategy k, the roofline
  ``max(FLOPs / (peak * eff_c), bytes / (HBM_bw * eff_m))`` on the *local*
  (sharded) shapes, floored at the kernel launch floor, 0 for views
  (pipeline/costmodel/compute.py).
* ``B_e(i, j)`` for edge e = (producer u, consumer v, argument a): the cost of
  redistributing u's output placement under i into v's expected placement for
  argument a under j (pipeline/costmodel/redistribute.py; +inf when DTensor
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

Groups (topology stage) turn node factors into group factors: a group's unary
is the sum of its members' unaries; an edge whose two ends are in the same
group contributes its diagonal ``B(k, k)`` to that unary; edges between two
groups accumulate into one factor over the joint classes of the member edges.
Every sum runs in graph-edge order, so eager and lazy costs give bit-identical
factors.

The MRF also carries the parameter-memory budget row
(``constraints.param_memory``, pipeline/memory/budget.py) and, with
``constraints.device_memory``, the device-memory row (bytes per device of parameters,
gradients, optimizer state, buffers and saved activations: pipeline/memory/), both
built here with the unaries. Activation checkpointing
(``memory.activation_checkpointing``) makes the recomputed forward ops and edges of
each repeated layer count twice (:class:`CostModel` ``recompute``).

Eager: every factor is computed here, one table per graph edge, and the complete
MRF (with its rows) is written to ``factors.npz``; ``costs.json`` holds the counts and
the budget's facts. Lazy: only the resolved cost model (``costs.json``) is written;
the solve stage builds the MRF with :func:`build_mrf` (:func:`load_costs`), the
solver asks for a group factor on first use, and edge tables are memoised by
signature (shape, dtype, placement classes), so the copies of a repeated layer share
one table. A lazy group factor gathers one member edge per edge class
(:meth:`CostModel.edge_classes`) and adds it once per member, in graph-edge order, so
its cost grows with depth only by those additions and the values equal the eager ones
bit for bit.

Phases: ``factor_build`` is the time spent building pairwise group factors
(:attr:`FactorProvider.factor_seconds`), in the costs stage when eager, inside the
solver when lazy; ``cost_build`` is the rest of the cost work (reading the topology,
unaries, the budget row, writing or reading ``factors.npz``). The explanation of a
plan (per-node cost parts, redistributions) is pipeline/costmodel/breakdown.py.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core import artifacts, progress, runtime
from pipeline.core.artifacts import (  # noqa: F401 - file names and the factors.npz format
    COSTS,
    COSTS_FILE,
    FACTORS,
    FACTORS_FILE,
    load_factors,
    save_factors,
)
from pipeline.core.ir import TENSOR_REF_RE as _REF_RE
from pipeline.core.ir import decode_shared as _decode_shared
from pipeline.core.ir import tensor_refs as _refs_in
from pipeline.core.ir import with_shapes as _with_shapes
from pipeline.dtensor.placements import local_shape, parse_output, parse_placements
from pipeline.memory.budget import ParamBudget, check_budget_feasible, param_budget
from pipeline.solvers.mrf import MRF, PairwiseFactor
from pipeline.stages.topology import TopologyTables, read_topology

log = logging.getLogger(__name__)

TRANSITION_COST = 1.0
_NO_COMPUTE = ("placeholder", "getitem", "output")
def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (``bfloat16`` -> 2), from ``torch.dtype.itemsize``.

    Raises ValueError for a name that is not a torch dtype.
    """
    import torch

    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return dt.itemsize


def _numel(shape: tuple) -> int:
    return math.prod(shape) if shape else 1


@dataclass
class FactorStats:
    """Counters reported in the run record."""

    unary_vectors: int = 0
    edge_tables: int = 0
    group_factors: int = 0


class CostModel:
    """Node-level unary vectors and edge tables over placement classes.

    Args:
        topology: topology tables (pipeline.stages.topology.read_topology).
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
    """

    def __init__(self, topology: TopologyTables, hw: Any, memoise: bool,
                 recompute: tuple[np.ndarray, np.ndarray] | None = None,
                 collectives: Any = None,
                 fuse_pointwise: bool = False):
        from pipeline.costmodel.hardware import as_hardware

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
            from pipeline.costmodel.fusion import PointwiseFusion

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
            from pipeline.costmodel.fsdp import edge_policy
            from pipeline.memory.graph import step_graph

            self.policy = edge_policy(topology, step_graph(topology), collectives,
                                      self.in_metas)
            # a re-gathered weight edge is paid twice; recomputation reads that copy
            self.edge_times = np.maximum(self.edge_times,
                                         1 + self.policy.regather.astype(np.int64))

    # -- classes ----------------------------------------------------------------------------

    def out_classes(self, node: int, element: int) -> tuple[np.ndarray, list]:
        """(class index per strategy int32 [K], distinct output placements)."""
        s = self.slist[node]
        key = (s, element)
        hit = self._out_cls.get(key)
        if hit is None:
            texts = self.topology.slist_outputs[s]
            if element >= 0:
                texts = [_element_text(t, element, self.ndim) for t in texts]
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
                        str(self.slist[node])))
        times = int(self.node_times[node])
        hit = self._unary_memo.get(key)
        if hit is None:
            hit = self._unary_uncached(node)
            op_comm = self._op_comm_uncached(node)
            if op_comm is not None:  # collectives inside the op (vocab-parallel softmax)
                hit = hit + op_comm
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
        from pipeline.costmodel.op_comm import SOFTMAX_ALL_REDUCES, op_collectives, op_comm_us

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

    def _unary_uncached(self, node: int) -> np.ndarray:
        from pipeline.costmodel.compute import is_view_op, op_flops, roofline_us

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
                nbytes = sum(_numel(sh) * b for sh, b in zip(loc_in, in_size))
                nbytes += sum(_numel(sh) * b for sh, b in zip(loc_out, out_size)
                              if sh is not None)
                flops = op_flops(target, _with_shapes(args, loc_in),
                                 _with_shapes(kwargs, loc_in, n_args),
                                 loc_out if len(loc_out) > 1 else loc_out[0]) if aten else 0.0
                cost = memo[key] = float(roofline_us(flops, nbytes, dtype, self.hw, False))
            costs[k] = cost
        return costs

    # -- pairwise ---------------------------------------------------------------------------

    def _edge_key(self, e: int) -> tuple:
        u, element, v, a = self.edges[e]
        meta = self.in_metas[v][a]
        key = (tuple(meta["shape"]), meta["dtype"], self.slist[u], element, self.slist[v], a,
               int(self.edge_times[e]), self.edge_collective_policy(e))
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
        from pipeline.costmodel.redistribute import placements_differ, redistribute_table

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
            # ---- pointwise fusion (pipeline/costmodel/fusion.py): its term, one call ----
            if self.fusion is not None:
                table = self.fusion.add_term(e, table, srcs, dsts)
            self.stats.edge_tables += 1
            if self.memoise:
                self._table_memo[key] = table
        return row_cls, col_cls, table


def _classes(texts: list[str], ndim: int) -> tuple[np.ndarray, list]:
    index: dict[str, int] = {}
    cls = np.empty(len(texts), dtype=np.int32)
    for k, t in enumerate(texts):
        cls[k] = index.setdefault(t, len(index))
    placements = [parse_placements(t, ndim) for t in index]
    return cls, placements


def _element_text(text: str, element: int, ndim: int) -> str:
    """Placement of one element of a tuple output; an element DTensor leaves
    unsharded (``-``, e.g. SDPA's RNG state) is a plain tensor on every rank,
    i.e. Replicate."""
    if not text.startswith("("):
        return text
    part = text[1:-1].split("|")[element]
    return "R" * ndim if part == "-" else part


# --------------------------------------------------------------------------- group MRF


@dataclass
class GroupStructure:
    """How graph nodes and edges fold into groups (no costs)."""

    group_of: np.ndarray  # int64 [num_nodes]
    members: list[list[int]]  # per group, node ids in order
    domain: np.ndarray  # int64 [G]
    edges: np.ndarray  # int64 [E, 2] (lo, hi)
    edge_members: list[list[tuple[int, bool]]]  # per group edge: (graph edge, flipped)
    self_edges: list[list[int]]  # per group: graph edges inside it
    num_graph_edges: int = 0
    extra: dict = field(default_factory=dict)


def group_structure(topology: TopologyTables) -> GroupStructure:
    """Fold the node graph into the group graph (see module docstring)."""
    n = topology.nodes
    group_of = np.asarray(n["group"], dtype=np.int64)
    num_groups = int(group_of.max()) + 1 if len(group_of) else 0
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for node, g in enumerate(group_of.tolist()):
        members[g].append(node)
    domain = np.array([n["num_strategies"][m[0]] for m in members], dtype=np.int64)
    index: dict[tuple[int, int], int] = {}
    pairs: list[tuple[int, int]] = []
    edge_members: list[list[tuple[int, bool]]] = []
    self_edges: list[list[int]] = [[] for _ in range(num_groups)]
    e = topology.edges
    for k, (u, v) in enumerate(zip(e["producer"], e["consumer"])):
        gu, gv = int(group_of[u]), int(group_of[v])
        if gu == gv:
            self_edges[gu].append(k)
            continue
        key = (min(gu, gv), max(gu, gv))
        if key not in index:
            index[key] = len(pairs)
            pairs.append(key)
            edge_members.append([])
        edge_members[index[key]].append((k, gu > gv))
    return GroupStructure(group_of, members, domain,
                          np.asarray(pairs, dtype=np.int64).reshape(len(pairs), 2),
                          edge_members, self_edges, len(e["producer"]))


#: Below this many edge-table entries the group factors are built in one process (a
#: fork costs tens of milliseconds; llama1b on 8x8 has ~5 M, the toy model ~0.1 M).
PARALLEL_MIN_WORK = 1_000_000


class FactorProvider:
    """Computes group unaries and group factors from a CostModel, memoised.

    ``factor(e)`` is the MRF's pairwise callable; in lazy mode it is called by
    the solver on first use. ``factor_seconds`` accumulates the time spent building
    pairwise group factors (the ``factor_build`` phase), ``unary_seconds`` the time
    spent on the group unaries.
    """

    def __init__(self, cost_model: CostModel, groups: GroupStructure):
        self.cost_model = cost_model
        self.groups = groups
        self._factors: dict[int, PairwiseFactor] = {}
        self._readers: dict[int, int] | None = None
        self.unary_seconds = 0.0
        self.factor_seconds = 0.0

    def _read(self, classes: set[int], edge_of: dict[int, int]) -> None:
        """Memoised costs: one group factor that read the edge classes ``classes`` is
        built; a class no unbuilt group factor reads leaves the cost model's memo
        (:meth:`CostModel.forget`; ``edge_of``: a member edge of each class)."""
        if self._readers is None:
            cls = self.cost_model.edge_classes()
            self._readers = {}
            for members in self.groups.edge_members:
                for c in {int(cls[e]) for e, _ in members}:
                    self._readers[c] = self._readers.get(c, 0) + 1
        for c in classes:
            self._readers[c] -= 1
            if self._readers[c] == 0:
                self.cost_model.forget(edge_of[c])

    @property
    def num_built(self) -> int:
        """Group factors built so far."""
        return len(self._factors)

    def unaries(self) -> list[np.ndarray]:
        start = time.perf_counter()
        out = []
        for g, mem in enumerate(self.groups.members):
            u = np.zeros(int(self.groups.domain[g]))
            for node in mem:
                u = u + self.cost_model.unary(node)
            for e in self.groups.self_edges[g]:
                r, c, t = self.cost_model.edge_table(e)
                u = u + t[r, c]
            out.append(u)
        self.unary_seconds += time.perf_counter() - start
        return out

    def factor(self, ge: int) -> PairwiseFactor:
        hit = self._factors.get(ge)
        if hit is not None:
            return hit
        start = time.perf_counter()
        members = self.groups.edge_members[ge]
        # Distinct member edges: with memoised costs, one per (edge class, flipped), so
        # the copies of a repeated layer are gathered once; eager costs keep one per
        # graph edge (its own table), so lazy == eager checks the class key. Dropping
        # repeated class columns leaves the joint classes (np.unique over rows, in
        # lexicographic order) and their order unchanged.
        if self.cost_model.memoise:
            cls = self.cost_model.edge_classes()
            slot: dict[tuple[int, bool], int] = {}
            seq = [slot.setdefault((int(cls[e]), flipped), len(slot)) for e, flipped in members]
            distinct = [None] * len(slot)
            for (e, flipped), k in zip(members, seq):
                if distinct[k] is None:
                    distinct[k] = (e, flipped)
        else:
            seq = list(range(len(members)))
            distinct = list(members)
        rows, cols, tables = [], [], []
        for e, flipped in distinct:
            r, c, t = self.cost_model.edge_table(e)
            if flipped:
                r, c, t = c, r, t.T
            rows.append(r)
            cols.append(c)
            tables.append(t)
        if len(members) == 1:
            f = PairwiseFactor(rows[0], cols[0], np.ascontiguousarray(tables[0]))
        else:
            ur, rinv = np.unique(np.stack(rows, axis=1), axis=0, return_inverse=True)
            uc, cinv = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
            # graph-edge order, one addition per member edge; each member's part is
            # gathered when it is added (no list of [R, C] parts) and added in place
            # (the same sums as ``table = table + part``)
            table = np.zeros((len(ur), len(uc)))
            for k in seq:
                np.add(table, tables[k][np.ix_(ur[:, k], uc[:, k])], out=table)
            f = PairwiseFactor(rinv.reshape(-1).astype(np.int32),
                               cinv.reshape(-1).astype(np.int32), table)
        self._factors[ge] = f
        if self.cost_model.memoise:
            cls = self.cost_model.edge_classes()
            self._read({int(cls[e]) for e, _ in members},
                       {int(cls[e]): e for e, _ in members})
        self.cost_model.stats.group_factors += 1
        if self.cost_model.memoise and len(self._factors) == len(self.groups.edge_members):
            self._release()
        self.factor_seconds += time.perf_counter() - start
        return f

    def _release(self) -> None:
        """Every group factor exists: drop the redistribution planner's caches (pair
        records, plans, interned placements: pipeline/costmodel/redistribute/interner.py;
        recomputed, with equal values, if asked again) and return the freed heap."""
        from pipeline.costmodel.redistribute import clear_caches

        clear_caches()
        runtime.release_free_memory()

    def share(self, ge: int, table: np.ndarray) -> None:
        """:attr:`MRF.share`: keep ``table`` (a solver's copy, equal to group factor
        ``ge``'s table) in place of the factor's own, which is then freed: the tables
        live once, in the solver's store."""
        f = self._factors.get(ge)
        if f is not None and f.table.shape == table.shape:
            self._factors[ge] = PairwiseFactor(f.row_cls, f.col_cls, table)
        if ge == len(self.groups.edge_members) - 1:  # the solver offers in edge order
            runtime.release_free_memory()

    def materialise_all(self, workers: int = 1) -> list[PairwiseFactor]:
        """Every group factor, in group-edge order; a progress bar on a terminal
        (pipeline/core/progress.py) when built in this process alone. ``workers`` > 1 builds
        them in that many processes (:meth:`build_parallel`)."""
        edges = range(len(self.groups.edge_members))
        if workers > 1:
            self.build_parallel(workers, PARALLEL_MIN_WORK)
        with progress.bar(edges, desc="costs: factors", unit="factor") as bar:
            return [self.factor(e) for e in bar]

    def work_chunks(self, parts: int) -> tuple[list[list[int]], float]:
        """The unbuilt group factors split into at most ``parts`` chunks of about equal
        work, for :meth:`build_parallel`, and the total work (table entries).

        The redistribution planner's caches are per tensor rank (one
        :class:`~pipeline.costmodel.redistribute.tables.TableContext` per mesh and
        ndim): the pairs planned for one table are reused by every other table of that
        rank. So the factors are grouped by the ranks of their member tensors (factors
        with a rank in common in one group: union-find) and whole groups go to the
        chunks, heaviest first; a factor's work is the size of its distinct member
        edge tables."""
        from pipeline.core.parallel import balanced_chunks

        todo = [ge for ge in range(len(self.groups.edge_members)) if ge not in self._factors]
        cm = self.cost_model
        cls = cm.edge_classes() if cm.memoise else None
        parent: dict[int, int] = {}

        def root(k: int) -> int:
            parent.setdefault(k, k)
            while parent[k] != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k

        rank_of: dict[int, int] = {}  # factor -> one of its member tensors' ranks
        work: dict[int, float] = {}
        seen: set[int] = set()
        for ge in todo:
            for e, _ in self.groups.edge_members[ge]:
                u, element, v, a = cm.edges[e]
                ndim = len(cm.in_metas[v][a]["shape"])
                if ge in rank_of:
                    parent[root(ndim)] = root(rank_of[ge])
                else:
                    rank_of[ge] = ndim
                    root(ndim)
                key = int(cls[e]) if cls is not None else -1 - e
                if key not in seen:
                    seen.add(key)
                    work[ge] = work.get(ge, 0.0) + float(
                        len(cm.out_classes(u, element)[1]) * len(cm.in_classes(v, a)[1]))
        groups: dict[int, list[int]] = {}
        for ge in todo:
            groups.setdefault(root(rank_of.get(ge, -1)), []).append(ge)
        keys = sorted(groups, key=lambda r: groups[r][0])
        weight = [sum(work.get(ge, 0.0) for ge in groups[r]) + 1.0 for r in keys]
        chunks = balanced_chunks(weight, parts)
        return ([sorted(ge for c in chunk for ge in groups[keys[c]]) for chunk in chunks],
                float(sum(work.values())))

    def build_parallel(self, workers: int, min_work: float = 0.0) -> None:
        """Build every unbuilt group factor in ``workers`` processes (pipeline/core/parallel.py:
        forked children inherit this provider); the tables are those :meth:`factor`
        builds in this process (the same code on the same inputs). The counters add the
        children's work; ``factor_seconds`` grows by the wall time."""
        from pipeline.core.parallel import map_chunks

        if workers <= 1:
            return
        chunks, work = self.work_chunks(workers)
        if len(chunks) <= 1 or work < min_work:
            return
        start = time.perf_counter()
        before = self.factor_seconds
        stats = self.cost_model.stats

        def build(chunk: list[int]) -> tuple[list[tuple[int, PairwiseFactor]], int, int]:
            tables, factors = stats.edge_tables, stats.group_factors
            built = [(ge, self.factor(ge)) for ge in chunk]
            return built, stats.edge_tables - tables, stats.group_factors - factors

        results = map_chunks(build, chunks)
        for built, tables, factors in results[1:]:  # the first chunk ran here
            for ge, f in built:
                self._factors[ge] = f
            stats.edge_tables += tables
            stats.group_factors += factors
        if self.cost_model.memoise and len(self._factors) == len(self.groups.edge_members):
            self._release()
        self.factor_seconds = before + time.perf_counter() - start


# --------------------------------------------------------------------------- the stage


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

    def cost_model(self) -> CostModel:
        """The cost model to explain a plan with (pipeline/costmodel/breakdown.py): lazy, the one
        behind the factors (its memoised tables are reused); eager, a new memoising
        one over the same topology and hardware (same values)."""
        if self.factor_provider is not None:
            return self.factor_provider.cost_model
        recompute = self.memory.recompute() if self.memory is not None else None
        return CostModel(self.topology, self.hardware, memoise=True, recompute=recompute,
                         collectives=self.collectives,
                         fuse_pointwise=self.fuse_pointwise)

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
              fuse_pointwise: bool = False, workers: int = 1) -> Costs:
    """The complete group MRF of a topology; lazy leaves pairwise factors to first use.

    ``param_memory``: ``constraints.param_memory`` as plain data (``{low, high}``), or
    None for no budget row. ``memory``: the
    :class:`~pipeline.memory.options.MemoryOptions` of the step (None: no memory model, no
    recomputation); ``device_memory``: ``(bytes, text)`` of
    ``constraints.device_memory`` or ``(None, None)`` for no device-memory row.
    ``collectives``: the :class:`~pipeline.costmodel.fsdp.CollectiveOptions` (FSDP2
    buckets, re-gather, reduce dtype), or None for DTensor's one collective per tensor.
    ``fuse_pointwise``: the pointwise-fusion term (``costs.fuse_pointwise``).
    ``workers``: processes that build the factors of eager costs (pipeline/core/parallel.py).

    Raises:
        PlanError: the pins leave the budget infeasible, or no allowed plan fits the
            device memory (before any factor is built).
    """
    groups = group_structure(topology)
    model = None
    if memory is not None:
        from pipeline.memory.model import memory_model

        model = memory_model(topology, groups.group_of, groups.domain, memory,
                             device_memory[0], device_memory[1])
    cost_model = CostModel(topology, hw, memoise=lazy,
                           recompute=model.recompute() if model is not None else None,
                           collectives=collectives,
                           fuse_pointwise=fuse_pointwise)
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
        from pipeline.memory.constraint import check_feasible, memory_row

        coef = model.coef()
        check_feasible(coef, allowed_unaries(mrf), model.limit, str(model.limit_text))
        mrf.linear_constraints = [*mrf.linear_constraints, memory_row(coef, model.limit)]
    if not lazy:
        provider.materialise_all(workers)
    return Costs(mrf, budget, provider, topology, hw, memory=model, collectives=collectives,
                 fuse_pointwise=fuse_pointwise)


def allowed_unaries(mrf: MRF) -> list[np.ndarray]:
    """The unaries with the labels an exactly tight row excludes set to +inf (the
    default parameter budget allows only each parameter's most sharded placements):
    finite entries are the labels a plan may use."""
    from dataclasses import replace

    from pipeline.solvers.lagrangian import tighten

    out = replace(mrf, linear_constraints=[])
    for row in mrf.linear_constraints:
        out, _ = tighten(out, row)
    return list(out.unary)


def param_memory_config(cfg: Any) -> dict[str, Any] | None:
    """``constraints.param_memory`` of a resolved config as plain data (None: no budget)."""
    from omegaconf import OmegaConf

    pm = cfg.constraints.param_memory
    return None if pm is None else OmegaConf.to_container(pm, resolve=True)


def memory_config(cfg: Any) -> dict[str, Any]:
    """The step-model keyword arguments of :func:`build_mrf` from a resolved config:
    ``memory`` (optimizer, checkpointing, FSDP resharding), ``device_memory`` and
    ``collectives`` (FSDP2's buckets, re-gather and reduce dtype)."""
    from pipeline.costmodel.fsdp import collective_options_of_config
    from pipeline.memory.options import device_memory_of_config, options_of_config

    return {"memory": options_of_config(cfg), "device_memory": device_memory_of_config(cfg),
            "collectives": collective_options_of_config(cfg)}


def fuse_pointwise_config(cfg: Any) -> bool:
    """``costs.fuse_pointwise`` of a resolved config (False when the key is absent)."""
    costs = cfg.get("costs")
    return bool(costs.get("fuse_pointwise", False)) if costs is not None else False


def workers_config(cfg: Any) -> int:
    """Processes for the independent parts of a stage (``workers``; 1 when absent)."""
    from pipeline.core.parallel import resolve_workers

    return resolve_workers(int(cfg.get("workers", 1)))


def load_costs(cfg: Any, topology: TopologyTables, costs_dir: Path) -> Costs:
    """The costs of a run for the solve stage: eager, the MRF of ``factors.npz`` and the
    budget facts of ``costs.json``; lazy, :func:`build_mrf` (factors on first use)."""
    record = artifacts.read_json(COSTS, costs_dir)
    if bool(cfg.lazy_costs):
        costs = build_mrf(topology, cfg.hardware, lazy=True,
                          param_memory=param_memory_config(cfg), **memory_config(cfg),
                          fuse_pointwise=fuse_pointwise_config(cfg))
    else:
        from pipeline.memory.model import memory_model

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
                      fuse_pointwise=fuse_pointwise_config(cfg))
    costs.record = record
    return costs


def run_costs(cfg: Any, topology_dir: Path, out_dir: Path) -> None:
    """Stage entry point. Eager: build the complete MRF and write ``factors.npz``; both:
    ``costs.json`` last (with the eager counts and the budget's facts)."""
    from omegaconf import OmegaConf

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
