"""All-pairs redistribution tables, vectorised: :func:`redistribute_table`, and the
transition test :func:`placements_differ`.

Tables are built from per-*pair* records cached across tables
(:class:`~.records.TableContext`: each (src, dst) pair planned once and compiled into a
record of step ids). A table gathers its record ids with numpy, costs every step of the
context once (:func:`.steps.step_costs`, the function :func:`.cost.redistribute_us`
uses), sums each record's steps in plan order (one column at a time, so the float
additions are those of redistribute_us) and gathers the records' costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.distributed.tensor.placement_types import Placement

from pipeline.costmodel.redistribute.interner import DEFAULT_INTERNER, PlacementInterner
from pipeline.costmodel.redistribute.records import ILLEGAL_STEP, NULL_STEP, TableContext
from pipeline.costmodel.redistribute.steps import CostParams, StepRows, check_inputs, step_costs

__all__ = ["placements_differ", "redistribute_table"]

#: Bound of :attr:`~.records.TableContext.cost_cache` (cleared when full).
COST_CACHE_SIZE = 256


def _step_costs(ctx: TableContext, shape: tuple[int, ...], itemsize: int,
                params: CostParams, reduce_itemsize: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Cost (µs) and collective bytes ``S`` of every step of ``ctx`` for a tensor of
    ``shape`` (:func:`.steps.step_costs`; the null step costs 0, the illegal one
    ``inf``)."""
    cost, s_bytes = step_costs(ctx.step_arrays(), shape, itemsize, params, reduce_itemsize)
    cost[NULL_STEP] = 0.0
    cost[ILLEGAL_STEP] = np.inf
    s_bytes[NULL_STEP] = 0
    s_bytes[ILLEGAL_STEP] = 0
    return cost, s_bytes


def redistribute_table(
    shape: Sequence[int],
    itemsize: int,
    srcs: Sequence[Sequence[Placement]],
    dsts: Sequence[Sequence[Placement]],
    mesh_shape: Sequence[int],
    hw: Any,
    *,
    interner: PlacementInterner | None = None,
    reduce_itemsize: int = 0,
    latency_scale: float = 1.0,
    flatten: bool = False,
) -> np.ndarray:
    """All-pairs :func:`~.cost.redistribute_us`: ``out[i, j]`` = cost of
    ``srcs[i] -> dsts[j]``.

    Vectorised: each ``(src, dst)`` pair is planned once per mesh shape and tensor ndim
    (and shape, if a ``_StridedShard`` is involved), across tables, and compiled into a
    record of step ids; a table gathers its pairs' records, costs the steps with numpy
    and sums each record in plan order, so every entry is bit-identical to
    :func:`~.cost.redistribute_us`.

    Args:
        shape, itemsize, mesh_shape, hw: as in :func:`~.cost.redistribute_us`.
        srcs: source placements (rows), each one per mesh dim.
        dsts: destination placements (columns).
        interner: the caches to use (default :data:`~.interner.DEFAULT_INTERNER`).
        reduce_itemsize, latency_scale, flatten: the collective policy of the tensor
            (:func:`~.cost.redistribute_us`).

    Returns:
        float64 array ``[len(srcs), len(dsts)] in µs; ``inf`` where illegal, 0 where
        the placements are equal. A fresh array the caller may modify.

    Raises:
        ValueError: for inconsistent shapes / placements / mesh.
    """
    interner = interner or DEFAULT_INTERNER
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    check_inputs(shape, itemsize, mesh_shape)
    key = (mesh_shape, len(shape))
    ctx = interner.table_contexts.get(key)
    if ctx is None:
        ctx = interner.table_contexts[key] = TableContext(interner, mesh_shape, len(shape))
    si = ctx.intern(srcs, "src")
    di = ctx.intern(dsts, "dst")
    rec = ctx.record_matrix(si, di, shape)
    if flatten:
        uniform = ctx.uniform_matrix(si, di)
        rec_cost, flat_cost = _flat_costs(ctx, shape, int(itemsize), hw, int(reduce_itemsize),
                                          float(latency_scale))
        return np.where(uniform >= 0, flat_cost[np.maximum(uniform, 0)], rec_cost[rec])
    return _record_costs(ctx, shape, int(itemsize), hw, int(reduce_itemsize),
                         float(latency_scale))[rec]


def _record_costs(ctx: TableContext, shape: tuple[int, ...], itemsize: int, hw: Any,
                  reduce_itemsize: int = 0, latency_scale: float = 1.0) -> np.ndarray:
    """Cost (µs) of every record of ``ctx``: its steps' costs summed in plan order, one
    column at a time (null padding adds an exact 0.0), so each equals
    :func:`~.cost.redistribute_us`. Cached per (shape, itemsize, hardware); records
    added since are costed on the next call (a record's cost never changes)."""
    params = CostParams.of(ctx.mesh_shape, hw, latency_scale=latency_scale)
    key = (shape, itemsize, reduce_itemsize, params.key())
    records = ctx.record_array()
    n_steps = len(ctx.step_rows)
    hit = ctx.cost_cache.get(key)
    if hit is not None and hit[0] == n_steps and len(hit[2]) == len(records):
        return hit[2]
    if hit is not None and hit[0] == n_steps:
        step_cost, old = hit[1], hit[2]
    else:
        step_cost = _step_costs(ctx, shape, itemsize, params, reduce_itemsize)[0]
        old = np.zeros(0) if hit is None else hit[2]
    new = records[len(old) :]
    cost = step_cost[new[:, 0]]
    for k in range(1, new.shape[1]):
        cost = cost + step_cost[new[:, k]]
    cost = np.concatenate([old, cost]) if len(old) else cost
    if len(ctx.cost_cache) >= COST_CACHE_SIZE:
        ctx.cost_cache.clear()
    ctx.cost_cache[key] = (n_steps, step_cost, cost)
    return cost


def _flat_costs(ctx: TableContext, shape: tuple[int, ...], itemsize: int, hw: Any,
                reduce_itemsize: int = 0,
                latency_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(record costs, flattened-row costs)`` (µs) with ``flatten``: each record with its
    runs of one collective over several mesh dims as one flattened collective, summed in
    part order, and every flattened row of :attr:`TableContext.flat_rows` (a uniform
    pair costs its row). Each entry equals :func:`~.cost.redistribute_us` with
    ``flatten=True``. Cached per (shape, itemsize, hardware)."""
    params = CostParams.of(ctx.mesh_shape, hw, latency_scale=latency_scale)
    parts = ctx.flat_array()
    n_steps, n_flat = len(ctx.step_rows), len(ctx.flat_rows)
    flat_params = ctx.groups.cost_params(hw, params.hbm, latency_scale)
    key = ("flat", shape, itemsize, reduce_itemsize, params.key(), flat_params.key())
    hit = ctx.cost_cache.get(key)
    if hit is not None and hit[0] == (n_steps, n_flat, len(parts)):
        return hit[1], hit[2]
    step_cost = _step_costs(ctx, shape, itemsize, params, reduce_itemsize)[0]
    if n_flat:
        flat_cost = step_costs(StepRows.of(ctx.flat_rows, ctx.ndim), shape, itemsize,
                               flat_params, reduce_itemsize)[0]
    else:
        flat_cost = np.zeros(1)
    part_cost = np.concatenate([step_cost, flat_cost])
    ids = np.where(parts >= 0, parts, n_steps + ~parts)
    cost = part_cost[ids[:, 0]]
    for k in range(1, ids.shape[1]):
        cost = cost + part_cost[ids[:, k]]
    if len(ctx.cost_cache) >= COST_CACHE_SIZE:
        ctx.cost_cache.clear()
    ctx.cost_cache[key] = ((n_steps, n_flat, len(parts)), cost, flat_cost)
    return cost, flat_cost


def placements_differ(
    srcs: Sequence[Sequence[Placement]], dsts: Sequence[Sequence[Placement]], *,
    interner: PlacementInterner | None = None,
) -> np.ndarray:
    """``out[i, j] = tuple(srcs[i]) != tuple(dsts[j])`` as a bool array
    ``[len(srcs), len(dsts)]``, vectorised over interned placement tuples (one dict
    look-up per placement tuple). Equality is the placements' own ``==`` (no
    normalization: ``S(-1)`` and ``S(1)`` differ, as do equal-valued ``_MaskPartial`` s
    with different mask buffers), i.e. the caller's transition-penalty test."""
    interner = interner or DEFAULT_INTERNER
    return _differ_ids(interner, srcs)[:, None] != _differ_ids(interner, dsts)[None, :]


def _differ_ids(interner: PlacementInterner,
                placements: Sequence[Sequence[Placement]]) -> np.ndarray:
    ids, objs = interner.differ_ids, interner.differ_objs
    out = np.empty(len(placements), dtype=np.intp)
    for k, pl in enumerate(placements):
        hit = objs.get(id(pl))
        if hit is not None and hit[0] is pl:
            out[k] = hit[1]
            continue
        key = pl if type(pl) is tuple else tuple(pl)
        i = ids.setdefault(key, len(ids))
        if type(pl) is tuple:
            objs[id(pl)] = (pl, i)
        out[k] = i
    return out
