"""Costs stage, the explanation of a plan: its objective per node and per edge.

For a strategy ``x`` (one index per node) the objective of pipeline/costmodel/model.py splits as

    E(x) = sum_v compute_v + sum_v comm_v + sum_v transition_v + sum_v fusion_v

* ``compute_v = U_v(x_v)``, the node's unary, less the collectives its strategy issues
  inside the op (a vocab-parallel softmax's all-reduces, pipeline/costmodel/op_comm.py),
  which count in ``comm_v``;
* ``comm_v``: those collectives plus, over the incoming edges e = (u, v, a) of v, the
  redistribution cost of
  u's output placement under ``x_u`` into v's expected placement for argument a under
  ``x_v`` (``inf`` for a pair DTensor forbids), times the number of times it runs
  (2 for a forward edge activation checkpointing recomputes, else 1:
  ``CostModel.edge_times``);
* ``transition_v``: the transition cost 1.0 per incoming edge whose two placements
  differ;
* ``fusion_v`` (<= 0): the pointwise-fusion term of v's incoming edges
  (pipeline/costmodel/fusion.py; 0 when ``costs.fuse_pointwise=false``).

Each edge is costed for its chosen pair with the scalar
:func:`~pipeline.costmodel.redistribute.redistribute_steps` (bit-identical to the table
entries the solver used), once per (edge class, source class, destination class)
(:meth:`~pipeline.costmodel.model.CostModel.edge_classes`: the copies of a repeated layer share
one costing). The same steps give the plan's collectives: every edge whose placements
differ is a row of ``redistributions.parquet`` (written by pipeline/stages/solve/stage.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core.dtypes import itemsize


@dataclass
class PlanBreakdown:
    """The parts of a plan's objective (µs) and its redistributions.

    Attributes:
        compute_us, comm_us, transition_us, fusion_us: float64 ``[num_nodes]``, see the
            module docstring; their sums add up to the objective.
        redistributions: one dict per graph edge whose producer and consumer
            placements differ, in graph-edge order: ``producer``, ``element``,
            ``consumer``, ``arg``, ``shape``, ``dtype``, ``src_placement``,
            ``dst_placement``, ``collectives`` (``kind(mesh dim name)``, see
            :func:`collective_name`), ``bytes``
            (sent per device, summed over steps), ``times`` (runs per step: 2 when
            checkpointing recomputes it), ``comm_us`` (all runs) and
            ``collective_steps`` (the redistribute steps that are collectives, for
            summaries; once).
    """

    compute_us: np.ndarray
    comm_us: np.ndarray
    transition_us: np.ndarray
    redistributions: list[dict[str, Any]] = field(default_factory=list)
    fusion_us: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.fusion_us is None:
            self.fusion_us = np.zeros_like(self.compute_us)


def collective_name(step: Any, mesh_names: list[str]) -> str:
    """``kind(mesh dim)`` of a collective step, e.g. ``reduce_scatter(dp)``; a flattened
    collective names its mesh dims joined by ``+``: ``all_gather(dp+tp)``
    (pipeline/costmodel/redistribute/flatten.py)."""
    return f"{step.kind}({'+'.join(mesh_names[d] for d in step.mesh_dims)})"


def plan_breakdown(cost_model: Any, strategy: np.ndarray,
                   mesh_names: list[str] | None = None) -> PlanBreakdown:
    """Break the objective of ``strategy`` (int ``[num_nodes]``) down by node and list
    its redistributions (see the module docstring).

    ``cost_model``: the :class:`~pipeline.costmodel.model.CostModel` of the run (lazy: the one
    behind the solver's factors; eager: a memoising one over the same topology).
    ``mesh_names`` name the mesh dims in ``collectives`` (default ``0``, ``1``, ...).
    """
    from pipeline.costmodel.model import TRANSITION_COST
    from pipeline.costmodel.redistribute import KINDS, redistribute_steps
    from pipeline.dtensor.placements import format_placements

    collectives = KINDS[:4]  # all_gather, reduce_scatter, all_reduce, all_to_all
    names = mesh_names or [str(i) for i in range(len(cost_model.mesh_shape))]
    n = cost_model.num_nodes
    strat = strategy.tolist()
    compute = np.array([cost_model.unary(v)[strat[v]] for v in range(n)])
    comm = np.zeros(n)
    for v in range(n):
        inside = cost_model.op_comm(v)
        if inside is not None:
            compute[v] -= inside[strat[v]]
            comm[v] += inside[strat[v]]
    trans = np.zeros(n)
    fusion = np.zeros(n)
    fuse = getattr(cost_model, "fusion", None)
    rows: list[dict[str, Any]] = []
    classes = cost_model.edge_classes().tolist()
    # (edge class, src class, dst class) -> (µs, differ, row fields of a redistribution)
    memo: dict[tuple[int, int, int], tuple[float, bool, dict[str, Any] | None]] = {}
    times_of = cost_model.edge_times.tolist()
    for e, ((u, element, v, a), ec, times) in enumerate(
            zip(cost_model.edges, classes, times_of)):
        r, srcs = cost_model.out_classes(u, element)
        c, dsts = cost_model.in_classes(v, a)
        i, j = int(r[strat[u]]), int(c[strat[v]])
        hit = memo.get((ec, i, j))
        if hit is None:
            src, dst = srcs[i], dsts[j]
            meta = cost_model.in_metas[v][a]
            reduce_size, latency_scale, flatten = cost_model.edge_collective_policy(e)
            steps = redistribute_steps(meta["shape"], itemsize(meta["dtype"]), src, dst,
                                       cost_model.mesh_shape, cost_model.hw,
                                       reduce_itemsize=reduce_size,
                                       latency_scale=latency_scale, flatten=flatten)
            us = math.inf if steps is None else 0.0
            for st in steps or ():
                us += st.us
            if times != 1:
                us = us * times
            fields = None
            if src != dst:
                coll = [st for st in steps or () if st.kind in collectives]
                fields = {
                    "shape": [int(x) for x in meta["shape"]], "dtype": str(meta["dtype"]),
                    "reduce_dtype": _reduce_dtype(steps, str(meta["dtype"]), reduce_size),
                    "src_placement": format_placements(src),
                    "dst_placement": format_placements(dst),
                    "collectives": [collective_name(st, names) for st in coll],
                    "collective_steps": coll,
                    "bytes": 0 if steps is None else int(sum(st.bytes for st in steps)),
                    "times": times, "comm_us": us}
            fused = 0.0
            if fuse is not None:
                fused = float(fuse.add_term(e, np.zeros((len(srcs), len(dsts))), srcs,
                                            dsts)[i, j])
            hit = memo[(ec, i, j)] = (us, src != dst, fields, fused)
        us, differ, fields, fused = hit
        comm[v] += us
        fusion[v] += fused
        if differ:
            trans[v] += TRANSITION_COST
            rows.append({"producer": int(u), "element": int(element), "consumer": int(v),
                         "arg": int(a), **fields})
    return PlanBreakdown(compute, comm, trans, rows, fusion)


_DTYPE_OF_ITEMSIZE = {8: "float64", 4: "float32", 2: "bfloat16"}


def _reduce_dtype(steps: Any, dtype: str, reduce_itemsize: int) -> str | None:
    """The dtype a redistribution's reductions (reduce-scatter, all-reduce) run in: the
    gradient's reduce dtype when the collective policy upcasts it
    (pipeline/costmodel/fsdp.py), else the tensor's; None when it has no reduction."""
    if not any(st.kind in ("reduce_scatter", "all_reduce") for st in steps or ()):
        return None
    if reduce_itemsize > itemsize(dtype):
        return _DTYPE_OF_ITEMSIZE.get(reduce_itemsize, dtype)
    return dtype
