"""DTensor's graph (Dijkstra) redistribution planner, re-implemented on interned ids.

DTensor uses it when a ``_StridedShard`` is involved
(``generate_graph_based_transform_infos`` / ``find_min_cost_path`` / ``get_next_state``
in ``torch.distributed.tensor._redistribute``, torch 2.13). The search from a source
state does not depend on the target except through the set of Partial reduce ops of
source and target, so one resumable search per (source state, reduce ops) serves every
target: a target's path is the path of its first pop, exactly as in a search stopped
there. States are ``(pids, shard order)``; the step costs are DTensor's own
(``_compute_placement_transition_cost`` on the specs' bytes), and neighbours are
generated in DTensor's order, so ties break the same way. Verified against DTensor
(fresh planner per call) in the tests.

All state (start states, per-(mesh, ndim, numel) edges and searches) lives in the
:class:`~.interner.PlacementInterner` passed in.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Partial, Placement

from pipeline.costmodel.redistribute.interner import PlacementInterner
from pipeline.costmodel.redistribute.steps import C_MP, C_P, C_R, C_S, category
from pipeline.dtensor.torch_compat import (
    MeshTopoInfo,
    StridedShardNotDecodableError,
    default_shard_order,
    normalize_strided_shard_order,
    placement_transition_cost,
)

__all__ = ["DTENSOR_PLAN_ERRORS", "GraphContext", "GraphSearch", "graph_state",
           "graph_transforms"]

#: What DTensor raises for a redistribution it cannot plan (so cannot run): such a pair
#: is illegal (``None`` plan).
DTENSOR_PLAN_ERRORS = (AssertionError, ValueError, RuntimeError, NotImplementedError)

#: Bound of :attr:`PlacementInterner.graph_states` (cleared when full).
GRAPH_STATE_CACHE_SIZE = 1 << 14

GraphState = tuple[tuple[int, ...], tuple[tuple[int, tuple[int, ...]], ...]]


def graph_state(
    interner: PlacementInterner, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> tuple[GraphState, tuple[Placement, ...]] | None:
    """(state, normalized placements) of a spec as DTensor's graph planner starts from it:
    ``_StridedShard`` s decoded into Shards plus a shard order (None if they cannot be:
    ``_StridedShardNotDecodableError``), else the default order.

    Raises:
        one of :data:`DTENSOR_PLAN_ERRORS` where DTensor does (not cached).
    """
    key = (placements, mesh_shape)
    cache = interner.graph_states
    if key in cache:
        return cache[key]
    mesh = interner.planning_mesh(mesh_shape)
    out: tuple[GraphState, tuple[Placement, ...]] | None
    if any(category(p) == "SS" for p in placements):
        try:
            norm, order = normalize_strided_shard_order(placements, mesh)
        except StridedShardNotDecodableError:
            norm = None
    else:
        norm, order = placements, default_shard_order(placements)
    if norm is None:
        out = None
    else:
        state = (
            tuple(interner.pid(p) for p in norm),
            tuple((int(e.tensor_dim), tuple(int(m) for m in e.mesh_dims)) for e in order),
        )
        out = (state, tuple(norm))
    if len(cache) >= GRAPH_STATE_CACHE_SIZE:
        cache.clear()
    cache[key] = out
    return out


class GraphContext:
    """State-space edges and searches of one (mesh, tensor ndim, numel)."""

    def __init__(self, interner: PlacementInterner, mesh_shape: tuple[int, ...], ndim: int,
                 numel: int) -> None:
        self.interner = interner
        self.mesh_shape = mesh_shape
        self.ndim = ndim
        self.nbytes = torch.float32.itemsize * numel  # spec_to_bytes of the planning spec
        self.topo = MeshTopoInfo.build_from_mesh(interner.planning_mesh(mesh_shape))
        self.costs: dict[tuple[int, int, int, int], float] = {}
        self.edges: dict[tuple, list[tuple[GraphState, float]]] = {}
        self.searches: dict[tuple, GraphSearch] = {}

    def cost(self, pl: tuple[int, ...], m: int, new: int) -> float:
        """DTensor's ``one_step_redistribute_cost`` of moving mesh dim ``m`` to ``new``."""
        dims = self.interner.dims
        num_shards = 1
        for i, p in enumerate(pl):
            if dims[p] >= 0:
                num_shards *= self.mesh_shape[i]
        key = (pl[m], new, m, num_shards)
        c = self.costs.get(key)
        if c is None:
            gb = self.nbytes / num_shards / 1024 / 1024 / 1024
            objs = self.interner.objs
            c = self.costs[key] = placement_transition_cost(
                objs[pl[m]], objs[new], self.topo, m, gb
            )
        return c

    def next_states(self, state: GraphState, ops: tuple[str, ...]) -> list:
        """``get_next_state``: [(next state, cost)] in DTensor's insertion order."""
        key = (state, ops)
        hit = self.edges.get(key)
        if hit is not None:
            return hit
        interner = self.interner
        pl, order = state
        ndim, cat, r_pid = self.ndim, interner.cats, interner.replicate
        out: dict[GraphState, float] = {}
        dims: dict[int, list[int]] = {td: list(mds) for td, mds in order}

        def add(m: int, new: int) -> None:
            new_pl = pl[:m] + (new,) + pl[m + 1 :]
            new_order = tuple((td, tuple(v)) for td, v in sorted(dims.items()) if v)
            out[(new_pl, new_order)] = self.cost(pl, m, new)

        # case 1: Shard(a) -> Shard(b) (all-to-all) of the last mesh dim sharding a
        for td, mds in order:
            if cat[pl[mds[-1]]] != C_S:
                continue
            for dtd in range(ndim):
                if dtd == td:
                    continue
                move = dims[td].pop()
                dims.setdefault(dtd, []).append(move)
                add(move, interner.shard_pid(dtd))
                dims[td].append(move)
                dims[dtd].pop()
        # case 2: Shard -> Replicate (all-gather) of the last mesh dim sharding a
        for td, mds in order:
            if cat[pl[mds[-1]]] != C_S:
                continue
            move = dims[td].pop()
            add(move, r_pid)
            dims[td].append(move)
        # case 3: Partial -> Replicate
        for m, p in enumerate(pl):
            if cat[p] in (C_P, C_MP):
                add(m, r_pid)
        # case 4: Replicate -> Shard(b); case 5: Partial -> Shard(b)
        for partial in (False, True):
            for m, p in enumerate(pl):
                if (cat[p] in (C_P, C_MP)) if partial else (cat[p] == C_R):
                    for dtd in range(ndim):
                        dims.setdefault(dtd, []).append(m)
                        add(m, interner.shard_pid(dtd))
                        dims[dtd].pop()
        # case 6: Replicate -> Partial(op), op of src/dst, no mixed reduce ops
        p_ops = interner.ops
        for m, p in enumerate(pl):
            if cat[p] != C_R:
                continue
            for op in ops:
                new = interner.pid(Partial(op))
                new_pl = pl[:m] + (new,) + pl[m + 1 :]
                used = {p_ops[q] for q in new_pl if cat[q] in (C_P, C_MP)}
                if len(used) > 1 and used != {"sum", "avg"}:
                    continue
                add(m, new)
        # cases 7-11 concern _StridedShard placements, gone after decoding into shard order
        hit = self.edges[key] = list(out.items())
        return hit


class GraphSearch:
    """A resumable ``find_min_cost_path`` from one source state (all targets)."""

    def __init__(self, ctx: GraphContext, src: GraphState, ops: tuple[str, ...]) -> None:
        self.ctx = ctx
        self.ops = ops
        # (cost sort key, push counter, cost, state, path link); link = (state, parent link)
        self.heap: list[tuple] = [(0.0, 0, 0.0, src, (src, None))]
        self.counter = 0
        self.popped: dict[GraphState, tuple] = {}  # first pop (= visited) -> path link

    def path(self, dst: GraphState) -> list[GraphState] | None:
        """Min-cost path to ``dst`` as DTensor finds it; None if there is none."""
        link = self.popped.get(dst)
        heap, popped = self.heap, self.popped
        while link is None and heap:
            _, _, cost, state, state_link = heapq.heappop(heap)
            if state in popped:
                continue
            popped[state] = state_link
            for nxt, step_cost in self.ctx.next_states(state, self.ops):
                if nxt not in popped:
                    self.counter += 1
                    new_cost = cost + step_cost
                    heapq.heappush(heap, (new_cost, self.counter, new_cost, nxt, (nxt, state_link)))
            if state == dst:
                link = state_link
        if link is None:
            return None
        out = []
        while link is not None:
            out.append(link[0])
            link = link[1]
        return out[::-1]


def graph_transforms(
    interner: PlacementInterner,
    src_g: tuple[GraphState, tuple[Placement, ...]],
    dst_g: tuple[GraphState, tuple[Placement, ...]],
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...],
) -> list[tuple[int, Any, Any]] | None:
    """DTensor's graph-planner transforms ``(mesh_dim, src, dst)`` between two
    :func:`graph_state` s for a tensor of ``shape``; None where DTensor finds no path
    ("No path found") or asserts (a path edge changing several mesh dims)."""
    (src_state, src_norm), (dst_state, dst_norm) = src_g, dst_g
    ops_set: set[str] = set()  # built like DTensor's, so it iterates in the same order
    for p in (*src_norm, *dst_norm):
        if interner.cats[interner.pid(p)] in (C_P, C_MP):
            ops_set.add(p.reduce_op)
    ops = tuple(ops_set)
    ckey = (mesh_shape, len(shape), math.prod(shape))
    ctx = interner.graph_contexts.get(ckey)
    if ctx is None:
        ctx = interner.graph_contexts[ckey] = GraphContext(interner, *ckey)
    skey = (src_state, ops)
    search = ctx.searches.get(skey)
    if search is None:
        search = ctx.searches[skey] = GraphSearch(ctx, src_state, ops)
    path = search.path(dst_state)
    if path is None:
        return None
    objs = interner.objs
    transforms = []
    for (cur, _), (nxt, _) in zip(path, path[1:]):
        changed = [m for m in range(len(cur)) if cur[m] != nxt[m]]
        if not changed:
            continue
        if len(changed) > 1:
            return None
        m = changed[0]
        transforms.append((m, objs[cur[m]], objs[nxt[m]]))
    return transforms
