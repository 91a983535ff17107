"""The per-mesh-dim steps DTensor runs for a redistribution: :func:`plan`.

A legal redistribution is decomposed into the per-mesh-dim steps DTensor itself runs,
from ``torch.distributed.tensor._redistribute._gen_transform_infos_non_cached`` (greedy
planner; the Dijkstra planner when a ``_StridedShard`` is involved), planned once per
``(src, dst)`` on a canonical, evenly divisible tensor and cached. Both planners are
re-implemented here on interned placement ids (:mod:`.interner`; DTensor's own planner
costs ~0.1 ms per pair, its Dijkstra planner milliseconds to minutes); the tests check
they give exactly DTensor's steps, exhaustively over small meshes and ranks, against
DTensor's planner as the reference (``tests/support/dtensor_reference.py``, with a fresh planner
per call: DTensor's cached planners accumulate reduce ops across calls, which makes its
Dijkstra plans depend on call history). The graph planner's specs are built on a
``DeviceMesh(..., _init_backend=False, _rank=0)``, so no process group is needed (a test
checks the plans equal those on a fake-process-group mesh).
DTensor's runtime may additionally merge consecutive same-type collectives into one
over a *flattened* mesh (``_optimize_transform_infos``) when the user has created that
flattened mesh; we cost the unmerged per-dim steps.

Each transform is classified into a step (kind, bytes rule, legality) by
:func:`.steps.classify`; :mod:`.graph` holds the Dijkstra planner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement

from pipeline.costmodel.redistribute.graph import (
    DTENSOR_PLAN_ERRORS,
    graph_state,
    graph_transforms,
)
from pipeline.costmodel.redistribute.interner import DEFAULT_INTERNER, PlacementInterner
from pipeline.costmodel.redistribute.steps import (
    C_S,
    Step,
    category,
    is_shard_like,
    mixed_partials,
    steps_from_transforms,
)

__all__ = ["greedy_transforms", "plan", "plan_greedy", "plan_normalized", "planning_shape"]

#: Bound of :attr:`PlacementInterner.plans` (cleared when full).
PLAN_CACHE_SIZE = 1 << 18


def planning_shape(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...] | None,
) -> tuple[int, ...]:
    """The tensor shape plans are made for: ``shape``, or a canonical, evenly divisible
    one when None. Raises ValueError for negative or out-of-range shard dims."""
    dims = [p.dim for p in (*src, *dst) if is_shard_like(p)]
    if any(d < 0 for d in dims):
        raise ValueError(
            f"plan() needs non-negative shard dims, got {src} -> {dst}; "
            "use normalize_placements(placements, ndim) first"
        )
    if shape is None:
        # Canonical, evenly divisible tensor. The greedy planner only uses the placements
        # (never a tensor dim they do not name), so a fixed ndim lets specs be reused.
        ndim = max(4, max(dims, default=0) + 1)
        size = 2 * math.prod(mesh_shape)
        for p in (*src, *dst):
            if category(p) == "SS":
                size *= int(p.split_factor)
        return (size,) * ndim
    if dims and max(dims) >= len(shape):
        raise ValueError(f"placements {src} -> {dst} out of range for shape {shape}")
    return shape


def greedy_transforms(
    interner: PlacementInterner, src: tuple[int, ...], dst: tuple[int, ...], src_shards: bool
) -> list[tuple[int, int, int]]:
    """DTensor's greedy planner (``generate_greedy_transform_infos``, torch 2.13) on pids:
    ``(mesh_dim, src pid, dst pid)`` per step. ``src_shards`` is DTensor's
    ``src_spec.num_shards > 1``: on the canonical planning mesh (size 2 per dim) used
    without ``_StridedShard``, whether ``src`` holds a ``Shard``; in DTensor's fallback
    for an undecodable ``_StridedShard`` (real mesh), whether ``src`` holds a shard-like
    placement on a mesh dim of size > 1. A ``_StridedShard`` is neither a ``Shard``
    target nor ``is_shard(d)`` here, as in DTensor.

    1-d mesh: one direct step. Otherwise, if ``src`` shards at all (``num_shards > 1``),
    a pass from the innermost mesh dim outwards moves every mesh dim to its target,
    except that a ``Shard(d)`` target whose outer mesh dims shard ``d`` differently in
    the current and target placements (nested / misaligned sharding) is replaced by
    ``Replicate()``; then a pass from the outermost mesh dim inwards moves every mesh dim
    still off target to its target. Verified against DTensor exhaustively in the tests.
    """
    n = len(src)
    if n == 1:
        return [] if src[0] == dst[0] else [(0, src[0], dst[0])]
    cat = interner.cats
    out: list[tuple[int, int, int]] = []
    cur = list(src)
    if src_shards:
        for m in range(n - 1, -1, -1):
            c, t = cur[m], dst[m]
            if cat[t] == C_S:
                # Shard(d) has one pid: "cur[i] shards d" is cur[i] == t
                for i in range(m):
                    if (cur[i] == t) != (dst[i] == t):
                        t = interner.replicate
                        break
            if c != t:
                out.append((m, c, t))
                cur[m] = t
    for m in range(n):
        if cur[m] != dst[m]:
            out.append((m, cur[m], dst[m]))
            cur[m] = dst[m]
    return out


def plan_greedy(
    interner: PlacementInterner, src: tuple[Placement, ...], dst: tuple[Placement, ...],
    src_shards: bool | None = None,
) -> tuple[Step, ...] | None:
    """DTensor's greedy planner (:func:`greedy_transforms`) for normalized placements;
    None if illegal. ``src_shards`` defaults to the canonical planning mesh's
    ``num_shards > 1`` (``src`` holds a ``Shard``): DTensor's plan without
    ``_StridedShard``."""
    if mixed_partials(src) or mixed_partials(dst):
        return None
    sp = tuple(interner.pid(p) for p in src)
    if src_shards is None:
        src_shards = any(interner.cats[p] == C_S for p in sp)
    tr = greedy_transforms(interner, sp, tuple(interner.pid(p) for p in dst), src_shards)
    obj = interner.objs
    return steps_from_transforms(src, [(m, obj[a], obj[b]) for m, a, b in tr])


def plan_strided(
    interner: PlacementInterner,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...] | None,
) -> tuple[Step, ...] | None:
    """DTensor's plan for pairs involving a ``_StridedShard``: its graph planner
    (:func:`.graph.graph_transforms`), or, when a ``_StridedShard`` cannot be decoded into a
    shard order, the greedy planner DTensor then falls back to."""
    if mixed_partials(src) or mixed_partials(dst):
        return None
    shape = planning_shape(src, dst, mesh_shape, shape)
    try:
        src_g = graph_state(interner, src, mesh_shape)
        dst_g = graph_state(interner, dst, mesh_shape)
    except DTENSOR_PLAN_ERRORS:
        return None  # DTensor cannot plan it, so it cannot run it
    if src_g is None or dst_g is None:  # _StridedShardNotDecodableError
        # DTensor falls back to its greedy planner, on the real mesh: it runs the
        # inner-to-outer pass iff num_shards > 1 (Shard or _StridedShard on a mesh dim
        # of size > 1); a _StridedShard is neither a Shard target nor is_shard(d).
        shards = any(is_shard_like(p) and n > 1 for p, n in zip(src, mesh_shape, strict=True))
        return plan_greedy(interner, src, dst, shards)
    transforms = graph_transforms(interner, src_g, dst_g, mesh_shape, shape)
    if transforms is None:
        return None
    return steps_from_transforms(src, transforms)


def plan(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int] | None = None,
    shape: Sequence[int] | None = None,
    *,
    interner: PlacementInterner | None = None,
) -> tuple[Step, ...] | None:
    """The per-mesh-dim steps DTensor runs to go from ``src`` to ``dst``; None if illegal.

    Cached by ``(src, dst)``: DTensor's greedy planner (used unless a ``_StridedShard``
    is involved) gives steps that depend on neither the mesh sizes nor the tensor shape,
    so it runs on a canonical mesh (size 2 per dim) and tensor. With a
    ``_StridedShard``, DTensor switches to its Dijkstra planner, which decodes the
    split factor against the mesh sizes and may route through shard dims named by
    neither side, so ``mesh_shape`` and ``shape`` then enter the key (pass both).

    Args:
        src, dst: placements, one per mesh dim, same length, non-negative shard dims
            (see :func:`~.interner.normalize_placements`).
        mesh_shape: the mesh shape (used for ``_StridedShard`` plans only).
        shape: the tensor's global shape (used for ``_StridedShard`` plans only).
        interner: the caches to use (default :data:`~.interner.DEFAULT_INTERNER`).

    Returns:
        ``()`` if ``src == dst``; a tuple of :class:`~.steps.Step`; or ``None`` if illegal.

    Raises:
        ValueError: if lengths differ or a shard dim is negative.
    """
    interner = interner or DEFAULT_INTERNER
    src = interner.normalize(src)
    dst = interner.normalize(dst)
    if len(src) != len(dst):
        raise ValueError(f"src {src} and dst {dst} have different numbers of mesh dims")
    if mesh_shape is not None and len(mesh_shape) != len(src):
        raise ValueError(f"mesh_shape {tuple(mesh_shape)} does not match placements {src}")
    return plan_normalized(
        interner,
        src,
        dst,
        None if mesh_shape is None else tuple(int(s) for s in mesh_shape),
        None if shape is None else tuple(int(s) for s in shape),
    )


def plan_normalized(
    interner: PlacementInterner,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...] | None,
    shape: tuple[int, ...] | None,
) -> tuple[Step, ...] | None:
    """:func:`plan` for already normalized, length-checked placements (cached in
    ``interner.plans``)."""
    if src == dst:
        return ()
    strided = any(category(p) == "SS" for p in (*src, *dst))
    if strided:
        key = (src, dst, mesh_shape if mesh_shape is not None else (2,) * len(src), shape)
    else:
        key = (src, dst, (2,) * len(src), None)
    plans = interner.plans
    if key in plans:
        return plans[key]
    if len(plans) >= PLAN_CACHE_SIZE:
        plans.clear()
    if not strided:
        steps = plan_greedy(interner, src, dst)
    else:
        steps = plan_strided(interner, *key)
    plans[key] = steps
    return steps
