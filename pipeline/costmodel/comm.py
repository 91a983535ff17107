"""Alpha-beta cost of NCCL collectives over the groups of a device mesh, in µs.

This module is the one home of the collective time formula and of the link model: the
scalar helpers (:func:`collective_us`, :func:`all_gather_us`, ...,
:func:`mesh_collective_us`) and the vectorised one the redistribution steps are costed
with (:func:`mesh_collectives_us`, on the per-mesh-dim parameters of
:func:`mesh_collective_params`) all evaluate :func:`alpha_beta_us` on the parameters of
:func:`group_collective_params`, so the two paths give bit-identical values.

Formula (Hockney alpha-beta with ring-algorithm volume factors, Thakur, Rabenseifner
& Gropp 2005, "Optimization of Collective Communication Operations in MPICH"; bus
bandwidth as defined by nccl-tests, ``doc/PERFORMANCE.md``), for a group of ``n`` ranks
and per-device buffer sizes in bytes:

====================  ======================================  ========================
collective            time (µs)                               ``S`` is
====================  ======================================  ========================
all_gather            ``lat + (n-1)/n * S / busbw * 1e6``     output (gathered) bytes
reduce_scatter        ``lat + (n-1)/n * S / busbw * 1e6``     input (unscattered) bytes
all_reduce            ``2 lat + 2(n-1)/n * S / busbw * 1e6``  buffer bytes
all_to_all            ``lat + (n-1)/n * S / busbw * 1e6``     local bytes per device
====================  ======================================  ========================

All-reduce is a ring reduce-scatter followed by a ring all-gather of the same buffer
(Patarasuk & Yuan 2009; NCCL's ring all-reduce): the same bus bandwidth, twice the
volume factor and both latencies, so ``all_reduce == reduce_scatter + all_gather``
exactly (the factor 2 is a power of two: no rounding differs). A group of one rank
costs 0 (no collective is issued).

Layout. Global ranks are the row-major order of the mesh (the last mesh dim has
stride 1, as ``init_device_mesh`` lays out ``arange(world).view(mesh_shape)``), packed
``gpus_per_node`` per node. The group of a mesh dim (or of several mesh dims taken
together, a flattened sub-mesh) is laid out as ``k`` nodes spanned x ``m`` members per
node (:func:`mesh_group_layout`; a non-uniform layout is priced by its most
constrained group: fewest members on a node, most nodes). With ``G = gpus_per_node``,
``N = nics_per_node``, NIC bandwidth ``b`` (``inter_node.bandwidth``), NVLink bus
bandwidth ``B`` (``intra_node.bandwidth``):

* ``k == 1`` (inside a node): ``busbw = B``, ``lat = intra_node.latency_us``.
* ``k > 1``: each rank's share of the scale-out bandwidth (rails, one direction) is
  ``r = min(min(m, N) * b / m, N * b / G)``: the group's ``m`` members of a node drive
  at most ``min(m, N)`` NICs (one NIC per member at most), and every GPU of the node
  runs the same collective on its own group at the same time (SPMD), so no rank gets
  more than its ``1/G`` of the node's ``N`` NICs. In a ring over ``n = k m`` ranks NCCL
  runs one ring per channel, each leaving the node through a different NIC, and every
  edge of a ring carries ``(n-1)/n S`` (nccl-tests PERFORMANCE.md: the bus bandwidth is
  the bandwidth of the slowest edge): the node's outgoing edges share ``m r``, the
  NVLink edges run at ``B``, so ``busbw = min(B, m r)`` (``= r`` for ``m == 1``, a ring
  with no NVLink hop), ``lat = inter_node.latency_us``. On a DGX H100 (``N = G = 8``,
  ``b = 50 GB/s``) a group with 1, 2, 8 members per node gets ``busbw`` 50, 100,
  min(390, 400) GB/s: a flat 64-rank ring uses all 8 rails of a node, a dp group of an
  8x8 mesh one ("How to Scale Your Model", Austin et al. 2025, GPU chapter: cross-node
  collectives are bound by the node's egress, ``N b``).
* all_to_all, ``k > 1``: each rank sends ``(m-1)/n S`` over NVLink and ``(n-m)/n S``
  over its rail share, concurrently: ``busbw = (n-1) / max((m-1)/B, (n-m)/r)``.
* all_reduce with ``hierarchical_all_reduce`` and ``m > 1``, ``k > 1``: intra
  reduce-scatter (``(m-1)/m S / B``), ring all-reduce of the ``S/m`` shard across the
  ``k`` nodes on each rail (``2(k-1)/k S/m / r``), intra all-gather, in sequence; the
  sum is written in the table's form with ``busbw = 2(n-1)/n / (2(m-1)/(m B) +
  2(k-1)/(k m r))`` and ``lat = 2 intra + 2 inter latency``, so one formula prices it.

``lat`` is the fixed cost of one ring pass on the tier the group uses. All functions
accept a Python number or a numpy array of byte counts (and of group sizes) and return
the same shape; scalar and array inputs give bit-identical values.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pipeline.costmodel.hardware import COLLECTIVES

__all__ = [
    "COLLECTIVE_FACTOR",
    "GroupLayout",
    "MeshCollectiveParams",
    "all_gather_us",
    "all_reduce_us",
    "all_to_all_us",
    "alpha_beta_us",
    "collective_us",
    "flat_group_params",
    "group_collective_params",
    "group_collective_us",
    "mesh_collective_params",
    "mesh_collective_us",
    "mesh_collectives_us",
    "mesh_dim_layout",
    "mesh_dim_link",
    "mesh_group_layout",
    "mesh_link",
    "mesh_links",
    "rail_bandwidth_per_rank",
    "reduce_scatter_us",
]

#: Volume factor numerator multiplier per collective: time uses ``f * (n-1)/n``.
COLLECTIVE_FACTOR: Mapping[str, float] = types.MappingProxyType({
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "all_reduce": 2.0,
    "all_to_all": 1.0,
})

#: Ring passes per collective: all-reduce = reduce-scatter + all-gather pays two latencies.
_PASSES: Mapping[str, float] = types.MappingProxyType({
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "all_reduce": 2.0,
    "all_to_all": 1.0,
})

Link = Literal["intra", "inter"]


# --------------------------------------------------------------------------- formula


def alpha_beta_us(factor: Any, lat: Any, bw: Any, nbytes: Any, n: Any) -> Any:
    """The collective time ``lat + factor * (n-1)/n * nbytes / bw * 1e6`` (µs).

    Args:
        factor: volume factor (:data:`COLLECTIVE_FACTOR`), number or array.
        lat: fixed latency in µs (all ring passes of the collective), number or array.
        bw: bus bandwidth in bytes/s, number or array.
        nbytes: the collective's ``S`` in bytes (module table), number or array.
        n: group size(s), number or array.

    Returns:
        A float if every argument is a scalar, else a float64 array of the broadcast
        shape; 0 where ``n <= 1``. The operations are the same in both branches (ints
        are converted to float64 exactly below 2**53), so a scalar call and the
        matching element of an array call are bit-identical.
    """
    if np.ndim(nbytes) == 0 and np.ndim(n) == 0 and np.ndim(lat) == 0 and np.ndim(bw) == 0:
        if n <= 1:
            return 0.0
        return lat + (factor * (n - 1) / n) * (nbytes / bw) * 1e6
    nbytes = np.asarray(nbytes, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    t = lat + (factor * (n - 1) / n) * (nbytes / bw) * 1e6
    return np.where(n > 1, t, 0.0)


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVE_FACTOR:
        raise ValueError(f"unknown collective {kind!r}; allowed: {', '.join(COLLECTIVES)}")


def collective_us(kind: str, nbytes: Any, n: Any, link: Any) -> Any:
    """Time in µs of ring collective ``kind`` on ``n`` ranks over one link tier.

    The ring runs at ``link.bandwidth`` (bus bandwidth) with ``link.latency_us`` per
    ring pass (two for all-reduce). For a mesh's groups, whose bandwidth depends on
    their layout over nodes, use :func:`mesh_collective_us`.

    Args:
        kind: one of ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``.
        nbytes: buffer size(s) in bytes as defined in the module table (number or array).
        n: group size(s), >= 1 (number or array broadcastable with ``nbytes``).
        link: a :class:`~pipeline.costmodel.hardware.LinkConfig` (or DictConfig).

    Returns:
        µs, a float for scalar inputs, else an array; 0 where ``n == 1``.

    Raises:
        ValueError: for an unknown ``kind``.
    """
    _check_kind(kind)
    lat = _PASSES[kind] * float(link.latency_us)
    return alpha_beta_us(COLLECTIVE_FACTOR[kind], lat, float(link.bandwidth), nbytes, n)


def all_gather_us(nbytes: Any, n: Any, link: Any) -> Any:
    """All-gather of ``nbytes`` *output* bytes per device: ``lat + (n-1)/n * S / bw`` (µs)."""
    return collective_us("all_gather", nbytes, n, link)


def reduce_scatter_us(nbytes: Any, n: Any, link: Any) -> Any:
    """Reduce-scatter of ``nbytes`` *input* bytes per device: ``lat + (n-1)/n * S / bw`` (µs)."""
    return collective_us("reduce_scatter", nbytes, n, link)


def all_reduce_us(nbytes: Any, n: Any, link: Any) -> Any:
    """All-reduce of an ``nbytes`` buffer: ``2 lat + 2(n-1)/n * S / bw`` (µs)."""
    return collective_us("all_reduce", nbytes, n, link)


def all_to_all_us(nbytes: Any, n: Any, link: Any) -> Any:
    """All-to-all of ``nbytes`` *local* bytes per device: ``lat + (n-1)/n * S / bw`` (µs)."""
    return collective_us("all_to_all", nbytes, n, link)


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class GroupLayout:
    """How the ranks of one communication group sit on the nodes.

    Attributes:
        size: ranks in the group (``n``).
        per_node: members of the group on one node (``m``; for a non-uniform layout
            the fewest on any node the group touches, the ring's narrowest node).
        nodes: nodes the group spans (``k``; for a non-uniform layout the most).
    """

    size: int
    per_node: int
    nodes: int

    @property
    def spans_nodes(self) -> bool:
        """Whether the group leaves its node (uses the scale-out network)."""
        return self.nodes > 1


def _mesh_dims(mesh_shape: Sequence[int], mesh_dims: int | Sequence[int]) -> tuple[int, ...]:
    ndim = len(mesh_shape)
    dims = (mesh_dims,) if isinstance(mesh_dims, (int, np.integer)) else tuple(mesh_dims)
    out = []
    for d in dims:
        if not -ndim <= d < ndim:
            raise ValueError(f"mesh_dim={d} out of range for mesh {tuple(mesh_shape)}")
        out.append(int(d) % ndim)
    if not out or len(set(out)) != len(out):
        raise ValueError(f"mesh dims {dims} must be distinct and at least one")
    return tuple(sorted(out))


@functools.lru_cache(maxsize=1024)
def _layout(mesh_shape: tuple[int, ...], dims: tuple[int, ...], gpus_per_node: int) -> GroupLayout:
    n = math.prod(mesh_shape[d] for d in dims)
    world = math.prod(mesh_shape)
    if world <= gpus_per_node or n == 1:
        return GroupLayout(n, n, 1)
    ranks = np.arange(world, dtype=np.int64).reshape(mesh_shape)
    rest = [d for d in range(len(mesh_shape)) if d not in dims]
    groups = ranks.transpose(*rest, *dims).reshape(-1, n)  # one row per group
    nodes = np.sort(groups // gpus_per_node, axis=1)
    starts = np.ones(nodes.shape, dtype=bool)
    starts[:, 1:] = nodes[:, 1:] != nodes[:, :-1]
    spanned = int(starts.sum(axis=1).max())
    first = np.flatnonzero(starts.ravel())
    runs = np.diff(np.append(first, nodes.size))  # members per (group, node)
    return GroupLayout(n, int(runs.min()), spanned)


def mesh_group_layout(mesh_shape: Sequence[int], mesh_dims: int | Sequence[int],
                      gpus_per_node: int) -> GroupLayout:
    """The :class:`GroupLayout` of the groups over ``mesh_dims`` (one dim or several
    taken together) of ``mesh_shape``, ranks row-major and packed ``gpus_per_node`` per
    node.

    Examples, 8 GPUs/node: ``(64,)`` dim 0 -> 8 per node x 8 nodes; ``(8, 8)`` dim 0 ->
    1 x 8, dim 1 -> 8 x 1, dims (0, 1) -> 8 x 8; ``(16, 4)`` dim 0 -> 2 x 8;
    ``(2, 4, 8)`` dim 1 -> 1 x 4.

    Raises:
        ValueError: if a mesh dim is out of range or repeated.
    """
    dims = _mesh_dims(mesh_shape, mesh_dims)
    return _layout(tuple(int(d) for d in mesh_shape), dims, int(gpus_per_node))


def mesh_dim_layout(mesh_shape: Sequence[int], mesh_dim: int, gpus_per_node: int) -> GroupLayout:
    """:func:`mesh_group_layout` of one mesh dim."""
    return mesh_group_layout(mesh_shape, mesh_dim, gpus_per_node)


def mesh_dim_link(mesh_shape: Sequence[int], mesh_dim: int, gpus_per_node: int) -> Link:
    """Which link tier a collective over ``mesh_dim`` uses: ``"intra"`` if its groups stay
    inside one node, else ``"inter"`` (:func:`mesh_dim_layout`).

    Example, 8 GPUs/node: ``(8,)`` -> dim 0 intra; ``(8, 8)`` -> dim 0 inter, dim 1
    intra; ``(2, 4, 8)`` -> dims 0, 1 inter, dim 2 intra.

    Raises:
        ValueError: if ``mesh_dim`` is out of range.
    """
    return "inter" if mesh_dim_layout(mesh_shape, mesh_dim, gpus_per_node).spans_nodes else "intra"


def mesh_links(mesh_shape: Sequence[int], gpus_per_node: int) -> tuple[Link, ...]:
    """:func:`mesh_dim_link` for every mesh dim."""
    return tuple(mesh_dim_link(mesh_shape, m, gpus_per_node) for m in range(len(mesh_shape)))


def mesh_link(mesh_shape: Sequence[int], mesh_dim: int, hw: Any) -> Any:
    """The :class:`~pipeline.costmodel.hardware.LinkConfig` tier of ``hw`` that a
    collective over ``mesh_dim`` uses (its bus bandwidth also depends on the layout:
    :func:`group_collective_params`)."""
    if mesh_dim_link(mesh_shape, mesh_dim, hw.gpus_per_node) == "intra":
        return hw.intra_node
    return hw.inter_node


# --------------------------------------------------------------------------- link model


class _Links:
    """The link numbers of a hardware config, each read from ``hw`` on first use
    (reading a DictConfig is slow, and a mesh inside one node needs no NIC numbers)."""

    def __init__(self, hw: Any, gpus_per_node: int | None = None) -> None:
        self._hw = hw
        if gpus_per_node is not None:
            self.gpus_per_node = gpus_per_node

    @classmethod
    def of(cls, hw: Any, gpus_per_node: int | None = None) -> _Links:
        return hw if isinstance(hw, _Links) else cls(hw, gpus_per_node)

    @functools.cached_property
    def gpus_per_node(self) -> int:
        return int(self._hw.gpus_per_node)

    @functools.cached_property
    def nics_per_node(self) -> int:
        return int(self._hw.nics_per_node)

    @functools.cached_property
    def nvlink_bw(self) -> float:
        return float(self._hw.intra_node.bandwidth)

    @functools.cached_property
    def nvlink_lat(self) -> float:
        return float(self._hw.intra_node.latency_us)

    @functools.cached_property
    def nic_bw(self) -> float:
        return float(self._hw.inter_node.bandwidth)

    @functools.cached_property
    def inter_lat(self) -> float:
        return float(self._hw.inter_node.latency_us)

    @functools.cached_property
    def hierarchical(self) -> bool:
        return bool(self._hw.hierarchical_all_reduce)


def rail_bandwidth_per_rank(layout: GroupLayout, hw: Any) -> float:
    """Each rank's share of the scale-out bandwidth, bytes/s one direction:
    ``min(min(m, N) * b / m, N * b / G)`` (module docstring)."""
    h = _Links.of(hw)
    m = layout.per_node
    return min(min(m, h.nics_per_node) * h.nic_bw / m,
               h.nics_per_node * h.nic_bw / h.gpus_per_node)


def group_collective_params(kind: str, layout: GroupLayout, hw: Any) -> tuple[float, float]:
    """``(lat µs, bus bandwidth bytes/s)`` of collective ``kind`` over a group laid out as
    ``layout`` on hardware ``hw`` (the cases of the module docstring).

    Raises:
        ValueError: for an unknown ``kind``.
    """
    _check_kind(kind)
    h = _Links.of(hw)
    passes = _PASSES[kind]
    if not layout.spans_nodes:
        return passes * h.nvlink_lat, h.nvlink_bw
    n, m, k = layout.size, layout.per_node, layout.nodes
    r = rail_bandwidth_per_rank(layout, h)
    if kind == "all_to_all":
        return h.inter_lat, (n - 1) / max((m - 1) / h.nvlink_bw, (n - m) / r)
    if kind == "all_reduce" and h.hierarchical and m > 1:
        per_byte = 2 * (m - 1) / (m * h.nvlink_bw) + 2 * (k - 1) / (k * m * r)
        return 2 * h.nvlink_lat + 2 * h.inter_lat, (2 * (n - 1) / n) / per_byte
    ring = r if m == 1 else min(h.nvlink_bw, m * r)
    return passes * h.inter_lat, ring


def group_collective_us(kind: str, nbytes: Any, layout: GroupLayout, hw: Any) -> Any:
    """Collective ``kind`` of ``nbytes`` (module table) over a group laid out as
    ``layout`` on ``hw``, in µs (:func:`alpha_beta_us` on :func:`group_collective_params`)."""
    lat, bw = group_collective_params(kind, layout, hw)
    return alpha_beta_us(COLLECTIVE_FACTOR[kind], lat, bw, nbytes, layout.size)


def mesh_collective_us(
    kind: str, nbytes: Any, mesh_shape: Sequence[int], mesh_dim: int | Sequence[int], hw: Any
) -> Any:
    """Collective ``kind`` over mesh dim ``mesh_dim`` of ``mesh_shape`` on hardware ``hw``.

    ``mesh_dim`` may be a sequence of mesh dims: one collective over the flattened group
    they span (e.g. dims ``(0, 1)`` of ``(8, 8)`` is the same 64-rank group as dim 0 of
    ``(64,)``, and costs the same). Layout from :func:`mesh_group_layout`, parameters
    from :func:`group_collective_params`.
    """
    layout = mesh_group_layout(mesh_shape, mesh_dim, hw.gpus_per_node)
    return group_collective_us(kind, nbytes, layout, hw)


@dataclass(frozen=True)
class MeshCollectiveParams:
    """The alpha-beta parameters of every collective on every mesh dim of one mesh.

    Attributes:
        group: int64 ``[ndim]``, the group size ``n`` of each mesh dim.
        lat: float64 ``[ndim, len(COLLECTIVES)]``, latency in µs of each collective
            (:data:`~pipeline.costmodel.hardware.COLLECTIVES` order) over the groups of
            each mesh dim (:func:`group_collective_params`).
        bw: float64 ``[ndim, len(COLLECTIVES)]``, bus bandwidth in bytes/s, likewise.
    """

    group: np.ndarray
    lat: np.ndarray
    bw: np.ndarray

    def key(self) -> tuple[bytes, bytes, bytes]:
        """A hashable value identity (for caches keyed by the parameters)."""
        return self.group.tobytes(), self.lat.tobytes(), self.bw.tobytes()


def mesh_collective_params(
    mesh_shape: Sequence[int], hw: Any, used: Iterable[tuple[int, int]] | None = None
) -> MeshCollectiveParams:
    """:class:`MeshCollectiveParams` of ``mesh_shape`` on hardware ``hw``.

    With ``used``, an iterable of ``(mesh dim, collective index)`` pairs, only those
    entries are computed and the others are NaN: for a caller that costs those
    collectives only.
    """
    ndim, n_kinds = len(mesh_shape), len(COLLECTIVES)
    lat = np.full((ndim, n_kinds), np.nan)
    bw = np.full_like(lat, np.nan)
    if used is None:
        used = [(m, k) for m in range(ndim) for k in range(n_kinds)]
    used = sorted(set(used))
    if used:
        links = _Links.of(hw)
        for m, k in used:
            layout = mesh_dim_layout(mesh_shape, m, links.gpus_per_node)
            lat[m, k], bw[m, k] = group_collective_params(COLLECTIVES[k], layout, links)
    return MeshCollectiveParams(np.asarray(mesh_shape, dtype=np.int64), lat, bw)


def flat_group_params(mesh_shape: Sequence[int], hw: Any,
                      groups: Sequence[Sequence[int]]) -> MeshCollectiveParams:
    """:class:`MeshCollectiveParams` whose rows are ``groups`` (each a set of mesh dims
    taken together, a flattened sub-mesh) instead of the mesh dims: row ``i`` holds the
    size of group ``i`` and the parameters of every collective over it
    (:func:`mesh_group_layout`, :func:`group_collective_params`)."""
    links = _Links.of(hw)
    rows = max(1, len(groups))
    lat = np.zeros((rows, len(COLLECTIVES)))
    bw = np.ones_like(lat)
    size = np.ones(rows, dtype=np.int64)
    for i, dims in enumerate(groups):
        layout = mesh_group_layout(mesh_shape, tuple(dims), links.gpus_per_node)
        size[i] = layout.size
        for k, kind in enumerate(COLLECTIVES):
            lat[i, k], bw[i, k] = group_collective_params(kind, layout, links)
    return MeshCollectiveParams(size, lat, bw)


def mesh_collectives_us(kinds: np.ndarray, nbytes: np.ndarray, mesh_dims: np.ndarray,
                        params: MeshCollectiveParams) -> np.ndarray:
    """Element-wise :func:`mesh_collective_us`: collective ``COLLECTIVES[kinds[k]]`` of
    ``nbytes[k]`` bytes over mesh dim ``mesh_dims[k]``, in µs.

    Args:
        kinds: int array of indices into
            :data:`~pipeline.costmodel.hardware.COLLECTIVES`.
        nbytes: int or float array of the collectives' ``S`` (module table).
        mesh_dims: int array of mesh dims, broadcastable with ``kinds``.
        params: the mesh's :func:`mesh_collective_params`.

    Returns:
        float64 array, each element bit-identical to the scalar
        ``mesh_collective_us(COLLECTIVES[kinds[k]], int(nbytes[k]), mesh_shape,
        mesh_dims[k], hw)`` (both evaluate :func:`alpha_beta_us` on
        :func:`group_collective_params`).
    """
    factor = np.asarray([COLLECTIVE_FACTOR[k] for k in COLLECTIVES])
    kinds = np.asarray(kinds, dtype=np.intp)
    mesh_dims = np.asarray(mesh_dims, dtype=np.intp)
    return alpha_beta_us(factor[kinds], params.lat[mesh_dims, kinds],
                         params.bw[mesh_dims, kinds], nbytes, params.group[mesh_dims])
