"""Pointwise fusion: a chain of elementwise ops with one placement costs one memory pass
and one launch floor, as in any compiled step (TorchInductor, XLA fuse such chains).

The roofline unary (pipeline/costmodel/compute.py) costs every kernel alone: an
elementwise op ``v`` (no FLOP formula, so memory-bound) costs

    t_v(k) = max(M_v(k), floor),   M_v(k) = (bytes read + bytes written) / (hbm_bw * eff_m)

under strategy ``k``, on its local shapes. When ``v`` reads the output of another
elementwise op ``u`` and the edge's redistribution is the identity (the producer's
output placement *is* the consumer's expected placement), a fused kernel computes
``v`` right after ``u`` without reading the intermediate back from memory and
without a launch of its own. This module prices that as a *pairwise* term on the
edge e = (u, v, argument a), so the MRF the solvers see holds it exactly:

    F_e(i, j) = -times_e * ( [e designated] * f_v(j) + r_e(j) )   if src_i == dst_j
    F_e(i, j) = 0                                                 otherwise

* ``r_e(j) = bytes of argument a on one device under dst_j / (hbm_bw * eff_m) * 1e6``:
  the read of the intermediate that fusion removes;
* ``f_v(j) = min over the consumer's strategies k with dst_j for argument a of
  max(floor - M_v(k), 0)``: the part of ``t_v`` above its memory time, i.e. the
  launch floor it no longer pays (exactly ``t_v(k) - M_v(k)``, as elementwise ops
  have no FLOPs; the minimum makes it a function of the edge's column class);
* the *designated* edge of a consumer is its lowest argument whose producer is an
  elementwise kernel: only that edge removes the floor, so a consumer with two fused
  inputs pays its floor away once;
* ``times_e = min(edge_times, node_times of v)`` (activation checkpointing runs a
  recomputed pair twice).

Bound: with every fusable in-edge of ``v`` fused, ``v`` keeps at least
``t_v(k) - f_v(k) - sum_a r_a(k) >= M_v(k) - sum_a r_a(k) =`` the time of its
remaining reads and its write ``>= 0``: no node goes below the roofline of what a
fused kernel still moves, and a chain keeps its head's full roofline (one launch
floor). The producer's write of the intermediate is kept (it may be saved for the
backward or read by an unfused consumer): a conservative choice.

Elementwise ops are those tagged ``torch.Tag.pointwise`` (add, mul, silu, rsqrt, neg,
silu_backward, ...) plus the dtype cast ``aten._to_copy``; views launch no kernel and
fuse with nothing (they cost 0 already). The term is off with
``costs.fuse_pointwise=false`` (docs/config.md).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from pipeline.core.dtypes import itemsize

__all__ = ["PointwiseFusion", "is_fusable_op"]

_CASTS = frozenset({"aten._to_copy.default"})
_FLOATING = frozenset({"float32", "bfloat16", "float16", "float64"})


@functools.lru_cache(maxsize=4096)
def is_fusable_op(target: str) -> bool:
    """Whether ``target`` (an op name of the graph IR) is an elementwise kernel."""
    if target in _CASTS:
        return True
    if not target.startswith("aten."):
        return False
    import torch

    from pipeline.core.ir import resolve_op
    from pipeline.costmodel.compute import is_view_op
    from pipeline.dtensor.torch_compat import OpOverload

    op = resolve_op(target, strict=False)
    if not isinstance(op, OpOverload) or is_view_op(op):
        return False
    return torch.Tag.pointwise in op.tags


class PointwiseFusion:
    """The fusion term of a :class:`~pipeline.costmodel.model.CostModel`'s edges
    (module docstring).

    ``edge_key(e)`` is what the term depends on beyond the cost model's edge key (the
    designation), so edges of one class get equal terms; ``add_term(e, table, srcs,
    dsts)`` adds the term to an edge table.
    """

    def __init__(self, cost_model: Any):
        self.cm = cost_model
        self._designated: dict[int, int] = {}  # consumer -> its designated argument
        self._in_edges: dict[int, list[int]] | None = None  # consumer -> edges, by arg
        self._floor: dict[tuple[int, int], np.ndarray] = {}  # (slist, arg) -> f_v per class
        self._bw: float | None = None
        self._floor_value: float | None = None

    def _bandwidth(self) -> float:
        """``hbm_bandwidth * memory_efficiency`` (bytes/s), read once."""
        if self._bw is None:
            self._bw = float(self.cm.hw.hbm_bandwidth) * float(self.cm.hw.memory_efficiency)
        return self._bw

    def _floor_us(self) -> float:
        if self._floor_value is None:
            self._floor_value = float(self.cm.hw.kernel_floor_us)
        return self._floor_value

    def fusable_edge(self, e: int) -> bool:
        """Both ends elementwise kernels, a single-tensor floating output."""
        u, element, v, a = self.cm.edges[e]
        if element != -1 or not is_fusable_op(self.cm.target[u]):
            return False
        if not is_fusable_op(self.cm.target[v]):
            return False
        return self.cm.in_metas[v][a]["dtype"] in _FLOATING

    def designated_arg(self, v: int) -> int:
        """The consumer's lowest argument fed by a fusable edge (-1: none)."""
        hit = self._designated.get(v)
        if hit is None:
            hit = -1
            if self._in_edges is None:
                self._in_edges = {}
                for k, (_, _, c, _) in enumerate(self.cm.edges):
                    self._in_edges.setdefault(int(c), []).append(k)
            for e in sorted(self._in_edges.get(v, []), key=lambda k: self.cm.edges[k][3]):
                if self.fusable_edge(e):
                    hit = int(self.cm.edges[e][3])
                    break
            self._designated[v] = hit
        return hit

    def edge_key(self, e: int) -> tuple:
        """``("fuse", designated)`` for a fusable edge, ``()`` otherwise."""
        if not self.fusable_edge(e):
            return ()
        v, a = self.cm.edges[e][2], self.cm.edges[e][3]
        return ("fuse", self.designated_arg(v) == a)

    def _floor_part(self, v: int, a: int) -> np.ndarray:
        """``f_v`` per column class of argument ``a`` (module docstring)."""
        from pipeline.dtensor.placements import local_shape, parse_output, parse_placements

        cm = self.cm
        key = (cm.slist[v], a)
        hit = self._floor.get(key)
        if hit is not None:
            return hit
        s = cm.slist[v]
        outs, ins = cm.topology.slist_outputs[s], cm.topology.slist_inputs[s]
        in_metas, out_metas = cm.in_metas[v], cm.out_metas[v]
        col_cls, dsts = cm.in_classes(v, a)
        floor = self._floor_us()
        part = np.full(len(dsts), np.inf)
        for k, (o, i) in enumerate(zip(outs, ins)):
            nbytes = 0
            for meta, text in zip(in_metas, i):
                sh = local_shape(meta["shape"], parse_placements(text, cm.ndim), cm.mesh_shape)
                nbytes += math.prod(sh) * itemsize(meta["dtype"])
            out_pl = parse_output(o, cm.ndim) if o.startswith("(") else [
                parse_placements(o, cm.ndim)]
            for meta, p in zip(out_metas, out_pl):
                if meta is not None and p is not None:
                    sh = local_shape(meta["shape"], p, cm.mesh_shape)
                    nbytes += math.prod(sh) * itemsize(meta["dtype"])
            f = max(floor - nbytes / self._bandwidth() * 1e6, 0.0)
            c = int(col_cls[k])
            part[c] = min(part[c], f)
        part[~np.isfinite(part)] = 0.0
        self._floor[key] = part
        return part

    def add_term(self, e: int, table: np.ndarray, srcs: list, dsts: list) -> np.ndarray:
        """``table + F_e`` (module docstring); ``table`` itself when the edge does not
        fuse."""
        from pipeline.costmodel.redistribute import placements_differ
        from pipeline.dtensor.placements import local_shape

        key = self.edge_key(e)
        if not key:
            return table
        cm = self.cm
        u, element, v, a = cm.edges[e]
        meta = cm.in_metas[v][a]
        size = itemsize(meta["dtype"])
        bw = self._bandwidth()
        read = np.array([math.prod(local_shape(meta["shape"], d, cm.mesh_shape)) * size
                         for d in dsts], dtype=np.float64) / bw * 1e6
        saving = read + self._floor_part(v, a) if key[1] else read
        times = min(int(cm.edge_times[e]), int(cm.node_times[v]))
        if times != 1:
            saving = saving * times
        same = ~placements_differ(srcs, dsts)
        return table - np.where(same, saving[None, :], 0.0)

