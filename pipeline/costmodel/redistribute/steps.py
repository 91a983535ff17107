"""One step of a redistribution: what it is, when it is legal, its bytes and its cost.

Legality, as DTensor enforces it in ``redistribute_local_tensor`` (an illegal pair is
a forbidden pair of the MRF, ``+inf``, never a finite guess):

* ``Replicate -> Partial`` is a local op and free;
* ``Shard -> Partial`` and ``Partial(op1) -> Partial(op2)`` (op1 != op2, including a
  plain ``Partial`` vs a ``_MaskPartial`` / ``_NormPartial``) are illegal: ``+inf``;
* placements mixing Partial reduce ops other than {sum, avg} are illegal: ``+inf``.

A planner (:mod:`.planner`) turns a redistribution into per-mesh-dim transforms
``(mesh dim, src placement, dst placement)``; :func:`classify` maps each to a step,
i.e. a collective on that mesh dim:

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
:func:`pipeline.costmodel.comm.mesh_collectives_us` (alpha-beta, ring factors, link per
mesh dim; :class:`CostParams` holds the hardware numbers a step cost reads). A mesh
dim of size 1 costs nothing (DTensor skips it).

Everything here is stateless: placement categories are looked up by exact type in a
read-only table (isinstance against placement classes goes through torch's opaque-type
metaclass and is slow), with an isinstance fallback for subclasses such as
``_NormPartial``.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from pipeline.costmodel.comm import (
    MeshCollectiveParams,
    mesh_collective_params,
    mesh_collectives_us,
)
from pipeline.costmodel.hardware import COLLECTIVES
from pipeline.dtensor.torch_compat import MaskPartial, StridedShard

__all__ = [
    "KINDS",
    "KIND_CODE",
    "N_COLLECTIVES",
    "CostParams",
    "Step",
    "StepRow",
    "StepRows",
    "Transition",
    "category",
    "check_dims",
    "check_inputs",
    "classify",
    "collective_bytes",
    "divisor_row",
    "is_partial",
    "is_shard_like",
    "mixed_partials",
    "partial_key",
    "reshuffle_us",
    "REDUCE_KINDS",
    "step_costs",
    "step_itemsize",
    "step_row",
    "steps_from_transforms",
]

#: Step kinds. The first four are the collectives, in the order of
#: :data:`~pipeline.costmodel.hardware.COLLECTIVES`; ``local_shard`` /
#: ``local_partial`` are local ops.
KINDS: tuple[str, ...] = (*COLLECTIVES, "local_shard", "local_partial")
KIND_CODE: types.MappingProxyType = types.MappingProxyType({k: i for i, k in enumerate(KINDS)})
N_COLLECTIVES = len(COLLECTIVES)

# --------------------------------------------------------------------------- categories

#: Category codes of :func:`category` (used in the interned-id tables).
C_R, C_S, C_SS, C_P, C_MP = range(5)
CATEGORY_CODE: types.MappingProxyType = types.MappingProxyType(
    {"R": C_R, "S": C_S, "SS": C_SS, "P": C_P, "MP": C_MP}
)
_CATEGORY: types.MappingProxyType = types.MappingProxyType(
    {Replicate: "R", Shard: "S", StridedShard: "SS", Partial: "P", MaskPartial: "MP"}
)


def category(p: Placement) -> str:
    """'R', 'S', 'SS' (``_StridedShard``), 'P' (any Partial but ``_MaskPartial``) or 'MP'.

    Raises:
        ValueError: for a placement type that is none of these.
    """
    c = _CATEGORY.get(type(p))
    if c is not None:
        return c
    if isinstance(p, MaskPartial):
        return "MP"
    if isinstance(p, StridedShard):
        return "SS"
    if isinstance(p, Shard):
        return "S"
    if isinstance(p, Partial):
        return "P"
    if isinstance(p, Replicate):
        return "R"
    raise ValueError(f"unknown placement type {type(p).__name__}: {p!r}")


def is_shard_like(p: Placement) -> bool:
    """``Shard`` or ``_StridedShard``."""
    return category(p) in ("S", "SS")


def is_partial(p: Placement) -> bool:
    """Any ``Partial`` (including ``_MaskPartial`` / ``_NormPartial``)."""
    return category(p) in ("P", "MP")


def partial_key(p: MaskPartial) -> tuple:
    """Value identity of a ``_MaskPartial`` (its own equality uses its buffer's id)."""
    shape = None if p.offset_shape is None else tuple(int(s) for s in p.offset_shape)
    return ("mask", p.reduce_op, shape, int(p.offset_dim))


def mixed_partials(placements: Sequence[Placement]) -> bool:
    """True if ``placements`` mix Partial reduce ops other than {sum, avg} (illegal)."""
    ops = {p.reduce_op for p in placements if is_partial(p)}
    return len(ops) > 1 and ops != {"sum", "avg"}


# --------------------------------------------------------------------------- steps


class Transition(NamedTuple):
    """What one ``src -> dst`` transform on a mesh dim does (see :func:`classify`)."""

    kind: str
    reshuffle: bool
    reshuffle_local: bool
    own_dim: int | None


def classify(src: Placement, dst: Placement) -> Transition | None:
    """The step of one planner transform ``src -> dst`` (module table); None if illegal.

    ``own_dim`` is the tensor dim divided by the step's mesh-dim size for ``L``: the
    source shard dim of a gather / all-to-all, the target shard dim of a
    reduce-scatter, a local slice or a strided copy; None when the step has no
    sharded side (all-reduce, ``R -> P``).
    """
    cs, cd = category(src), category(dst)
    if cd in ("P", "MP"):
        if cs == "R":
            return Transition("local_partial", False, False, None)
        return None  # Shard -> Partial, Partial(op1) -> Partial(op2)
    if cs == "R":
        if cd in ("S", "SS"):
            return Transition("local_shard", not (cd == "S" and dst.dim == 0), True, int(dst.dim))
        return None  # pragma: no cover - R -> R is never a step
    if cs in ("P", "MP"):
        if cd == "R":
            return Transition("all_reduce", False, False, None)
        if cd == "SS":  # DTensor: all-reduce, then a strided local slice
            return Transition("all_reduce", True, True, int(dst.dim))
        return Transition("reduce_scatter", dst.dim != 0, False, int(dst.dim))
    # src is shard-like
    if cd == "R":
        return Transition("all_gather", not (cs == "S" and src.dim == 0), False, int(src.dim))
    if cs == "S" and cd == "S":  # src.dim != dst.dim: one side is non-leading
        return Transition("all_to_all", True, False, int(src.dim))
    # a _StridedShard side: DTensor gathers, then slices
    return Transition("all_gather", True, False, int(src.dim))


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
        return self.kind in COLLECTIVES


def steps_from_transforms(
    src: tuple[Placement, ...], transforms: Sequence[tuple[int, Placement, Placement]]
) -> tuple[Step, ...] | None:
    """:class:`Step` s of a planner's ``(mesh_dim, src, dst)`` transforms starting from
    placements ``src``; None if one is illegal (see :func:`classify`)."""
    current = list(src)
    steps: list[Step] = []
    for m, s_p, d_p in transforms:
        t = classify(s_p, d_p)
        if t is None:
            return None
        divs = tuple((int(p.dim), j) for j, p in enumerate(current) if j != m and is_shard_like(p))
        steps.append(
            Step(m, t.kind, s_p, d_p, tuple(current), divs, t.own_dim, t.reshuffle,
                 t.reshuffle_local)
        )
        current[m] = d_p
    return tuple(steps)


# --------------------------------------------------------------------------- bytes, cost


class StepRow(NamedTuple):
    """A step reduced to what its bytes and cost depend on (hashable; equal steps of
    different plans are one row)."""

    kind: int  #: index into :data:`KINDS`
    mesh_dim: int
    div_g: tuple[int, ...]  #: per tensor dim, divisor of the logical size ``G``
    div_l: tuple[int, ...]  #: per tensor dim, divisor of the local size ``L``
    reshuffle: bool
    reshuffle_local: bool


def step_row(step: Step, mesh_shape: Sequence[int], ndim: int) -> StepRow:
    """The :class:`StepRow` of ``step`` for a ``ndim``-d tensor on ``mesh_shape``."""
    return divisor_row(KIND_CODE[step.kind], step.mesh_dim, step.divs, step.own_dim,
                       step.reshuffle, step.reshuffle_local, mesh_shape, ndim)


def divisor_row(kind: int, mesh_dim: int, divs: Sequence[tuple[int, int]],
                own_dim: int | None, reshuffle: bool, reshuffle_local: bool,
                mesh_shape: Sequence[int], ndim: int) -> StepRow:
    """A :class:`StepRow`: ``G`` divides tensor dim ``td`` by ``mesh_shape[md]`` for each
    ``(td, md)`` of ``divs`` (the other mesh dims sharding the tensor), ``L`` divides
    ``own_dim`` further by ``mesh_shape[mesh_dim]``."""
    g = [1] * ndim
    for td, md in divs:
        g[td] *= mesh_shape[md]
    loc = list(g)
    if own_dim is not None:
        loc[own_dim] *= mesh_shape[mesh_dim]
    return StepRow(kind, mesh_dim, tuple(g), tuple(loc), bool(reshuffle), bool(reshuffle_local))


@dataclass(frozen=True)
class StepRows:
    """:class:`StepRow` s as arrays (one entry per row), the input of :func:`step_costs`."""

    kind: np.ndarray  # int64 [k]
    mesh_dim: np.ndarray  # int64 [k]
    div_g: np.ndarray  # int64 [k, ndim]
    div_l: np.ndarray  # int64 [k, ndim]
    reshuffle: np.ndarray  # bool [k]
    reshuffle_local: np.ndarray  # bool [k]

    @classmethod
    def of(cls, rows: Sequence[StepRow], ndim: int) -> StepRows:
        """The arrays of ``rows`` (steps of a ``ndim``-d tensor)."""
        n = len(rows)
        return cls(
            np.fromiter((r.kind for r in rows), np.int64, n),
            np.fromiter((r.mesh_dim for r in rows), np.int64, n),
            np.asarray([r.div_g for r in rows], dtype=np.int64).reshape(n, ndim),
            np.asarray([r.div_l for r in rows], dtype=np.int64).reshape(n, ndim),
            np.fromiter((r.reshuffle for r in rows), bool, n),
            np.fromiter((r.reshuffle_local for r in rows), bool, n),
        )


def collective_bytes(kind: np.ndarray, n: np.ndarray, g_bytes: np.ndarray,
                     l_bytes: np.ndarray) -> np.ndarray:
    """The collective buffer ``S`` of the module table per step: ``n * L`` for
    all-gather / reduce-scatter, ``L`` for all-to-all, ``G`` for all-reduce, 0 for a
    local step (``kind`` indexes :data:`KINDS`; int arrays in, int64 array out)."""
    kind = np.asarray(kind)
    n_l = (kind == KIND_CODE["all_gather"]) | (kind == KIND_CODE["reduce_scatter"])
    return np.where(n_l, n * l_bytes,
                    np.where(kind == KIND_CODE["all_to_all"], l_bytes,
                             np.where(kind == KIND_CODE["all_reduce"], g_bytes, 0)))


def reshuffle_us(nbytes: Any, hbm: float) -> Any:
    """Local HBM reshuffle of ``nbytes`` (read and write) at effective bandwidth ``hbm``
    (``hbm_bandwidth * memory_efficiency``, bytes/s): ``2 * S / hbm``, in µs (number or
    array)."""
    return (2.0 * nbytes) / hbm * 1e6


@dataclass(frozen=True)
class CostParams:
    """What step costs depend on besides the steps and the tensor: the collectives'
    alpha-beta parameters per mesh dim and the effective HBM bandwidth (bytes/s)."""

    collectives: MeshCollectiveParams
    hbm: float

    @classmethod
    def of(cls, mesh_shape: Sequence[int], hw: Any,
           rows: Sequence[StepRow] | None = None, latency_scale: float = 1.0) -> CostParams:
        """Parameters of ``mesh_shape`` on hardware ``hw`` (HardwareConfig or DictConfig):
        all of them, or only those the steps ``rows`` use (see
        :func:`~pipeline.costmodel.comm.mesh_collective_params`).

        ``latency_scale`` multiplies every collective's latency: the share of one bucket's
        latency a member collective pays (:mod:`pipeline.costmodel.fsdp`); 1.0 leaves
        the parameters unchanged, bit for bit."""
        used = None if rows is None else [
            (r.mesh_dim, r.kind) for r in rows if r.kind < N_COLLECTIVES]
        coll = mesh_collective_params(mesh_shape, hw, used)
        if latency_scale != 1.0:
            coll = coll.scaled(latency_scale)
        return cls(coll, float(hw.hbm_bandwidth) * float(hw.memory_efficiency))

    def key(self) -> tuple:
        """A hashable value identity (for caches keyed by the parameters)."""
        return (*self.collectives.key(), self.hbm)


#: Step kinds that reduce (a Partial source): the collectives a gradient's reduce dtype
#: applies to.
REDUCE_KINDS: tuple[int, ...] = (KIND_CODE["reduce_scatter"], KIND_CODE["all_reduce"])


def step_itemsize(kind: np.ndarray, itemsize: int, reduce_itemsize: int = 0) -> Any:
    """Bytes per element of each step: ``max(itemsize, reduce_itemsize)`` for a
    reduce-scatter or all-reduce when ``reduce_itemsize`` is set (a gradient upcast to its
    reduce dtype before the reduction, as FSDP2's ``MixedPrecisionPolicy.reduce_dtype``
    does), else ``itemsize`` (an int when nothing changes, else an int64 array)."""
    if reduce_itemsize <= itemsize:
        return int(itemsize)
    return np.where(np.isin(kind, REDUCE_KINDS), int(reduce_itemsize), int(itemsize))


def step_costs(rows: StepRows, shape: Sequence[int], itemsize: int,
               params: CostParams, reduce_itemsize: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(µs, S bytes)`` of each step of ``rows`` for a tensor of ``shape``: collective
    (:func:`~pipeline.costmodel.comm.mesh_collectives_us` on :func:`collective_bytes`)
    plus local reshuffle (:func:`reshuffle_us`). Rows must be on mesh dims of size > 1
    (a size-1 mesh dim is no step: callers drop it). ``reduce_itemsize``: the bytes per
    element reductions run in (:func:`step_itemsize`; 0: the tensor's own)."""
    shape_arr = np.asarray(shape, dtype=np.int64)
    size = step_itemsize(rows.kind, int(itemsize), int(reduce_itemsize))
    g_bytes = np.prod(-(-shape_arr // rows.div_g), axis=1) * size
    l_bytes = np.prod(-(-shape_arr // rows.div_l), axis=1) * size
    n = params.collectives.group[rows.mesh_dim]
    s_bytes = collective_bytes(rows.kind, n, g_bytes, l_bytes)
    is_coll = rows.kind < N_COLLECTIVES
    coll = mesh_collectives_us(np.where(is_coll, rows.kind, 0), s_bytes, rows.mesh_dim,
                               params.collectives, counted=is_coll)
    comm = np.where(is_coll, coll, 0.0)
    rb = np.where(rows.reshuffle_local, l_bytes, s_bytes)
    resh = np.where(rows.reshuffle, reshuffle_us(rb, params.hbm), 0.0)
    return comm + resh, s_bytes


# --------------------------------------------------------------------------- validation


def check_inputs(shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int]) -> None:
    """Raise ValueError unless ``shape`` is non-negative ints, ``itemsize`` a positive
    int and every mesh dim >= 1."""
    if any((not isinstance(s, (int, np.integer))) or s < 0 for s in shape):
        raise ValueError(f"shape must be non-negative ints, got {tuple(shape)}")
    if not (isinstance(itemsize, (int, np.integer)) and itemsize > 0):
        raise ValueError(f"itemsize must be a positive int (bytes per element), got {itemsize!r}")
    if len(mesh_shape) == 0 or any(int(s) < 1 for s in mesh_shape):
        raise ValueError(f"mesh_shape must be >= 1 per dim, got {tuple(mesh_shape)}")


def check_dims(placements: Sequence[Placement], ndim: int, mesh_ndim: int, what: str) -> None:
    """Raise ValueError unless ``placements`` has one entry per mesh dim and every shard
    dim is in range for a ``ndim``-d tensor (``what`` names the side: src / dst)."""
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{what} placements {tuple(placements)} have {len(placements)} entries "
            f"for a {mesh_ndim}-d mesh"
        )
    for p in placements:
        if is_shard_like(p) and not -ndim <= p.dim < ndim:
            raise ValueError(f"{what} placement {p} out of range for a {ndim}-d tensor")
