"""Stage 3 - costs: unary and pairwise factors of the placement MRF.

Objective (DESIGN.md "Words")::

    E(x) = sum_v U_v(x_v) + sum_e B_e(x_u, x_v)

* ``U_v(k)``: compute cost of node v under strategy k, the roofline
  ``max(FLOPs / (peak * eff_c), bytes / (HBM_bw * eff_m))`` on the *local*
  (sharded) shapes, floored at the kernel launch floor, 0 for views
  (pipeline/costmodel/compute.py).
* ``B_e(i, j)`` for edge e = (producer u, consumer v, argument a): the cost of
  redistributing u's output placement under i into v's expected placement for
  argument a under j (pipeline/costmodel/redistribute.py; +inf when DTensor
  forbids it), plus the transition cost 1.0 when the two placements differ.

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

Eager: every factor is computed here, one table per graph edge, and written to
``factors.npz``. Lazy: only the resolved cost model (``costs.json``) is
written; the solver asks for a group factor on first use, and edge tables are
memoised by signature (shape, dtype, placement classes), so the copies of a
repeated layer share one table. A lazy group factor gathers one member edge per
edge class (:meth:`CostModel.edge_classes`) and adds it once per member, in
graph-edge order, so its cost grows with depth only by those additions and the
values equal the eager ones bit for bit.
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

from pipeline import progress, runtime
from pipeline.ir import TENSOR_REF_RE as _REF_RE
from pipeline.ir import decode_shared as _decode_shared
from pipeline.ir import tensor_refs as _refs_in
from pipeline.ir import with_shapes as _with_shapes
from pipeline.placements import local_shape, parse_output, parse_placements
from pipeline.solvers.mrf import MRF, PairwiseFactor
from pipeline.topology import TopologyTables, read_topology

log = logging.getLogger(__name__)

COSTS_FILE = "costs.json"
FACTORS_FILE = "factors.npz"
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
    seconds: float = 0.0


class CostModel:
    """Node-level unary vectors and edge tables over placement classes.

    Args:
        tt: topology tables (pipeline.topology.read_topology).
        hw: HardwareConfig (or a DictConfig with the same fields).
        memoise: memoise edge tables by signature (lazy mode); eager mode
            computes one table per graph edge.
    """

    def __init__(self, tt: TopologyTables, hw: Any, memoise: bool):
        self.tt = tt
        self.hw = hw
        self.memoise = memoise
        self.mesh_shape = tuple(int(s) for s in tt.summary["mesh"])
        self.ndim = len(self.mesh_shape)
        n = tt.nodes
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
        self._table_memo: dict[tuple, np.ndarray] = {}
        e = tt.edges
        self.edges = list(zip(e["producer"], e["element"], e["consumer"], e["arg"]))
        self._edge_cls: np.ndarray | None = None

    # -- classes ----------------------------------------------------------------------------

    def out_classes(self, node: int, element: int) -> tuple[np.ndarray, list]:
        """(class index per strategy int32 [K], distinct output placements)."""
        s = self.slist[node]
        key = (s, element)
        hit = self._out_cls.get(key)
        if hit is None:
            texts = self.tt.slist_outputs[s]
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
            texts = [ins[arg] for ins in self.tt.slist_inputs[s]]
            hit = self._in_cls[key] = _classes(texts, self.ndim)
        return hit

    # -- unary ------------------------------------------------------------------------------

    def unary(self, node: int) -> np.ndarray:
        """Compute cost ``U_v`` (µs) per strategy of ``node``, float64 [K]."""
        hit = self._unary_of[node]
        if hit is not None:
            return hit
        target = self.target[node]
        if target in _NO_COMPUTE:
            return np.zeros(len(self.tt.slist_outputs[self.slist[node]]))
        # Memo key: the arguments with node references blanked (tensor arguments are
        # described by the metadata texts), so the copies of a repeated layer share one
        # vector.
        key = "|".join((target, _REF_RE.sub('{"node": 0}', self.args[node]),
                        _REF_RE.sub('{"node": 0}', self.kwargs[node]),
                        self._in_metas_text[node], self._out_metas_text[node],
                        str(self.slist[node])))
        hit = self._unary_memo.get(key)
        if hit is None:
            hit = self._unary_memo[key] = self._unary_uncached(node)
            self.stats.unary_vectors += 1
        self._unary_of[node] = hit
        return hit

    def _unary_uncached(self, node: int) -> np.ndarray:
        from pipeline.costmodel.compute import is_view_op, op_flops, roofline_us

        s = self.slist[node]
        outs, ins = self.tt.slist_outputs[s], self.tt.slist_inputs[s]
        target = self.target[node]
        if is_view_op(target):
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
                                 loc_out if len(loc_out) > 1 else loc_out[0])
                cost = memo[key] = float(roofline_us(flops, nbytes, dtype, self.hw, False))
            costs[k] = cost
        return costs

    # -- pairwise ---------------------------------------------------------------------------

    def _edge_key(self, e: int) -> tuple:
        u, element, v, a = self.edges[e]
        meta = self.in_metas[v][a]
        return (tuple(meta["shape"]), meta["dtype"], self.slist[u], element, self.slist[v], a)

    def edge_classes(self) -> np.ndarray:
        """Class id per graph edge, int64 ``[E]``, numbered by first occurrence.

        Two edges are in one class when they carry a tensor of the same shape and
        dtype between the same producer strategy list and output element and the same
        consumer strategy list and argument (the copies of a repeated layer): then
        :meth:`edge_table` gives them equal ``(row_cls, col_cls, table)``.
        """
        if self._edge_cls is None:
            index: dict[tuple, int] = {}
            self._edge_cls = np.fromiter(
                (index.setdefault(self._edge_key(e), len(index)) for e in range(len(self.edges))),
                dtype=np.int64, count=len(self.edges))
        return self._edge_cls

    def edge_table(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(row_cls [K_u], col_cls [K_v], table [R, C])`` of graph edge ``e`` (µs)."""
        from pipeline.costmodel.redistribute import placements_differ, redistribute_table

        u, element, v, a = self.edges[e]
        row_cls, srcs = self.out_classes(u, element)
        col_cls, dsts = self.in_classes(v, a)
        meta = self.in_metas[v][a]
        key = self._edge_key(e)
        table = self._table_memo.get(key) if self.memoise else None
        if table is None:
            table = redistribute_table(meta["shape"], itemsize(meta["dtype"]), srcs, dsts,
                                       self.mesh_shape, self.hw)
            differ = placements_differ(srcs, dsts)
            table = table + np.where(differ, TRANSITION_COST, 0.0)
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


def group_structure(tt: TopologyTables) -> GroupStructure:
    """Fold the node graph into the group graph (see module docstring)."""
    n = tt.nodes
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
    e = tt.edges
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


class FactorProvider:
    """Computes group unaries and group factors from a CostModel, memoised.

    ``factor(e)`` is the MRF's pairwise callable; in lazy mode it is called by
    the solver on first use. ``seconds`` accumulates the time spent building
    factors (reported as the ``factor_build`` phase).
    """

    def __init__(self, cm: CostModel, gs: GroupStructure):
        self.cm = cm
        self.gs = gs
        self._factors: dict[int, PairwiseFactor] = {}
        self.seconds = 0.0

    def unaries(self) -> list[np.ndarray]:
        start = time.perf_counter()
        out = []
        for g, mem in enumerate(self.gs.members):
            u = np.zeros(int(self.gs.domain[g]))
            for node in mem:
                u = u + self.cm.unary(node)
            for e in self.gs.self_edges[g]:
                r, c, t = self.cm.edge_table(e)
                u = u + t[r, c]
            out.append(u)
        self.seconds += time.perf_counter() - start
        return out

    def factor(self, ge: int) -> PairwiseFactor:
        hit = self._factors.get(ge)
        if hit is not None:
            return hit
        start = time.perf_counter()
        members = self.gs.edge_members[ge]
        # Distinct member edges: with memoised costs, one per (edge class, flipped), so
        # the copies of a repeated layer are gathered once; eager costs keep one per
        # graph edge (its own table), so lazy == eager checks the class key. Dropping
        # repeated class columns leaves the joint classes (np.unique over rows, in
        # lexicographic order) and their order unchanged.
        if self.cm.memoise:
            cls = self.cm.edge_classes()
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
            r, c, t = self.cm.edge_table(e)
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
            parts = [t[np.ix_(ur[:, k], uc[:, k])] for k, t in enumerate(tables)]
            table = np.zeros((len(ur), len(uc)))
            for k in seq:  # graph-edge order, one addition per member edge
                table = table + parts[k]
            f = PairwiseFactor(rinv.reshape(-1).astype(np.int32),
                               cinv.reshape(-1).astype(np.int32), table)
        self._factors[ge] = f
        self.cm.stats.group_factors += 1
        self.seconds += time.perf_counter() - start
        return f

    def materialise_all(self) -> list[PairwiseFactor]:
        """Every group factor, in group-edge order (eager costs); a progress bar on a
        terminal (pipeline/progress.py)."""
        edges = range(len(self.gs.edge_members))
        with progress.bar(edges, desc="costs: factors", unit="factor") as bar:
            return [self.factor(e) for e in bar]


def build_mrf(tt: TopologyTables, hw: Any, lazy: bool) -> tuple[MRF, FactorProvider]:
    """The group MRF of a topology; lazy leaves pairwise factors to first use."""
    cm = CostModel(tt, hw, memoise=lazy)
    gs = group_structure(tt)
    fp = FactorProvider(cm, gs)
    unary = fp.unaries()
    if not lazy:
        fp.materialise_all()
    mrf = MRF(domain_sizes=gs.domain.copy(), unary=unary, edges=gs.edges.copy(),
              factor=fp.factor)
    return mrf, fp


# --------------------------------------------------------------------------- artifacts


def save_factors(path: Path, mrf: MRF, factors: list[PairwiseFactor]) -> None:
    """Write every unary and pairwise factor to ``factors.npz`` (atomically)."""
    uoff = np.cumsum([0] + [len(u) for u in mrf.unary])
    roff = np.cumsum([0] + [len(f.row_cls) for f in factors])
    coff = np.cumsum([0] + [len(f.col_cls) for f in factors])
    toff = np.cumsum([0] + [f.table.size for f in factors])
    tshape = np.array([f.table.shape for f in factors], dtype=np.int64).reshape(len(factors), 2)
    def cat(xs: list, dt: Any) -> np.ndarray:
        return np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)

    with runtime.atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, domain=mrf.domain_sizes, edges=mrf.edges,
                     unary=cat(list(mrf.unary), np.float64), unary_off=uoff,
                     row=cat([f.row_cls for f in factors], np.int32), row_off=roff,
                     col=cat([f.col_cls for f in factors], np.int32), col_off=coff,
                     table=cat([f.table.ravel() for f in factors], np.float64), table_off=toff,
                     table_shape=tshape, constant=np.array([mrf.constant]))


def load_factors(path: Path) -> MRF:
    """Read ``factors.npz`` back into an eager MRF (bit-identical values)."""
    with np.load(path) as npz:  # NpzFile re-reads (and copies) an array on every z[key]
        z = {k: npz[k] for k in npz.files}
    uoff, roff, coff, toff = z["unary_off"], z["row_off"], z["col_off"], z["table_off"]
    unary = [z["unary"][uoff[g]:uoff[g + 1]] for g in range(len(uoff) - 1)]
    factors = []
    for e in range(len(roff) - 1):
        shape = tuple(z["table_shape"][e])
        factors.append(PairwiseFactor(z["row"][roff[e]:roff[e + 1]],
                                      z["col"][coff[e]:coff[e + 1]],
                                      z["table"][toff[e]:toff[e + 1]].reshape(shape)))
    return MRF(domain_sizes=z["domain"], unary=unary, edges=z["edges"],
               factor=factors.__getitem__, constant=float(z["constant"][0]))


def run_costs(cfg: Any, topology_dir: Path, out_dir: Path) -> None:
    """Stage entry point. Eager: write ``factors.npz``; both: ``costs.json`` last."""
    from omegaconf import OmegaConf

    timer = runtime.PhaseTimer()
    lazy = bool(cfg.lazy_costs)
    hw = cfg.hardware
    counts: dict[str, Any] = {}
    if not lazy:
        with timer.phase("cost_build"):
            tt = read_topology(Path(topology_dir))
            mrf, fp = build_mrf(tt, hw, lazy=False)
        with timer.phase("factor_build"):
            factors = fp.materialise_all()
            save_factors(Path(out_dir) / FACTORS_FILE, mrf, factors)
        counts = {"unary_vectors": fp.cm.stats.unary_vectors,
                  "edge_tables": fp.cm.stats.edge_tables,
                  "group_factors": fp.cm.stats.group_factors,
                  "groups": mrf.num_groups, "group_edges": mrf.num_edges}
    runtime.write_json(Path(out_dir) / COSTS_FILE, {
        "stage": "costs", "mode": "lazy" if lazy else "eager",
        "hardware": OmegaConf.to_container(hw, resolve=True),
        "transition_cost": TRANSITION_COST, "counts": counts,
        "phase_seconds": timer.seconds, "peak_rss_bytes": runtime.peak_rss_bytes(),
        "git": runtime.git_revision()})
