"""Cost of redistributing a tensor between two DTensor placements on a mesh, in µs.

Legality, as DTensor enforces it in ``redistribute_local_tensor`` (an illegal pair is
a forbidden pair of the MRF, ``+inf``, never a finite guess):

* ``Replicate -> Partial`` is a local op and free;
* ``Shard -> Partial`` and ``Partial(op1) -> Partial(op2)`` (op1 != op2, including a
  plain ``Partial`` vs a ``_MaskPartial`` / ``_NormPartial``) are illegal: ``+inf``;
* placements mixing Partial reduce ops other than {sum, avg} are illegal: ``+inf``.

A legal redistribution is decomposed into the per-mesh-dim steps DTensor itself runs,
from ``torch.distributed.tensor._redistribute._gen_transform_infos_non_cached`` (greedy
planner; the Dijkstra planner when a ``_StridedShard`` is involved), planned once per
``(src, dst)`` on a canonical, evenly divisible tensor and cached (:func:`plan`). Both
planners are re-implemented here on interned placement ids (DTensor's own planner costs
~0.1 ms per pair, its Dijkstra planner milliseconds to minutes); the tests check they
give exactly DTensor's steps, exhaustively over small meshes and ranks, and DTensor's
planner stays as the reference (``_plan_uncached``, with a fresh planner per call:
DTensor's cached planners accumulate reduce ops across calls, which makes its Dijkstra
plans depend on call history). The specs are built on a
``DeviceMesh(..., _init_backend=False, _rank=0)``, so no process group is needed (a test
checks the plans equal those on a fake-process-group mesh).
DTensor's runtime may additionally merge consecutive same-type collectives into one
over a *flattened* mesh (``_optimize_transform_infos``) when the user has created that
flattened mesh; we cost the unmerged per-dim steps.
Each step maps to a collective on that mesh dim:

===========================  ==================  =========================================
step                         collective          buffer ``S`` (bytes)
===========================  ==================  =========================================
``S(a) -> R``                all_gather          ``n * L`` (gathered output)
``P -> R``                   all_reduce          ``G``
``P -> S(b)``                reduce_scatter      ``n * L`` (input)
``S(a) -> S(b)``             all_to_all          ``L`` (local)
``R -> S(b)``                none (local slice)  0 if ``b == 0``, else copy of ``L``
``R -> P``                   none                0
``P -> SS(b,k)``             all_reduce          ``G``, + local strided copy of ``L``
``SS <-> S/SS``              all_gather          ``n * L`` (DTensor goes via Replicate)
===========================  ==================  =========================================

``G`` is the tensor's *logical* size at that step on the group of the step's mesh dim:
the full bytes divided by the shard factors of the *other* mesh dims currently
sharding it; ``L`` additionally divides by the step's own mesh-dim size ``n`` on the
sharded tensor dim. Uneven sharding uses ceil division (the largest shard; DTensor pads
collectives to it). A gather, reduce-scatter or all-to-all on a tensor dim other than
0 (funcol's ``gather_dim``/``scatter_dim != 0`` path, ``shard_dim_alltoall``) adds a
local reshuffle of ``2 * S / (hbm_bandwidth * memory_efficiency)``; so does a
non-leading ``R -> S`` slice (``2 * L / ...``; DTensor clones a dim-0 slice too, but
that copy is taken as free, per the design). Collective times come from
:mod:`pipeline.costmodel.comm` (alpha-beta, ring factors, link per mesh dim). A mesh dim
of size 1 costs nothing (DTensor skips it).

The transition penalty of the pairwise factor (1.0 when placements differ) is *not*
added here; the caller adds it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _MaskPartial,
    _StridedShard,
)

from pipeline.costmodel.comm import COLLECTIVE_FACTOR, mesh_links

__all__ = [
    "KINDS",
    "Step",
    "clear_caches",
    "normalize_placements",
    "placements_differ",
    "plan",
    "StepCost",
    "redistribute_steps",
    "redistribute_table",
    "redistribute_us",
]

#: Step kinds. The first four are collectives; ``local_shard`` / ``local_partial`` are
#: local ops.
KINDS: tuple[str, ...] = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "local_shard",
    "local_partial",
)
_COLLECTIVE_KINDS = KINDS[:4]
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}


@dataclass(frozen=True)
class Step:
    """One per-mesh-dim step of a redistribution plan (shape independent).

    Attributes:
        mesh_dim: the mesh dim whose placement changes.
        kind: one of :data:`KINDS`.
        src: placement on ``mesh_dim`` before the step (as DTensor's planner states it).
        dst: placement on ``mesh_dim`` after the step.
        before: placements on all mesh dims before the step.
        divs: ``(tensor_dim, mesh_dim)`` for every *other* mesh dim sharding the tensor
            before the step: they divide the logical size ``G``.
        own_dim: tensor dim divided by this mesh dim's size for the local size ``L``
            (``None`` when the step has no sharded side, i.e. all-reduce / R->P).
        reshuffle: whether a local HBM reshuffle is charged.
        reshuffle_local: charge the reshuffle on ``L`` (local ops, strided slices)
            instead of on the collective buffer ``S``.
    """

    mesh_dim: int
    kind: str
    src: Placement
    dst: Placement
    before: tuple[Placement, ...]
    divs: tuple[tuple[int, int], ...]
    own_dim: int | None
    reshuffle: bool
    reshuffle_local: bool

    @property
    def is_collective(self) -> bool:
        """True for all_gather / reduce_scatter / all_reduce / all_to_all."""
        return self.kind in _COLLECTIVE_KINDS


# --------------------------------------------------------------------------- helpers


# Placement category by exact type. isinstance() against placement classes goes through
# torch's opaque-type metaclass and dominates planning time, so types are looked up in a
# dict (filled with isinstance on first sight of a new type).
_CAT: dict[type, str] = {
    Replicate: "R",
    Shard: "S",
    _StridedShard: "SS",
    Partial: "P",
    _MaskPartial: "MP",
}


def _cat(p: Placement) -> str:
    """'R', 'S', 'SS', 'P' (any Partial but _MaskPartial) or 'MP'."""
    t = type(p)
    c = _CAT.get(t)
    if c is None:
        if isinstance(p, _MaskPartial):
            c = "MP"
        elif isinstance(p, _StridedShard):
            c = "SS"
        elif isinstance(p, Shard):
            c = "S"
        elif isinstance(p, Partial):
            c = "P"
        elif isinstance(p, Replicate):
            c = "R"
        else:
            raise ValueError(f"unknown placement type {t.__name__}: {p!r}")
        _CAT[t] = c
    return c


def _is_shard_like(p: Placement) -> bool:
    return _cat(p) in ("S", "SS")


def _is_partial(p: Placement) -> bool:
    return _cat(p) in ("P", "MP")


def _partial_key(p: Placement) -> tuple:
    """Value identity of a Partial (``_MaskPartial`` equality uses its buffer's id)."""
    if _cat(p) == "MP":
        shape = None if p.offset_shape is None else tuple(int(s) for s in p.offset_shape)
        return ("mask", p.reduce_op, shape, int(p.offset_dim))
    return ("partial", type(p).__name__, p.reduce_op, getattr(p, "norm_type", None))


_CANON_MASK: dict[tuple, _MaskPartial] = {}


def _canon(p: Placement, ndim: int | None) -> Placement:
    c = _cat(p)
    if c == "MP":
        key = _partial_key(p)
        canon = _CANON_MASK.get(key)
        if canon is None:
            canon = _CANON_MASK.setdefault(key, p)
        return canon
    if ndim is not None and c == "SS" and p.dim < 0:
        return _StridedShard(p.dim + ndim, split_factor=p.split_factor)
    if ndim is not None and c == "S" and p.dim < 0:
        return Shard(p.dim + ndim)
    return p


def normalize_placements(
    placements: Sequence[Placement], ndim: int | None = None
) -> tuple[Placement, ...]:
    """Canonical form used as cache key: negative shard dims made non-negative (needs
    the tensor ``ndim``) and equal-valued ``_MaskPartial`` s mapped to one instance."""
    return tuple(_canon(p, ndim) for p in placements)


def _mixed_partials(placements: Sequence[Placement]) -> bool:
    ops = {p.reduce_op for p in placements if _is_partial(p)}
    return len(ops) > 1 and ops != {"sum", "avg"}


@functools.lru_cache(maxsize=64)
def _planning_mesh(mesh_shape: tuple[int, ...]) -> Any:
    """A DeviceMesh of ``mesh_shape`` that needs no process group (rank 0's view)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(math.prod(mesh_shape), dtype=torch.int).reshape(mesh_shape)
    return DeviceMesh("cpu", ranks, _init_backend=False, _rank=0)


def _classify(src: Placement, dst: Placement) -> tuple[str, bool, bool] | None:
    """(kind, reshuffle, reshuffle_local) of one planner step, or None if illegal."""
    cs, cd = _cat(src), _cat(dst)
    if cd in ("P", "MP"):
        if cs == "R":
            return ("local_partial", False, False)
        return None  # Shard -> Partial, Partial(op1) -> Partial(op2)
    if cs == "R":
        if cd in ("S", "SS"):
            return ("local_shard", not (cd == "S" and dst.dim == 0), True)
        return None  # pragma: no cover - R -> R is never a step
    if cs in ("P", "MP"):
        if cd == "R":
            return ("all_reduce", False, False)
        if cd == "SS":  # DTensor: all-reduce, then a strided local slice
            return ("all_reduce", True, True)
        return ("reduce_scatter", dst.dim != 0, False)
    # src is shard-like
    if cd == "R":
        return ("all_gather", not (cs == "S" and src.dim == 0), False)
    if cs == "S" and cd == "S":
        return ("all_to_all", True, False)  # src.dim != dst.dim: one side is non-leading
    return ("all_gather", True, False)  # a _StridedShard side: DTensor gathers, then slices


def _planning_shape(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...] | None,
) -> tuple[int, ...]:
    """The tensor shape plans are made for: ``shape``, or a canonical, evenly divisible
    one when None. Raises ValueError for negative or out-of-range shard dims."""
    dims = [p.dim for p in (*src, *dst) if _is_shard_like(p)]
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
            if _cat(p) == "SS":
                size *= int(p.split_factor)
        return (size,) * ndim
    if dims and max(dims) >= len(shape):
        raise ValueError(f"placements {src} -> {dst} out of range for shape {shape}")
    return shape


def _plan_uncached(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...] | None,
) -> tuple[Step, ...] | None:
    """The reference plan: DTensor's own planner (``_gen_transform_infos_non_cached``).

    DTensor caches one graph planner per (mesh, tensor meta) whose sets of Partial reduce
    ops and ``_StridedShard`` targets *accumulate* over calls, which makes its Dijkstra
    plans depend on call history (and can blow up its state space); the planner is
    dropped after each call, so every plan is made by a fresh planner."""
    from torch.distributed.tensor import _redistribute

    if _mixed_partials(src) or _mixed_partials(dst):
        return None
    shape = _planning_shape(src, dst, mesh_shape, shape)
    try:
        src_spec = _spec(src, mesh_shape, shape)
        dst_spec = _spec(dst, mesh_shape, shape)
        _drop_dtensor_planner(src_spec)
        try:
            infos = _redistribute._gen_transform_infos_non_cached(src_spec, dst_spec)
        finally:
            _drop_dtensor_planner(src_spec)
    except (AssertionError, ValueError, RuntimeError, NotImplementedError):
        return None  # DTensor cannot plan it, so it cannot run it

    return _steps_from_transforms(
        src, [(info.mesh_dim, *info.src_dst_placements) for info in infos]
    )


def _drop_dtensor_planner(spec: Any) -> None:
    """Forget DTensor's cached planner for ``spec``'s (private planning) mesh and meta."""
    import weakref

    from torch.distributed.tensor import _redistribute

    cache = getattr(_redistribute, "_planner_cache", None)
    if cache is not None:
        cache.pop((weakref.ref(spec.mesh), spec.tensor_meta), None)


def _steps_from_transforms(
    src: tuple[Placement, ...], transforms: Sequence[tuple[int, Placement, Placement]]
) -> tuple[Step, ...] | None:
    """:class:`Step` s of a planner's ``(mesh_dim, src, dst)`` transforms; None if one is
    illegal (see :func:`_classify`)."""
    current = list(src)
    steps: list[Step] = []
    for m, s_p, d_p in transforms:
        cls = _classify(s_p, d_p)
        if cls is None:
            return None
        kind, reshuffle, reshuffle_local = cls
        divs = tuple((int(p.dim), j) for j, p in enumerate(current) if j != m and _is_shard_like(p))
        if kind in ("all_gather", "all_to_all"):
            own_dim: int | None = int(s_p.dim)
        elif kind in ("reduce_scatter", "local_shard") or reshuffle_local:
            own_dim = int(d_p.dim)
        else:
            own_dim = None
        steps.append(
            Step(m, kind, s_p, d_p, tuple(current), divs, own_dim, reshuffle, reshuffle_local)
        )
        current[m] = d_p
    return tuple(steps)


# Rule-based planner. Placements are interned to small ints ("pids"): equal placements
# (by their own ``==``; normalized, so equal-valued _MaskPartials are one object) share a
# pid, so the planner compares ints instead of calling torch's slow ``__eq__``.

_C_R, _C_S, _C_SS, _C_P, _C_MP = range(5)
_CAT_CODE = {"R": _C_R, "S": _C_S, "SS": _C_SS, "P": _C_P, "MP": _C_MP}
_PID: dict[Placement, int] = {}
_P_OBJ: list[Placement] = []
_P_CAT: list[int] = []
_P_DIM: list[int] = []  # shard dim, -1 if not shard-like
_P_OP: list[str | None] = []  # reduce op of a Partial (any subclass), else None


def _pid(p: Placement) -> int:
    """Interned id of one (normalized) placement."""
    i = _PID.get(p)
    if i is None:
        i = _PID[p] = len(_P_OBJ)
        _P_OBJ.append(p)
        _P_CAT.append(_CAT_CODE[_cat(p)])
        _P_DIM.append(int(p.dim) if _is_shard_like(p) else -1)
        _P_OP.append(p.reduce_op if _is_partial(p) else None)
    return i


_R_PID = _pid(Replicate())

# _classify() of (src pid, dst pid): (kind code, reshuffle, reshuffle_local, own_dim) or None
_TRANSFORM: dict[tuple[int, int], tuple[int, bool, bool, int] | None] = {}


def _transform(a: int, b: int) -> tuple[int, bool, bool, int] | None:
    t = _TRANSFORM.get((a, b), False)
    if t is False:
        cls = _classify(_P_OBJ[a], _P_OBJ[b])
        if cls is None:
            t = None
        else:
            kind, reshuffle, reshuffle_local = cls
            if kind in ("all_gather", "all_to_all"):
                own = _P_DIM[a]
            elif kind in ("reduce_scatter", "local_shard") or reshuffle_local:
                own = _P_DIM[b]
            else:
                own = -1
            t = (_KIND_CODE[kind], reshuffle, reshuffle_local, own)
        _TRANSFORM[(a, b)] = t
    return t


def _greedy_transforms(
    src: tuple[int, ...], dst: tuple[int, ...], src_shards: bool
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
    cat = _P_CAT
    out: list[tuple[int, int, int]] = []
    cur = list(src)
    if src_shards:
        for m in range(n - 1, -1, -1):
            c, t = cur[m], dst[m]
            if cat[t] == _C_S:
                # Shard(d) has one pid: "cur[i] shards d" is cur[i] == t
                for i in range(m):
                    if (cur[i] == t) != (dst[i] == t):
                        t = _R_PID
                        break
            if c != t:
                out.append((m, c, t))
                cur[m] = t
    for m in range(n):
        if cur[m] != dst[m]:
            out.append((m, cur[m], dst[m]))
            cur[m] = dst[m]
    return out


def _plan_rules(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> tuple[Step, ...] | None:
    """:func:`_plan_uncached` (DTensor's greedy planner on the canonical mesh and tensor)
    without DTensor, for normalized placements without ``_StridedShard``; same steps."""
    if _mixed_partials(src) or _mixed_partials(dst):
        return None
    sp = tuple(_pid(p) for p in src)
    tr = _greedy_transforms(sp, tuple(_pid(p) for p in dst), any(_P_CAT[p] == _C_S for p in sp))
    obj = _P_OBJ
    return _steps_from_transforms(src, [(m, obj[a], obj[b]) for m, a, b in tr])


# DTensor's graph (Dijkstra) planner, used when a _StridedShard is involved
# (``generate_graph_based_transform_infos`` / ``find_min_cost_path`` / ``get_next_state``,
# torch 2.13), re-implemented on pids. The search from a source state does not depend on
# the target except through the set of Partial reduce ops of source and target, so one
# resumable search per (source state, reduce ops) serves every target: a target's path is
# the path of its first pop, exactly as in a search stopped there. States are
# ``(pids, shard order)``; the step costs are DTensor's own
# (``_compute_placement_transition_cost`` on the specs' bytes), and neighbours are
# generated in DTensor's order, so ties break the same way. Verified against DTensor
# (fresh planner per call) in the tests.

_GraphState = tuple[tuple[int, ...], tuple[tuple[int, tuple[int, ...]], ...]]


def _shard_pid(d: int) -> int:
    return _pid(Shard(d))


class _GraphContext:
    """State-space edges and searches of one (mesh, tensor ndim, numel)."""

    def __init__(self, mesh_shape: tuple[int, ...], ndim: int, numel: int) -> None:
        from torch.distributed.tensor._collective_utils import MeshTopoInfo

        self.mesh_shape = mesh_shape
        self.ndim = ndim
        self.nbytes = torch.float32.itemsize * numel  # spec_to_bytes of the planning spec
        self.topo = MeshTopoInfo.build_from_mesh(_planning_mesh(mesh_shape))
        self.costs: dict[tuple[int, int, int, int], float] = {}
        self.edges: dict[tuple, list[tuple[_GraphState, float]]] = {}
        self.searches: dict[tuple, _GraphSearch] = {}

    def cost(self, pl: tuple[int, ...], m: int, new: int) -> float:
        """DTensor's ``one_step_redistribute_cost`` of moving mesh dim ``m`` to ``new``."""
        from torch.distributed.tensor._collective_utils import (
            _compute_placement_transition_cost,
        )

        num_shards = 1
        for i, p in enumerate(pl):
            if _P_DIM[p] >= 0:
                num_shards *= self.mesh_shape[i]
        key = (pl[m], new, m, num_shards)
        c = self.costs.get(key)
        if c is None:
            gb = self.nbytes / num_shards / 1024 / 1024 / 1024
            c = self.costs[key] = _compute_placement_transition_cost(
                _P_OBJ[pl[m]], _P_OBJ[new], self.topo, m, gb
            )[0]
        return c

    def next_states(self, state: _GraphState, ops: tuple[str, ...]) -> list:
        """``get_next_state``: [(next state, cost)] in DTensor's insertion order."""
        key = (state, ops)
        hit = self.edges.get(key)
        if hit is not None:
            return hit
        pl, order = state
        ndim, cat = self.ndim, _P_CAT
        out: dict[_GraphState, float] = {}
        dims: dict[int, list[int]] = {td: list(mds) for td, mds in order}

        def add(m: int, new: int) -> None:
            new_pl = pl[:m] + (new,) + pl[m + 1 :]
            new_order = tuple((td, tuple(v)) for td, v in sorted(dims.items()) if v)
            out[(new_pl, new_order)] = self.cost(pl, m, new)

        # case 1: Shard(a) -> Shard(b) (all-to-all) of the last mesh dim sharding a
        for td, mds in order:
            if cat[pl[mds[-1]]] != _C_S:
                continue
            for dtd in range(ndim):
                if dtd == td:
                    continue
                move = dims[td].pop()
                dims.setdefault(dtd, []).append(move)
                add(move, _shard_pid(dtd))
                dims[td].append(move)
                dims[dtd].pop()
        # case 2: Shard -> Replicate (all-gather) of the last mesh dim sharding a
        for td, mds in order:
            if cat[pl[mds[-1]]] != _C_S:
                continue
            move = dims[td].pop()
            add(move, _R_PID)
            dims[td].append(move)
        # case 3: Partial -> Replicate
        for m, p in enumerate(pl):
            if cat[p] in (_C_P, _C_MP):
                add(m, _R_PID)
        # case 4: Replicate -> Shard(b); case 5: Partial -> Shard(b)
        for partial in (False, True):
            for m, p in enumerate(pl):
                if (cat[p] in (_C_P, _C_MP)) if partial else (cat[p] == _C_R):
                    for dtd in range(ndim):
                        dims.setdefault(dtd, []).append(m)
                        add(m, _shard_pid(dtd))
                        dims[dtd].pop()
        # case 6: Replicate -> Partial(op), op of src/dst, no mixed reduce ops
        for m, p in enumerate(pl):
            if cat[p] != _C_R:
                continue
            for op in ops:
                new = _pid(Partial(op))
                new_pl = pl[:m] + (new,) + pl[m + 1 :]
                used = {_P_OP[q] for q in new_pl if cat[q] in (_C_P, _C_MP)}
                if len(used) > 1 and used != {"sum", "avg"}:
                    continue
                add(m, new)
        # cases 7-11 concern _StridedShard placements, gone after decoding into shard order
        hit = self.edges[key] = list(out.items())
        return hit


class _GraphSearch:
    """A resumable ``find_min_cost_path`` from one source state (all targets)."""

    def __init__(self, ctx: _GraphContext, src: _GraphState, ops: tuple[str, ...]) -> None:
        self.ctx = ctx
        self.ops = ops
        # (cost sort key, push counter, cost, state, path link); link = (state, parent link)
        self.heap: list[tuple] = [(0.0, 0, 0.0, src, (src, None))]
        self.counter = 0
        self.popped: dict[_GraphState, tuple] = {}  # first pop (= visited) -> path link

    def path(self, dst: _GraphState) -> list[_GraphState] | None:
        """Min-cost path to ``dst`` as DTensor finds it; None if there is none."""
        import heapq

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


_GRAPH_CONTEXTS: dict[tuple[tuple[int, ...], int, int], _GraphContext] = {}


@functools.lru_cache(maxsize=1 << 14)
def _graph_state(
    placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> tuple[_GraphState, tuple] | None:
    """(state, normalized placements) of a spec as DTensor's graph planner starts from it:
    ``_StridedShard`` s decoded into Shards plus a shard order (None if they cannot be:
    ``_StridedShardNotDecodableError``), else the default order."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, _StridedShardNotDecodableError

    mesh = _planning_mesh(mesh_shape)
    if any(_cat(p) == "SS" for p in placements):
        try:
            norm, order = DTensorSpec._normalize_placements_into_shard_order(placements, mesh, True)
        except _StridedShardNotDecodableError:
            return None
    else:
        norm, order = placements, DTensorSpec.compute_default_shard_order(placements)
    state = (
        tuple(_pid(p) for p in norm),
        tuple((int(e.tensor_dim), tuple(int(m) for m in e.mesh_dims)) for e in order),
    )
    return state, tuple(norm)


def _plan_strided(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...] | None,
) -> tuple[Step, ...] | None:
    """:func:`_plan_uncached` for pairs involving a ``_StridedShard``: DTensor's graph
    planner (re-implemented above), or, when a ``_StridedShard`` cannot be decoded into a
    shard order, the greedy planner DTensor then falls back to."""
    if _mixed_partials(src) or _mixed_partials(dst):
        return None
    shape = _planning_shape(src, dst, mesh_shape, shape)
    try:
        src_g = _graph_state(src, mesh_shape)
        dst_g = _graph_state(dst, mesh_shape)
    except (AssertionError, ValueError, RuntimeError, NotImplementedError):
        return None
    if src_g is None or dst_g is None:  # _StridedShardNotDecodableError
        # DTensor falls back to its greedy planner, on the real mesh: it runs the
        # inner-to-outer pass iff num_shards > 1 (Shard or _StridedShard on a mesh dim
        # of size > 1); a _StridedShard is neither a Shard target nor is_shard(d).
        shards = any(_is_shard_like(p) and n > 1 for p, n in zip(src, mesh_shape, strict=True))
        src_pids = tuple(_pid(p) for p in src)
        tr = _greedy_transforms(src_pids, tuple(_pid(p) for p in dst), shards)
        return _steps_from_transforms(src, [(m, _P_OBJ[a], _P_OBJ[b]) for m, a, b in tr])
    (src_state, src_norm), (dst_state, dst_norm) = src_g, dst_g
    ops_set: set[str] = set()  # built like DTensor's, so it iterates in the same order
    for p in (*src_norm, *dst_norm):
        if _P_CAT[_pid(p)] in (_C_P, _C_MP):
            ops_set.add(p.reduce_op)
    ops = tuple(ops_set)
    ckey = (mesh_shape, len(shape), math.prod(shape))
    ctx = _GRAPH_CONTEXTS.get(ckey)
    if ctx is None:
        ctx = _GRAPH_CONTEXTS[ckey] = _GraphContext(*ckey)
    skey = (src_state, ops)
    search = ctx.searches.get(skey)
    if search is None:
        search = ctx.searches[skey] = _GraphSearch(ctx, src_state, ops)
    path = search.path(dst_state)
    if path is None:
        return None  # DTensor: "No path found" (AssertionError)
    transforms = []
    for (cur, _), (nxt, _) in zip(path, path[1:]):
        changed = [m for m in range(len(cur)) if cur[m] != nxt[m]]
        if not changed:
            continue
        if len(changed) > 1:
            return None  # DTensor asserts
        m = changed[0]
        transforms.append((m, _P_OBJ[cur[m]], _P_OBJ[nxt[m]]))
    return _steps_from_transforms(src, transforms)


@functools.lru_cache(maxsize=1 << 14)
def _spec(
    placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], shape: tuple[int, ...]
) -> Any:
    """DTensorSpec of ``placements`` for a contiguous float32 tensor of ``shape``."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    meta = TensorMeta(torch.Size(shape), stride, torch.float32)
    return DTensorSpec(_planning_mesh(mesh_shape), tuple(placements), tensor_meta=meta)


@functools.lru_cache(maxsize=1 << 18)
def _plan_cached(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...] | None,
) -> tuple[Step, ...] | None:
    if shape is None and not any(_cat(p) == "SS" for p in (*src, *dst)):
        return _plan_rules(src, dst)
    return _plan_strided(src, dst, mesh_shape, shape)


def plan(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int] | None = None,
    shape: Sequence[int] | None = None,
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
            (see :func:`normalize_placements`).
        mesh_shape: the mesh shape (used for ``_StridedShard`` plans only).
        shape: the tensor's global shape (used for ``_StridedShard`` plans only).

    Returns:
        ``()`` if ``src == dst``; a tuple of :class:`Step`; or ``None`` if illegal.

    Raises:
        ValueError: if lengths differ or a shard dim is negative.
    """
    src = normalize_placements(src)
    dst = normalize_placements(dst)
    if len(src) != len(dst):
        raise ValueError(f"src {src} and dst {dst} have different numbers of mesh dims")
    if mesh_shape is not None and len(mesh_shape) != len(src):
        raise ValueError(f"mesh_shape {tuple(mesh_shape)} does not match placements {src}")
    return _plan_normalized(
        src,
        dst,
        None if mesh_shape is None else tuple(int(s) for s in mesh_shape),
        None if shape is None else tuple(int(s) for s in shape),
    )


def _plan_normalized(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...] | None,
    shape: tuple[int, ...] | None,
) -> tuple[Step, ...] | None:
    """:func:`plan` for already normalized, length-checked placements."""
    if src == dst:
        return ()
    if any(_cat(p) == "SS" for p in (*src, *dst)):
        key_mesh = mesh_shape if mesh_shape is not None else (2,) * len(src)
        return _plan_cached(src, dst, key_mesh, shape)
    return _plan_cached(src, dst, (2,) * len(src), None)


# --------------------------------------------------------------------------- costing


@dataclass(frozen=True)
class _HwParams:
    lat: np.ndarray  # [2 (intra, inter), 4 collectives] µs
    bw: np.ndarray  # [2, 4] bytes/s
    hbm: float  # effective bytes/s for local reshuffles
    gpus_per_node: int


def _hw_params(hw: Any) -> _HwParams:
    lat = np.empty((2, 4))
    bw = np.empty((2, 4))
    for li, link in enumerate((hw.intra_node, hw.inter_node)):
        for ki, kind in enumerate(_COLLECTIVE_KINDS):
            lat[li, ki] = float(getattr(link, f"{kind}_latency_us"))
            bw[li, ki] = float(getattr(link, f"{kind}_bw"))
    return _HwParams(
        lat, bw, float(hw.hbm_bandwidth) * float(hw.memory_efficiency), int(hw.gpus_per_node)
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _step_bytes(step: Step, shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, int]:
    """(G, L) element counts of ``step`` for a tensor of ``shape``."""
    div = [1] * len(shape)
    for td, md in step.divs:
        div[td] *= mesh_shape[md]
    g = 1
    for s, d in zip(shape, div):
        g *= _cdiv(s, d)
    if step.own_dim is None:
        return g, g
    div[step.own_dim] *= mesh_shape[step.mesh_dim]
    loc = 1
    for s, d in zip(shape, div):
        loc *= _cdiv(s, d)
    return g, loc


def _collective_bytes(kind: str, n: int, g_bytes: int, l_bytes: int) -> int:
    """Bytes ``S`` of the alpha-beta term: ``n * L`` for all-gather / reduce-scatter,
    ``L`` for all-to-all, ``G`` for all-reduce, 0 for a local step."""
    if kind in ("all_gather", "reduce_scatter"):
        return n * l_bytes
    if kind == "all_to_all":
        return l_bytes
    if kind == "all_reduce":
        return g_bytes
    return 0


def _step_us(
    step: Step,
    shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
    links: Sequence[str],
    hp: _HwParams,
) -> float:
    n = mesh_shape[step.mesh_dim]
    if n <= 1:
        return 0.0
    g, loc = _step_bytes(step, shape, mesh_shape)
    g_bytes = g * itemsize
    l_bytes = loc * itemsize
    comm = 0.0
    comm_bytes = _collective_bytes(step.kind, n, g_bytes, l_bytes)
    if step.kind in _COLLECTIVE_KINDS:
        ki = _KIND_CODE[step.kind]
        li = 0 if links[step.mesh_dim] == "intra" else 1
        factor = COLLECTIVE_FACTOR[step.kind]
        lat = float(hp.lat[li, ki])
        bw = float(hp.bw[li, ki])
        comm = lat + (factor * (n - 1) / n) * (comm_bytes / bw) * 1e6
    resh = 0.0
    if step.reshuffle:
        rb = l_bytes if step.reshuffle_local else comm_bytes
        resh = (2.0 * rb) / hp.hbm * 1e6
    return comm + resh


def _check_inputs(shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int]) -> None:
    if any((not isinstance(s, (int, np.integer))) or s < 0 for s in shape):
        raise ValueError(f"shape must be non-negative ints, got {tuple(shape)}")
    if not (isinstance(itemsize, (int, np.integer)) and itemsize > 0):
        raise ValueError(f"itemsize must be a positive int (bytes per element), got {itemsize!r}")
    if len(mesh_shape) == 0 or any(int(s) < 1 for s in mesh_shape):
        raise ValueError(f"mesh_shape must be >= 1 per dim, got {tuple(mesh_shape)}")


def _check_dims(placements: Sequence[Placement], ndim: int, mesh_ndim: int, what: str) -> None:
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{what} placements {tuple(placements)} have {len(placements)} entries "
            f"for a {mesh_ndim}-d mesh"
        )
    for p in placements:
        if _is_shard_like(p) and not -ndim <= p.dim < ndim:
            raise ValueError(f"{what} placement {p} out of range for a {ndim}-d tensor")


def redistribute_us(
    shape: Sequence[int],
    itemsize: int,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int],
    hw: Any,
) -> float:
    """Time in µs to redistribute a tensor from ``src`` to ``dst`` placements.

    Args:
        shape: the tensor's global (logical) shape.
        itemsize: bytes per element (e.g. 2 for bf16, 4 for fp32).
        src, dst: placements, one per mesh dim.
        mesh_shape: the device mesh shape.
        hw: :class:`~pipeline.costmodel.hardware.HardwareConfig` (or DictConfig).

    Returns:
        0.0 if ``src == dst``; ``math.inf`` if DTensor forbids the redistribution;
        else the sum of the per-step costs (see module docstring). No transition
        penalty is included.

    Raises:
        ValueError: for inconsistent shapes / placements / mesh.
    """
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    steps = _checked_plan(shape, itemsize, src, dst, mesh_shape)
    if steps is None:
        return math.inf
    if not steps:
        return 0.0
    hp = _hw_params(hw)
    links = mesh_links(mesh_shape, hp.gpus_per_node)
    total = 0.0
    for step in steps:
        total += _step_us(step, shape, int(itemsize), mesh_shape, links, hp)
    return total


def _checked_plan(shape: tuple[int, ...], itemsize: int, src: Sequence[Placement],
                  dst: Sequence[Placement], mesh_shape: tuple[int, ...]
                  ) -> tuple[Step, ...] | None:
    _check_inputs(shape, itemsize, mesh_shape)
    _check_dims(src, len(shape), len(mesh_shape), "src")
    _check_dims(dst, len(shape), len(mesh_shape), "dst")
    src_n = normalize_placements(src, len(shape))
    dst_n = normalize_placements(dst, len(shape))
    return _plan_normalized(src_n, dst_n, mesh_shape, shape)


@dataclass(frozen=True)
class StepCost:
    """One step of a costed redistribution, for reports.

    Attributes:
        kind: one of :data:`KINDS` (all_gather, reduce_scatter, all_reduce,
            all_to_all, local_shard, local_partial).
        mesh_dim: the mesh dim the step runs over.
        bytes: bytes each device sends into the collective (the ``S`` of the
            alpha-beta model: ``n * L`` for all-gather / reduce-scatter, ``L`` for
            all-to-all, ``G`` for all-reduce); 0 for a local op.
        us: the step's time in µs, collective plus local reshuffle.
    """

    kind: str
    mesh_dim: int
    bytes: int
    us: float


def redistribute_steps(
    shape: Sequence[int],
    itemsize: int,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int],
    hw: Any,
) -> list[StepCost] | None:
    """The steps of :func:`redistribute_us` with their kinds, bytes and µs.

    Same arguments and errors as :func:`redistribute_us`; steps over mesh dims of
    size 1 (which cost nothing) are left out. The ``us`` fields summed in order
    equal ``redistribute_us`` exactly.

    Returns:
        ``[]`` if ``src == dst``; ``None`` if DTensor forbids the redistribution.
    """
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    steps = _checked_plan(shape, itemsize, src, dst, mesh_shape)
    if steps is None:
        return None
    hp = _hw_params(hw)
    links = mesh_links(mesh_shape, hp.gpus_per_node)
    out = []
    for step in steps:
        if mesh_shape[step.mesh_dim] <= 1:
            continue
        g, loc = _step_bytes(step, shape, mesh_shape)
        nbytes = _collective_bytes(step.kind, mesh_shape[step.mesh_dim], g * int(itemsize),
                                   loc * int(itemsize))
        out.append(StepCost(step.kind, step.mesh_dim, nbytes,
                            _step_us(step, shape, int(itemsize), mesh_shape, links, hp)))
    return out


# --------------------------------------------------------------------------- table
#
# Tables are built from per-*pair* records cached across tables. A context (one per mesh
# shape and tensor ndim) interns placement tuples to small ints and compiles each (src,
# dst) pair once: its plan's steps become *step ids* (a step = kind, mesh dim,
# per-tensor-dim divisors of G and L, reshuffle flags; equal steps share one id) and the
# pair's tuple of step ids a *record id*, kept in a dense [n_placements, n_placements]
# matrix. Pairs involving a _StridedShard have shape-dependent plans (DTensor's graph
# planner weighs steps by the tensor's bytes), so their record ids live in one more such
# matrix per tensor shape. A table gathers its record ids with numpy, costs every step of
# the context once (vectorised alpha-beta, as in redistribute_us), sums each record's
# steps in plan order (one column at a time, so the float additions are those of
# redistribute_us) and gathers the records' costs. New pairs without a _StridedShard are
# planned in one vectorised batch (the greedy planner of _greedy_transforms, on arrays);
# those with one, one by one (plan()).

_NULL_STEP = 0  # padding, and steps on mesh dims of size 1: cost 0
_ILLEGAL_STEP = 1  # an illegal pair's record is (_ILLEGAL_STEP,): cost +inf

# numpy copies of the pid tables (_P_CAT, _P_DIM) and of _transform over all pid pairs,
# rebuilt when new placements have been interned
_PID_ARRAYS: dict[str, Any] = {"n": 0}


def _pid_arrays() -> dict[str, Any]:
    n = len(_P_OBJ)
    if _PID_ARRAYS["n"] != n:
        t_kind = np.full((n, n), -1, dtype=np.int64)  # -1: illegal
        t_resh = np.zeros((n, n), dtype=np.int64)
        t_resh_local = np.zeros((n, n), dtype=np.int64)
        t_own = np.full((n, n), -1, dtype=np.int64)
        for a in range(n):
            for b in range(n):
                t = _transform(a, b) if a != b else None
                if t is not None:
                    t_kind[a, b], t_resh[a, b], t_resh_local[a, b], t_own[a, b] = t
        _PID_ARRAYS.update(
            n=n,
            cat=np.asarray(_P_CAT, dtype=np.int64),
            dim=np.asarray(_P_DIM, dtype=np.int64),
            kind=t_kind,
            resh=t_resh,
            resh_local=t_resh_local,
            own=t_own,
        )
    return _PID_ARRAYS


class _TableContext:
    """Interned placements, step and record stores of one (mesh shape, tensor ndim)."""

    def __init__(self, mesh_shape: tuple[int, ...], ndim: int) -> None:
        self.mesh_shape = mesh_shape
        self.ndim = ndim
        # as-passed (validated) tuple -> id; and by id() of the tuple object, holding a
        # reference so the id() stays unique (placements hash in Python: slow)
        self.raw_ids: dict[tuple, int] = {}
        self.obj_ids: dict[int, tuple[Sequence[Placement], int]] = {}
        self.norm_ids: dict[tuple[Placement, ...], int] = {}  # normalized tuple -> id
        self.norms: list[tuple[Placement, ...]] = []
        self.cap = 0
        self.pids = np.zeros((0, len(mesh_shape)), dtype=np.int64)  # per id, per mesh dim
        self.strided = np.zeros(0, dtype=bool)  # per id: holds a _StridedShard
        self.mixed = np.zeros(0, dtype=bool)  # per id: mixes Partial reduce ops (illegal)
        self.sharded = np.zeros(0, dtype=bool)  # per id: holds a Shard
        # per id: holds a Shard or _StridedShard on a mesh dim of size > 1 (num_shards > 1)
        self.sharded_real = np.zeros(0, dtype=bool)
        # per id: holds a _StridedShard DTensor cannot decode into a shard order: its
        # pairs take DTensor's greedy planner (shape independent), not the graph planner
        self.undecodable = np.zeros(0, dtype=bool)
        self.graph_error = np.zeros(0, dtype=bool)
        self.any_strided = False
        self.pair = np.zeros((0, 0), dtype=np.int32)  # record id, -1 unknown
        self.shape_pair: dict[tuple[int, ...], np.ndarray] = {}  # strided pairs, per shape
        self.step_ids: dict[tuple, int] = {}
        # step fields, one entry per step id; ids 0 and 1 are the null / illegal steps
        null = (_KIND_CODE["local_partial"], 0, (1,) * ndim, (1,) * ndim, False, False)
        self.step_rows: list[tuple] = [null, null]
        self.step_keys: dict[int, int] = {}  # batch planner's step key -> step id
        self.record_ids: dict[tuple[int, ...], int] = {}
        self.records: list[tuple[int, ...]] = []
        self._step_arrays: tuple[np.ndarray, ...] | None = None
        self._record_array: np.ndarray | None = None  # rows of records[:_records_done]
        self._records_done = 0
        # (shape, itemsize, hardware) -> (n steps, step costs, record costs)
        self.cost_cache: dict[tuple, tuple[int, np.ndarray, np.ndarray]] = {}
        self.record_id(())  # record 0: equal placements / only free steps
        self.record_id((_ILLEGAL_STEP,))  # record 1: illegal

    # -- interning -------------------------------------------------------------------------

    def intern(self, placements: Sequence[Sequence[Placement]], what: str) -> np.ndarray:
        """Local ids of ``placements`` (validated and normalized on first sight)."""
        ids = np.empty(len(placements), dtype=np.intp)
        raw_ids, obj_ids = self.raw_ids, self.obj_ids
        for k, pl in enumerate(placements):
            hit = obj_ids.get(id(pl))
            if hit is not None and hit[0] is pl:
                ids[k] = hit[1]
                continue
            key = pl if type(pl) is tuple else tuple(pl)
            i = raw_ids.get(key)
            if i is None:
                _check_dims(key, self.ndim, len(self.mesh_shape), what)
                norm = normalize_placements(key, self.ndim)
                i = self.norm_ids.get(norm)
                if i is None:
                    i = self._add(norm)
                raw_ids[key] = i
            if type(pl) is tuple:
                obj_ids[id(pl)] = (pl, i)
            ids[k] = i
        return ids

    def _add(self, norm: tuple[Placement, ...]) -> int:
        i = self.norm_ids[norm] = len(self.norms)
        self.norms.append(norm)
        if i >= self.cap:
            self._grow(max(16, 2 * self.cap))
        self.pids[i] = [_pid(p) for p in norm]
        self.strided[i] = any(_cat(p) == "SS" for p in norm)
        self.mixed[i] = _mixed_partials(norm)
        self.sharded[i] = any(_cat(p) == "S" for p in norm)
        self.sharded_real[i] = any(
            _is_shard_like(p) and n > 1 for p, n in zip(norm, self.mesh_shape, strict=True)
        )
        if self.strided[i]:
            try:
                self.undecodable[i] = _graph_state(norm, self.mesh_shape) is None
            except (AssertionError, ValueError, RuntimeError, NotImplementedError):
                self.graph_error[i] = True  # _plan_strided: None; planned one by one
        self.any_strided = self.any_strided or bool(self.strided[i])
        return i

    def _grow(self, cap: int) -> None:
        old = self.cap

        def grow(a: np.ndarray, fill: Any) -> np.ndarray:
            out = np.full((cap, *a.shape[1:]), fill, dtype=a.dtype)
            out[:old] = a
            return out

        def grow2(a: np.ndarray) -> np.ndarray:
            out = np.full((cap, cap), -1, dtype=np.int32)
            out[:old, :old] = a
            return out

        self.pids = grow(self.pids, 0)
        self.strided = grow(self.strided, False)
        self.mixed = grow(self.mixed, False)
        self.sharded = grow(self.sharded, False)
        self.sharded_real = grow(self.sharded_real, False)
        self.undecodable = grow(self.undecodable, False)
        self.graph_error = grow(self.graph_error, False)
        self.pair = grow2(self.pair)
        self.shape_pair = {k: grow2(v) for k, v in self.shape_pair.items()}
        self.cap = cap

    def step_id(self, row: tuple) -> int:
        i = self.step_ids.get(row)
        if i is None:
            i = self.step_ids[row] = len(self.step_rows)
            self.step_rows.append(row)
            self._step_arrays = None
        return i

    def record_id(self, rec: tuple[int, ...]) -> int:
        i = self.record_ids.get(rec)
        if i is None:
            i = self.record_ids[rec] = len(self.records)
            self.records.append(rec)
        return i

    # -- compiling pairs -------------------------------------------------------------------

    def record_matrix(self, si: np.ndarray, di: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Record ids [len(si), len(di)], compiling the pairs not seen before."""
        ix = np.ix_(si, di)
        rec = self.pair[ix]
        strided = None
        if self.any_strided and (self.strided[si].any() or self.strided[di].any()):
            # graph-planned pairs: a _StridedShard on a side, both sides decodable
            # (or DTensor errors out on one: planned one by one as well)
            strided = (self.strided[si][:, None] | self.strided[di][None, :]) & (
                ~(self.undecodable[si][:, None] | self.undecodable[di][None, :])
                | self.graph_error[si][:, None]
                | self.graph_error[di][None, :]
            )
            if strided.any():
                sp = self.shape_pair.get(shape)
                if sp is None:
                    sp = self.shape_pair[shape] = np.full((self.cap, self.cap), -1, np.int32)
                rec = np.where(strided, sp[ix], rec)
            else:
                strided = None
        missing = rec < 0
        if missing.any():
            a, b = np.nonzero(missing)
            i, j = si[a], di[b]
            if strided is None:
                self.compile_pairs(i, j)
            else:
                s = strided[a, b]
                self.compile_pairs(i[~s], j[~s])
                sp = self.shape_pair[shape]
                for ii, jj in set(zip(i[s].tolist(), j[s].tolist(), strict=True)):
                    steps = _plan_normalized(self.norms[ii], self.norms[jj], self.mesh_shape, shape)
                    sp[ii, jj] = self.record_id(self.steps_record(steps))
                rec = np.where(strided, sp[ix], self.pair[ix])
                return rec
            rec = self.pair[ix]
        return rec

    def steps_record(self, steps: tuple[Step, ...] | None) -> tuple[int, ...]:
        """Step ids of a :func:`plan` result."""
        if steps is None:
            return (_ILLEGAL_STEP,)
        mesh_shape, ndim = self.mesh_shape, self.ndim
        ids = []
        for st in steps:
            if mesh_shape[st.mesh_dim] <= 1:
                continue  # DTensor skips it; redistribute_us costs it 0.0
            g = [1] * ndim
            for td, md in st.divs:
                g[td] *= mesh_shape[md]
            loc = list(g)
            if st.own_dim is not None:
                loc[st.own_dim] *= mesh_shape[st.mesh_dim]
            row = (
                _KIND_CODE[st.kind],
                st.mesh_dim,
                tuple(g),
                tuple(loc),
                st.reshuffle,
                st.reshuffle_local,
            )
            ids.append(self.step_id(row))
        return tuple(ids)

    def compile_pairs(self, i: np.ndarray, j: np.ndarray) -> None:
        """Plan the pairs ``(i[k], j[k])`` (greedy-planned: no _StridedShard, or one DTensor
        cannot decode) with the planner of :func:`_plan_rules` / :func:`_plan_strided`
        run on arrays, and store their record ids in :attr:`pair`."""
        if not len(i):
            return
        key = np.unique(i.astype(np.int64) * self.cap + j)
        i, j = key // self.cap, key % self.cap
        out = np.full(len(i), -1, dtype=np.int64)
        out[i == j] = 0
        out[(out < 0) & (self.mixed[i] | self.mixed[j])] = 1
        todo = np.flatnonzero(out < 0)
        if len(todo):
            out[todo] = self._batch_records(i[todo], j[todo])
        self.pair[i, j] = out

    def _batch_records(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Record ids of greedy-planned pairs, planned on arrays: the steps of
        :func:`_greedy_transforms` + :func:`_steps_from_transforms`, as :func:`plan`
        makes them (tests check it)."""
        pa = _pid_arrays()
        cat, dim = pa["cat"], pa["dim"]
        mesh_shape, ndim = self.mesh_shape, self.ndim
        n_mesh = len(mesh_shape)
        src, dst = self.pids[i], self.pids[j]
        cur = src.copy()
        slots: list[tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]] = []

        def step(valid: np.ndarray, m: int, target: np.ndarray) -> None:
            slots.append((valid, m, cur[:, m].copy(), target, cur.copy()))
            cur[:, m] = np.where(valid, target, cur[:, m])

        if n_mesh == 1:
            step(src[:, 0] != dst[:, 0], 0, dst[:, 0].copy())
        else:
            # num_shards > 1: on the canonical planning mesh without a _StridedShard, on
            # the real mesh in DTensor's fallback for an undecodable _StridedShard
            strided = self.strided[i] | self.strided[j]
            shards = np.where(strided, self.sharded_real[i], self.sharded[i])
            for m in range(n_mesh - 1, -1, -1):  # inner to outer, if src shards
                t = dst[:, m].copy()
                mismatch = np.zeros(len(i), dtype=bool)
                for k in range(m):  # outer dims, untouched so far: cur == src
                    mismatch |= (src[:, k] == t) != (dst[:, k] == t)
                t[(cat[t] == _C_S) & mismatch] = _R_PID
                step(shards & (cur[:, m] != t), m, t)
            for m in range(n_mesh):  # outer to inner
                step(cur[:, m] != dst[:, m], m, dst[:, m].copy())

        n_slot = len(slots)
        ids = np.zeros((len(i), n_slot), dtype=np.int64)
        illegal = np.zeros(len(i), dtype=bool)
        base = ndim + 1
        for s, (valid, m, a, b, state) in enumerate(slots):
            kind = pa["kind"][a, b]
            illegal |= valid & (kind < 0)
            live = valid & (kind >= 0)
            if mesh_shape[m] <= 1 or not live.any():
                continue  # size-1 mesh dim: the null step (DTensor skips it)
            # integer key of the step row: kind, flags, own dim, mesh dim and the tensor
            # dim each other mesh dim shards (or none)
            key = kind * 2 + pa["resh"][a, b]
            key = key * 2 + pa["resh_local"][a, b]
            key = key * base + pa["own"][a, b] + 1
            key = key * n_mesh + m
            for k in range(n_mesh):
                key = key * base + (0 if k == m else dim[state[:, k]] + 1)
            sel = np.flatnonzero(live)
            uniq, inv = np.unique(key[sel], return_inverse=True)
            uniq_ids = np.fromiter((self._key_step(int(u)) for u in uniq), np.int64, len(uniq))
            ids[sel, s] = uniq_ids[inv.reshape(-1)]
        ids[illegal] = 0
        ids[illegal, 0] = _ILLEGAL_STEP
        # a record is the tuple of the non-null step ids in order; distinct rows found by
        # sorting them as raw bytes (np.unique(axis=0) lexsorts: several times slower)
        ids = np.ascontiguousarray(ids)
        as_bytes = ids.view(np.dtype((np.void, ids.itemsize * n_slot))).reshape(-1)
        uniq, inv = np.unique(as_bytes, return_inverse=True)
        rows = uniq.view(ids.dtype).reshape(-1, n_slot)
        rec = np.fromiter(
            (self.record_id(tuple(int(x) for x in r if x)) for r in rows.tolist()),
            np.int64,
            len(rows),
        )
        return rec[inv.reshape(-1)]

    def _key_step(self, key: int) -> int:
        """Step id of a batch planner step key (decoded on first sight)."""
        sid = self.step_keys.get(key)
        if sid is None:
            n_mesh, base, mesh_shape = len(self.mesh_shape), self.ndim + 1, self.mesh_shape
            rest = key
            shard_dims = []
            for _ in range(n_mesh):
                rest, r = divmod(rest, base)
                shard_dims.append(r - 1)
            shard_dims.reverse()
            rest, m = divmod(rest, n_mesh)
            rest, own = divmod(rest, base)
            rest, resh_local = divmod(rest, 2)
            kind, resh = divmod(rest, 2)
            g = [1] * self.ndim
            for k, td in enumerate(shard_dims):
                if td >= 0:
                    g[td] *= mesh_shape[k]
            loc = list(g)
            if own >= 1:
                loc[own - 1] *= mesh_shape[m]
            row = (kind, m, tuple(g), tuple(loc), bool(resh), bool(resh_local))
            sid = self.step_keys[key] = self.step_id(row)
        return sid

    # -- arrays ----------------------------------------------------------------------------

    def step_arrays(self) -> tuple[np.ndarray, ...]:
        if self._step_arrays is None:
            rows = self.step_rows
            n = len(rows)
            self._step_arrays = (
                np.fromiter((r[0] for r in rows), np.int64, n),
                np.fromiter((r[1] for r in rows), np.int64, n),
                np.asarray([r[2] for r in rows], dtype=np.int64).reshape(n, self.ndim),
                np.asarray([r[3] for r in rows], dtype=np.int64).reshape(n, self.ndim),
                np.fromiter((r[4] for r in rows), bool, n),
                np.fromiter((r[5] for r in rows), bool, n),
            )
        return self._step_arrays

    def record_array(self) -> np.ndarray:
        """[n_records, width] step ids, padded with the null step (extended in place as
        records are added)."""
        arr, done, n = self._record_array, self._records_done, len(self.records)
        if arr is not None and done == n:
            return arr[:n]
        width = max(1, max(len(r) for r in self.records[done:]))
        if arr is None or width > arr.shape[1] or n > len(arr):
            old_width = 0 if arr is None else arr.shape[1]
            cap = max(n, 2 * (0 if arr is None else len(arr)), 64)
            grown = np.full((cap, max(width, old_width)), _NULL_STEP, dtype=np.intp)
            if arr is not None:
                grown[:done, :old_width] = arr[:done]
            arr = self._record_array = grown
        for k in range(done, n):
            r = self.records[k]
            arr[k, : len(r)] = r
        self._records_done = n
        return arr[:n]


_CONTEXTS: dict[tuple[tuple[int, ...], int], _TableContext] = {}


def _step_costs(
    ctx: _TableContext, shape: tuple[int, ...], itemsize: int, hp: _HwParams
) -> np.ndarray:
    """Cost (µs) of every step of ``ctx`` for a tensor of ``shape``: the arithmetic of
    :func:`_step_us`, vectorised (bit-identical per element)."""
    kind, mdim, div_g, div_l, reshuffle, reshuffle_local = ctx.step_arrays()
    ndim = ctx.ndim
    links = mesh_links(ctx.mesh_shape, hp.gpus_per_node)
    mesh_arr = np.asarray(ctx.mesh_shape, dtype=np.int64)
    link_idx = np.asarray([0 if lk == "intra" else 1 for lk in links], dtype=np.int64)
    shape_arr = np.asarray(shape, dtype=np.int64)
    g = np.prod(-(-shape_arr // div_g), axis=1) if ndim else np.ones(len(kind), np.int64)
    loc = np.prod(-(-shape_arr // div_l), axis=1) if ndim else g
    g_bytes = g * int(itemsize)
    l_bytes = loc * int(itemsize)
    n = mesh_arr[mdim]
    is_coll = kind < 4
    kc = np.where(is_coll, kind, 0)
    li = link_idx[mdim]
    comm_bytes = np.where(
        (kind == _KIND_CODE["all_gather"]) | (kind == _KIND_CODE["reduce_scatter"]),
        n * l_bytes,
        np.where(kind == _KIND_CODE["all_to_all"], l_bytes, g_bytes),
    )
    comm_bytes = np.where(is_coll, comm_bytes, 0)
    factor = np.asarray([COLLECTIVE_FACTOR[k] for k in _COLLECTIVE_KINDS])[kc]
    lat = hp.lat[li, kc]
    bw = hp.bw[li, kc]
    comm = lat + (factor * (n - 1) / n) * (comm_bytes / bw) * 1e6
    comm = np.where(is_coll, comm, 0.0)
    rb = np.where(reshuffle_local, l_bytes, comm_bytes)
    resh = np.where(reshuffle, (2.0 * rb) / hp.hbm * 1e6, 0.0)
    cost = comm + resh
    cost[_NULL_STEP] = 0.0
    cost[_ILLEGAL_STEP] = np.inf
    return cost


def redistribute_table(
    shape: Sequence[int],
    itemsize: int,
    srcs: Sequence[Sequence[Placement]],
    dsts: Sequence[Sequence[Placement]],
    mesh_shape: Sequence[int],
    hw: Any,
) -> np.ndarray:
    """All-pairs :func:`redistribute_us`: ``out[i, j]`` = cost of ``srcs[i] -> dsts[j]``.

    Vectorised: each ``(src, dst)`` pair is planned once per mesh shape and tensor ndim
    (and shape, if a ``_StridedShard`` is involved), across tables, and compiled into a
    record of step ids; a table gathers its pairs' records, costs the steps with numpy
    and sums each record in plan order, so every entry is bit-identical to
    :func:`redistribute_us`.

    Args:
        shape, itemsize, mesh_shape, hw: as in :func:`redistribute_us`.
        srcs: source placements (rows), each one per mesh dim.
        dsts: destination placements (columns).

    Returns:
        float64 array ``[len(srcs), len(dsts)]`` in µs; ``inf`` where illegal, 0 where
        the placements are equal. A fresh array the caller may modify.

    Raises:
        ValueError: for inconsistent shapes / placements / mesh.
    """
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    _check_inputs(shape, itemsize, mesh_shape)
    key = (mesh_shape, len(shape))
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        ctx = _CONTEXTS[key] = _TableContext(mesh_shape, len(shape))
    si = ctx.intern(srcs, "src")
    di = ctx.intern(dsts, "dst")
    rec = ctx.record_matrix(si, di, shape)
    return _record_costs(ctx, shape, int(itemsize), hw)[rec]


def _record_costs(ctx: _TableContext, shape: tuple[int, ...], itemsize: int, hw: Any) -> np.ndarray:
    """Cost (µs) of every record of ``ctx``: its steps' costs summed in plan order, one
    column at a time (null padding adds an exact 0.0), so each equals
    :func:`redistribute_us`. Cached per (shape, itemsize, hardware); records added since
    are costed on the next call (a record's cost never changes)."""
    hp = _hw_params(hw)
    key = (shape, itemsize, hp.lat.tobytes(), hp.bw.tobytes(), hp.hbm, hp.gpus_per_node)
    records = ctx.record_array()
    n_steps = len(ctx.step_rows)
    hit = ctx.cost_cache.get(key)
    if hit is not None and hit[0] == n_steps and len(hit[2]) == len(records):
        return hit[2]
    if hit is not None and hit[0] == n_steps:
        step_cost, old = hit[1], hit[2]
    else:
        step_cost = _step_costs(ctx, shape, itemsize, hp)
        old = np.zeros(0) if hit is None else hit[2]
    new = records[len(old) :]
    cost = step_cost[new[:, 0]]
    for k in range(1, new.shape[1]):
        cost = cost + step_cost[new[:, k]]
    cost = np.concatenate([old, cost]) if len(old) else cost
    if len(ctx.cost_cache) >= 256:
        ctx.cost_cache.clear()
    ctx.cost_cache[key] = (n_steps, step_cost, cost)
    return cost


def placements_differ(
    srcs: Sequence[Sequence[Placement]], dsts: Sequence[Sequence[Placement]]
) -> np.ndarray:
    """``out[i, j] = tuple(srcs[i]) != tuple(dsts[j])`` as a bool array
    ``[len(srcs), len(dsts)]``, vectorised over interned placement tuples (one dict
    look-up per placement tuple). Equality is the placements' own ``==`` (no
    normalization: ``S(-1)`` and ``S(1)`` differ, as do equal-valued ``_MaskPartial`` s
    with different mask buffers), i.e. the caller's transition-penalty test."""
    return _differ_ids(srcs)[:, None] != _differ_ids(dsts)[None, :]


_DIFFER_IDS: dict[tuple, int] = {}  # placement tuple -> id (by value)
_DIFFER_OBJ: dict[int, tuple[tuple, int]] = {}  # id() of a tuple (kept alive) -> id


def _differ_ids(placements: Sequence[Sequence[Placement]]) -> np.ndarray:
    out = np.empty(len(placements), dtype=np.intp)
    for k, pl in enumerate(placements):
        hit = _DIFFER_OBJ.get(id(pl))
        if hit is not None and hit[0] is pl:
            out[k] = hit[1]
            continue
        key = pl if type(pl) is tuple else tuple(pl)
        i = _DIFFER_IDS.setdefault(key, len(_DIFFER_IDS))
        if type(pl) is tuple:
            _DIFFER_OBJ[id(pl)] = (pl, i)
        out[k] = i
    return out


def clear_caches() -> None:
    """Drop the plan, pair-record and interning caches (e.g. in tests)."""
    _plan_cached.cache_clear()
    _spec.cache_clear()
    _GRAPH_CONTEXTS.clear()
    _graph_state.cache_clear()
    _CONTEXTS.clear()
    _DIFFER_IDS.clear()
    _DIFFER_OBJ.clear()
