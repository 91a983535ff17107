"""Cost of redistributing a tensor between two DTensor placements on a mesh, in µs.

Legality (DESIGN.md, "legal and illegal redistributions", as DTensor enforces it in
``redistribute_local_tensor``):

* ``Replicate -> Partial`` is a local op and free;
* ``Shard -> Partial`` and ``Partial(op1) -> Partial(op2)`` (op1 != op2, including a
  plain ``Partial`` vs a ``_MaskPartial`` / ``_NormPartial``) are illegal: ``+inf``;
* placements mixing Partial reduce ops other than {sum, avg} are illegal: ``+inf``.

A legal redistribution is decomposed into the per-mesh-dim steps DTensor itself runs,
from ``torch.distributed.tensor._redistribute._gen_transform_infos_non_cached`` (greedy
planner; the Dijkstra planner when a ``_StridedShard`` is involved), planned once per
``(src, dst)`` on a canonical, evenly divisible tensor and cached (:func:`plan`). The
specs are built on a ``DeviceMesh(..., _init_backend=False, _rank=0)``, so no process
group is needed (a test checks the plans equal those on a fake-process-group mesh).
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
    "plan",
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


def _plan_uncached(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...] | None,
) -> tuple[Step, ...] | None:
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    if _mixed_partials(src) or _mixed_partials(dst):
        return None
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
        shape = (size,) * ndim
    elif dims and max(dims) >= len(shape):
        raise ValueError(f"placements {src} -> {dst} out of range for shape {shape}")
    try:
        src_spec = _spec(src, mesh_shape, shape)
        dst_spec = _spec(dst, mesh_shape, shape)
        infos = _gen_transform_infos_non_cached(src_spec, dst_spec)
    except (AssertionError, ValueError, RuntimeError, NotImplementedError):
        return None  # DTensor cannot plan it, so it cannot run it

    current = list(src)
    steps: list[Step] = []
    for info in infos:
        m = info.mesh_dim
        s_p, d_p = info.src_dst_placements
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
    return _plan_uncached(src, dst, mesh_shape, shape)


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
    comm_bytes = 0
    if step.kind in _COLLECTIVE_KINDS:
        ki = _KIND_CODE[step.kind]
        li = 0 if links[step.mesh_dim] == "intra" else 1
        if step.kind in ("all_gather", "reduce_scatter"):
            comm_bytes = n * l_bytes
        elif step.kind == "all_to_all":
            comm_bytes = l_bytes
        else:
            comm_bytes = g_bytes
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
    _check_inputs(shape, itemsize, mesh_shape)
    _check_dims(src, len(shape), len(mesh_shape), "src")
    _check_dims(dst, len(shape), len(mesh_shape), "dst")
    src_n = normalize_placements(src, len(shape))
    dst_n = normalize_placements(dst, len(shape))
    steps = _plan_normalized(src_n, dst_n, mesh_shape, shape)
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


# --------------------------------------------------------------------------- table


@dataclass(frozen=True)
class _CompiledTable:
    """Shape-independent step arrays of all (src, dst) pairs of a table."""

    n_src: int
    n_dst: int
    inf_mask: np.ndarray  # [n_src * n_dst] bool
    pair: np.ndarray  # [K] flat pair index, steps in plan order
    kind: np.ndarray  # [K] kind code (index into KINDS)
    mesh_dim: np.ndarray  # [K]
    div_g: np.ndarray  # [K, ndim] divisor per tensor dim for G
    div_l: np.ndarray  # [K, ndim] divisor per tensor dim for L
    reshuffle: np.ndarray  # [K] bool
    reshuffle_local: np.ndarray  # [K] bool


def _compile_table(
    srcs: tuple[tuple[Placement, ...], ...],
    dsts: tuple[tuple[Placement, ...], ...],
    mesh_shape: tuple[int, ...],
    ndim: int,
    shape: tuple[int, ...] | None,
) -> _CompiledTable:
    n_src, n_dst = len(srcs), len(dsts)
    inf_mask = np.zeros(n_src * n_dst, dtype=bool)
    pair, kind, mdim, div_g, div_l, resh, resh_l = [], [], [], [], [], [], []
    for i, s in enumerate(srcs):
        for j, d in enumerate(dsts):
            steps = _plan_normalized(s, d, mesh_shape, shape)
            if steps is None:
                inf_mask[i * n_dst + j] = True
                continue
            for st in steps:
                if mesh_shape[st.mesh_dim] <= 1:
                    continue
                g = [1] * ndim
                for td, md in st.divs:
                    g[td] *= mesh_shape[md]
                loc = list(g)
                if st.own_dim is not None:
                    loc[st.own_dim] *= mesh_shape[st.mesh_dim]
                pair.append(i * n_dst + j)
                kind.append(_KIND_CODE[st.kind])
                mdim.append(st.mesh_dim)
                div_g.append(g)
                div_l.append(loc)
                resh.append(st.reshuffle)
                resh_l.append(st.reshuffle_local)
    return _CompiledTable(
        n_src,
        n_dst,
        inf_mask,
        np.asarray(pair, dtype=np.int64),
        np.asarray(kind, dtype=np.int64),
        np.asarray(mdim, dtype=np.int64),
        np.asarray(div_g, dtype=np.int64).reshape(len(pair), ndim),
        np.asarray(div_l, dtype=np.int64).reshape(len(pair), ndim),
        np.asarray(resh, dtype=bool),
        np.asarray(resh_l, dtype=bool),
    )


@functools.lru_cache(maxsize=4096)
def _compiled_table_cached(
    srcs: tuple[tuple[Placement, ...], ...],
    dsts: tuple[tuple[Placement, ...], ...],
    mesh_shape: tuple[int, ...],
    ndim: int,
    shape: tuple[int, ...] | None,
) -> _CompiledTable:
    return _compile_table(srcs, dsts, mesh_shape, ndim, shape)


def redistribute_table(
    shape: Sequence[int],
    itemsize: int,
    srcs: Sequence[Sequence[Placement]],
    dsts: Sequence[Sequence[Placement]],
    mesh_shape: Sequence[int],
    hw: Any,
) -> np.ndarray:
    """All-pairs :func:`redistribute_us`: ``out[i, j]`` = cost of ``srcs[i] -> dsts[j]``.

    Vectorised: the pairs' cached plans are compiled once per ``(srcs, dsts, mesh,
    ndim)`` into step arrays (cached), then the bytes and alpha-beta costs of all steps
    are computed with numpy and summed per pair in plan order, so every entry is
    bit-identical to :func:`redistribute_us`.

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
    ndim = len(shape)
    for s in srcs:
        _check_dims(s, ndim, len(mesh_shape), "src")
    for d in dsts:
        _check_dims(d, ndim, len(mesh_shape), "dst")
    srcs_n = tuple(normalize_placements(s, ndim) for s in srcs)
    dsts_n = tuple(normalize_placements(d, ndim) for d in dsts)
    # Plans involving a _StridedShard depend on the tensor shape (Dijkstra planner).
    strided = any(_cat(p) == "SS" for pl in (*srcs_n, *dsts_n) for p in pl)
    ct = _compiled_table_cached(srcs_n, dsts_n, mesh_shape, ndim, shape if strided else None)

    out = np.zeros(ct.n_src * ct.n_dst, dtype=np.float64)
    if len(ct.pair):
        hp = _hw_params(hw)
        links = mesh_links(mesh_shape, hp.gpus_per_node)
        mesh_arr = np.asarray(mesh_shape, dtype=np.int64)
        link_idx = np.asarray([0 if lk == "intra" else 1 for lk in links], dtype=np.int64)
        shape_arr = np.asarray(shape, dtype=np.int64)
        g = np.prod(-(-shape_arr // ct.div_g), axis=1) if ndim else np.ones(len(ct.pair), int)
        loc = np.prod(-(-shape_arr // ct.div_l), axis=1) if ndim else g
        g_bytes = g * int(itemsize)
        l_bytes = loc * int(itemsize)
        n = mesh_arr[ct.mesh_dim]
        is_coll = ct.kind < 4
        kc = np.where(is_coll, ct.kind, 0)
        li = link_idx[ct.mesh_dim]
        comm_bytes = np.where(
            (ct.kind == _KIND_CODE["all_gather"]) | (ct.kind == _KIND_CODE["reduce_scatter"]),
            n * l_bytes,
            np.where(ct.kind == _KIND_CODE["all_to_all"], l_bytes, g_bytes),
        )
        comm_bytes = np.where(is_coll, comm_bytes, 0)
        factor = np.asarray([COLLECTIVE_FACTOR[k] for k in _COLLECTIVE_KINDS])[kc]
        lat = hp.lat[li, kc]
        bw = hp.bw[li, kc]
        comm = lat + (factor * (n - 1) / n) * (comm_bytes / bw) * 1e6
        comm = np.where(is_coll, comm, 0.0)
        rb = np.where(ct.reshuffle_local, l_bytes, comm_bytes)
        resh = np.where(ct.reshuffle, (2.0 * rb) / hp.hbm * 1e6, 0.0)
        np.add.at(out, ct.pair, comm + resh)
    out[ct.inf_mask] = np.inf
    return out.reshape(ct.n_src, ct.n_dst)


def clear_caches() -> None:
    """Drop the plan and compiled-table caches (e.g. in tests)."""
    _plan_cached.cache_clear()
    _spec.cache_clear()
    _compiled_table_cached.cache_clear()
