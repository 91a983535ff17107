"""Flattened collectives: a redistribution that changes several mesh dims the same way
runs as one collective over the group those mesh dims span together.

DTensor's ``redistribute`` works one mesh dim at a time: a weight sharded
``(Shard(0), Shard(0))`` on an ``8 x 8`` mesh is gathered over the inner dim (8 ranks in
a node, buffer ``S/8``) and then over the outer dim (8 ranks on 8 nodes, one per node:
the full ``S`` on a single rail). A training step does not run it that way. FSDP2's
``fully_shard`` takes a 1-D mesh, so a parameter sharded over several mesh dims is
sharded over their *flattened* sub-mesh, and its all-gather and its gradient's
reduce-scatter are one collective over all of their ranks (torchtitan,
``torchtitan/distributed/parallel_dims.py``: the ``dp_shard_cp`` mesh FSDP shards on, and
the ``dp_cp`` mesh the loss is all-reduced over, made by ``DeviceMesh._flatten``; PyTorch
docs "DeviceMesh"). On ``8 x 8`` that is the same 64-rank ring as on a flat 64-rank mesh,
on every rail of a node. A tensor placed the same way on several mesh dims is placed as
on one mesh dim of their product (the nested order of ``(Shard(a), Shard(a))`` is the
row-major rank order of the flattened group), so the same physical plan costs the same
whatever the factorisation of the mesh.

With ``costs.flatten_mesh`` (default true), a redistribution ``src -> dst`` is priced:

* **uniform** over a set ``D`` of at least two mesh dims (of size > 1) when those are
  the dims it changes and ``src`` is one placement ``p`` and ``dst`` one placement
  ``q`` on all of them: one step ``p -> q`` (the step table of :mod:`.steps`) over the
  flattened group of ``D``, ``n = prod(mesh_shape[d] for d in D)``, its ``G`` divided
  by the shards of the other mesh dims (e.g. ``(S(2), S(2)) -> (S(0), S(0))`` is one
  all-to-all over 64 ranks, where DTensor gathers over the inner dim, all-to-alls over
  the outer one and slices);
* else DTensor's per-mesh-dim plan, in which a maximal run of consecutive steps of one
  collective among all-gather, reduce-scatter and all-reduce, on the same tensor dim
  (none for all-reduce), is one collective over the flattened group of their mesh dims
  (e.g. ``(S(0), S(0), S(1)) -> (R, R, S(1))``: one all-gather over ``dp x cp``); a step
  with a strided local copy (``Partial -> _StridedShard``) stays alone.

A flattened step is a :class:`~.steps.StepRow` whose ``mesh_dim`` indexes a list of
groups (each a sorted tuple of mesh dims, :class:`FlatGroups`), costed by
:func:`~.steps.step_costs` with the alpha-beta parameters of those groups
(:func:`pipeline.costmodel.comm.group_collective_params` on
:func:`~pipeline.costmodel.comm.mesh_group_layout` of the group), so the formula is the
one of every other collective. ``costs.flatten_mesh=false`` prices DTensor's plan on the
full mesh, one collective per mesh dim. :mod:`pipeline.verify.run` runs plans with
DTensor's own ``redistribute`` and counts a flattened collective as one per mesh dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch.distributed.tensor.placement_types import Placement

from pipeline.costmodel.comm import flat_group_params
from pipeline.costmodel.redistribute.steps import (
    KIND_CODE,
    N_COLLECTIVES,
    CostParams,
    StepRow,
    category,
    classify,
    is_shard_like,
)

__all__ = ["MERGEABLE", "FlatGroups", "flat_parts", "row_own_dim", "run_row", "uniform_row"]

#: Step kinds a run of which over several mesh dims is one flattened collective.
MERGEABLE: frozenset[int] = frozenset(
    (KIND_CODE["all_gather"], KIND_CODE["reduce_scatter"], KIND_CODE["all_reduce"]))


def row_own_dim(row: StepRow) -> int | None:
    """The tensor dim a step gathers or scatters (where ``L`` divides further than
    ``G``), None for an all-reduce."""
    for d, (g, loc) in enumerate(zip(row.div_g, row.div_l, strict=True)):
        if g != loc:
            return d
    return None


def flat_parts(rows: Sequence[StepRow]) -> list[tuple[int, ...]]:
    """Indices into ``rows`` (one redistribution's steps on real mesh dims, in plan
    order) grouped into parts: maximal runs of mergeable steps of one kind and tensor dim
    on distinct mesh dims, every other step alone (module docstring)."""
    parts: list[list[int]] = []
    last: tuple[int, int | None] | None = None
    dims: set[int] = set()
    for k, row in enumerate(rows):
        key = None
        if row.kind in MERGEABLE and not row.reshuffle_local:
            key = (row.kind, row_own_dim(row))
        if key is not None and key == last and row.mesh_dim not in dims:
            parts[-1].append(k)
            dims.add(row.mesh_dim)
            continue
        parts.append([k])
        last, dims = key, {row.mesh_dim}
    return [tuple(p) for p in parts]


def run_row(rows: Sequence[StepRow], part: Sequence[int],
            mesh_shape: Sequence[int]) -> tuple[tuple[int, ...], StepRow]:
    """``(mesh dims, flattened step)`` of a run of ``k >= 2`` steps (:func:`flat_parts`):
    an all-gather's local size is the first step's ``L``, a reduce-scatter's or an
    all-reduce's logical size the first step's ``G``; the flattened group's size ``n``
    relates the two. The step's ``mesh_dim`` is 0 until :class:`FlatGroups` numbers it."""
    first = rows[part[0]]
    dims = tuple(sorted(rows[k].mesh_dim for k in part))
    n = math.prod(int(mesh_shape[d]) for d in dims)
    own = row_own_dim(first)
    if first.kind == KIND_CODE["all_gather"]:
        loc = list(first.div_l)
        g = list(loc)
        g[own] //= n
    else:
        g = list(first.div_g)
        loc = list(g)
        if own is not None:
            loc[own] *= n
    resh = any(rows[k].reshuffle for k in part)
    return dims, StepRow(first.kind, 0, tuple(g), tuple(loc), resh, False)


def uniform_row(src: Sequence[Placement], dst: Sequence[Placement],
                mesh_shape: Sequence[int], ndim: int) -> tuple[tuple[int, ...], StepRow] | None:
    """``(mesh dims, flattened step)`` of a redistribution uniform over two or more mesh
    dims (module docstring), or None (not uniform, a ``_StridedShard`` side, an illegal
    or local step)."""
    changed = [d for d in range(len(mesh_shape))
               if int(mesh_shape[d]) > 1 and src[d] != dst[d]]
    if len(changed) < 2:
        return None
    p, q = src[changed[0]], dst[changed[0]]
    if any(src[d] != p or dst[d] != q for d in changed):
        return None
    if category(p) == "SS" or category(q) == "SS":
        return None
    t = classify(p, q)
    if t is None or KIND_CODE[t.kind] >= N_COLLECTIVES:
        return None
    g = [1] * ndim
    for m, pl in enumerate(src):
        if m not in changed and is_shard_like(pl):
            g[int(pl.dim)] *= int(mesh_shape[m])
    loc = list(g)
    if t.own_dim is not None:
        loc[t.own_dim] *= math.prod(int(mesh_shape[d]) for d in changed)
    return tuple(changed), StepRow(KIND_CODE[t.kind], 0, tuple(g), tuple(loc), t.reshuffle,
                                   t.reshuffle_local)


class FlatGroups:
    """The flattened groups of one mesh, numbered in order of first use: the
    ``mesh_dim`` of a flattened step indexes :attr:`dims`."""

    def __init__(self, mesh_shape: Sequence[int]) -> None:
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        self.dims: list[tuple[int, ...]] = []
        self._index: dict[tuple[int, ...], int] = {}

    def number(self, dims: tuple[int, ...], row: StepRow) -> StepRow:
        """``row`` with its ``mesh_dim`` set to the index of group ``dims``."""
        i = self._index.get(dims)
        if i is None:
            i = self._index[dims] = len(self.dims)
            self.dims.append(dims)
        return row._replace(mesh_dim=i)

    def cost_params(self, hw: Any, hbm: float, latency_scale: float = 1.0) -> CostParams:
        """:class:`~.steps.CostParams` whose "mesh dims" are these groups
        (:func:`~pipeline.costmodel.comm.flat_group_params`; latency times
        ``latency_scale``, the bucket share of :mod:`pipeline.costmodel.fsdp`, as
        :meth:`.steps.CostParams.of` scales it)."""
        coll = flat_group_params(self.mesh_shape, hw, self.dims)
        if latency_scale != 1.0:
            coll = coll.scaled(latency_scale)
        return CostParams(coll, float(hbm))
