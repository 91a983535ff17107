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

Latency grows with the algorithm's steps (NCCL's tuning model, ``src/graph/tuning.cc``
of NVIDIA/nccl 2.x, ``ncclTopoTuneModel``: ring latency ``baseLat + (nsteps -
nInterSteps) * intraLat + nInterSteps * interLat``, tree latency ``baseLat + 2 *
((nRanks/nNodes - 1) * intraLat + log2i(nNodes) * interLat)``). With ``b_t`` the base
latency (``latency_us``) of the tier the group uses (intra if ``k == 1``, else inter)
and ``h_i``, ``h_e`` the per-step hop latencies (``intra_node.hop_latency_us``,
``inter_node.hop_latency_us``), one ring pass over ``n = k m`` ranks takes ``n-1``
steps of which ``k-1`` cross the network:

* ring pass: ``lat_pass = b_t + (n-k) h_i + (k-1) h_e``; all-gather and reduce-scatter
  pay one pass, all-reduce two (so ``all_reduce == reduce_scatter + all_gather`` stays
  exact). E.g. with NCCL's Ring/Simple hop latencies (``h_i = 3.4``, ``h_e = 14``) and
  ``b = 6.2`` (so that 8 ranks in a node take ``6.2 + 7 x 3.4 = 30 µs``, the H100
  measurement): 64 ranks on 8 nodes ``6.2 + 56 x 3.4 + 7 x 14 = 294.6 µs``. The
  presets keep ``hop_latency_us = 0`` (one latency per pass) for now.
* all-to-all: every rank exchanges with every other at once (NCCL issues it as grouped
  point-to-point sends): one step, ``b_t + h`` with the hop of the farthest tier.
* hierarchical all-reduce: intra reduce-scatter and all-gather (``m-1`` intra steps
  each) and a ring all-reduce across the ``k`` nodes (``2(k-1)`` network steps):
  ``2 b_i + 2 b_e + 2(m-1) h_i + 2(k-1) h_e``.
* tree (the rule): NCCL runs all-reduce as ring or (double binary) tree, whichever its
  model predicts faster for the size; tree is used for all-reduce only. A group that
  spans ``k > 1`` nodes (``hierarchical_all_reduce=false``) is priced as the smaller of
  the ring and the tree: ``lat = 2 b_e + 2((m-1) h_i + floor(log2 k) h_e)`` and, as in
  NCCL's model (tree bus bandwidth ``0.9 x`` the link's, algorithm bandwidth half of
  it), ``2 S / (0.9 B_ring)``, written in the table's form with ``busbw = 0.9 (n-1)/n
  B_ring``. Within a node the ring is used (NCCL's intra-node tree is a chain, never
  faster in its model). The tree reuses the ring's per-hop latencies (NCCL's own
  Simple-protocol tree numbers are chunk latencies of its pipeline; not modelled).

Measured tables. Where the hardware config carries a profile
(:mod:`pipeline.costmodel.profile`) with a table for the collective's kind and the
group's layout (members per node x nodes), its time is the table's: the bus bandwidth
interpolated linearly in ``log2`` of the size and ``time = f (n-1)/n S / busbw(S)``
(nccl-tests' definition, so the table's own rows are reproduced exactly), clamped at
the ends (counted as outside the table). A bucket's latency share (``latency_scale``,
:mod:`pipeline.costmodel.fsdp`) subtracts ``(1 - scale)`` times the table's time at
its smallest size (the measured latency floor). Other layouts use the link model.

All functions accept a Python number or a numpy array of byte counts (and of group
sizes) and return the same shape; scalar and array inputs give bit-identical values.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.costmodel.hardware import COLLECTIVES, tables_of
from pipeline.costmodel.layout import (
    GroupLayout,
    mesh_dim_layout,
    mesh_dim_link,
    mesh_group_layout,
    mesh_link,
    mesh_links,
)
from pipeline.costmodel.profile import Tables

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
    "mesh_params_of_layouts",
    "rail_bandwidth_per_rank",
    "reduce_scatter_us",
    "ring_pass_latency_us",
    "table_collective_us",
    "tree_params",
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

    The ring runs at ``link.bandwidth`` (bus bandwidth); one ring pass costs
    ``link.latency_us + (n-1) link.hop_latency_us`` (two passes for all-reduce; one step
    for all-to-all). For a mesh's groups, whose bandwidth depends on
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
    steps = 1 if kind == "all_to_all" else np.asarray(n, dtype=np.float64) - 1
    lat = _PASSES[kind] * (float(link.latency_us) + steps * float(link.hop_latency_us))
    if np.ndim(lat) == 0:
        lat = float(lat)
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

    @functools.cached_property
    def intra_hop(self) -> float:
        return float(self._hw.intra_node.hop_latency_us)

    @functools.cached_property
    def inter_hop(self) -> float:
        return float(self._hw.inter_node.hop_latency_us)

    @functools.cached_property
    def tables(self) -> Tables | None:
        return tables_of(self._hw)


def rail_bandwidth_per_rank(layout: GroupLayout, hw: Any) -> float:
    """Each rank's share of the scale-out bandwidth, bytes/s one direction:
    ``min(min(m, N) * b / m, N * b / G)`` (module docstring)."""
    h = _Links.of(hw)
    m = layout.per_node
    return min(min(m, h.nics_per_node) * h.nic_bw / m,
               h.nics_per_node * h.nic_bw / h.gpus_per_node)


def ring_pass_latency_us(layout: GroupLayout, hw: Any) -> float:
    """Latency of one ring pass over ``layout``: ``b_t + (n-k) h_i + (k-1) h_e`` (µs;
    module docstring, NCCL's ``(nsteps - nInterSteps) intraLat + nInterSteps interLat``)."""
    h = _Links.of(hw)
    n, k = layout.size, layout.nodes
    base = h.inter_lat if layout.spans_nodes else h.nvlink_lat
    return base + (n - k) * h.intra_hop + (k - 1) * h.inter_hop


def group_collective_params(kind: str, layout: GroupLayout, hw: Any) -> tuple[float, float]:
    """``(lat µs, bus bandwidth bytes/s)`` of collective ``kind`` over a group laid out as
    ``layout`` on hardware ``hw`` by the link model (the cases of the module docstring;
    the ring, or the hierarchical all-reduce; the tree is :func:`tree_params`).

    Raises:
        ValueError: for an unknown ``kind``.
    """
    _check_kind(kind)
    h = _Links.of(hw)
    passes = _PASSES[kind]
    if kind == "all_to_all":
        if not layout.spans_nodes:
            return h.nvlink_lat + h.intra_hop, h.nvlink_bw
    elif not layout.spans_nodes:
        return passes * ring_pass_latency_us(layout, h), h.nvlink_bw
    n, m, k = layout.size, layout.per_node, layout.nodes
    r = rail_bandwidth_per_rank(layout, h)
    if kind == "all_to_all":
        return h.inter_lat + h.inter_hop, (n - 1) / max((m - 1) / h.nvlink_bw, (n - m) / r)
    if kind == "all_reduce" and h.hierarchical and m > 1:
        per_byte = 2 * (m - 1) / (m * h.nvlink_bw) + 2 * (k - 1) / (k * m * r)
        lat = (2 * h.nvlink_lat + 2 * h.inter_lat + 2 * (m - 1) * h.intra_hop
               + 2 * (k - 1) * h.inter_hop)
        return lat, (2 * (n - 1) / n) / per_byte
    ring = r if m == 1 else min(h.nvlink_bw, m * r)
    return passes * ring_pass_latency_us(layout, h), ring


def tree_params(kind: str, layout: GroupLayout, hw: Any) -> tuple[float, float] | None:
    """``(lat µs, bus bandwidth bytes/s)`` of NCCL's tree all-reduce over ``layout``, in
    the table's form, or None where NCCL's rule (module docstring) does not consider it:
    any other kind, a group inside one node, or ``hierarchical_all_reduce``.

    ``lat = 2 b_e + 2((m-1) h_i + floor(log2 k) h_e)``, ``busbw = 0.9 (n-1)/n B_ring``
    (so that ``2(n-1)/n S / busbw = 2 S / (0.9 B_ring)``).
    """
    h = _Links.of(hw)
    if kind != "all_reduce" or not layout.spans_nodes or h.hierarchical:
        return None
    n, m, k = layout.size, layout.per_node, layout.nodes
    ring_bw = group_collective_params(kind, layout, h)[1]
    depth = int(math.floor(math.log2(k)))
    lat = 2 * h.inter_lat + 2 * ((m - 1) * h.intra_hop + depth * h.inter_hop)
    return lat, 0.9 * (n - 1) / n * ring_bw


def table_collective_us(kind: str, nbytes: Any, n: Any, sizes: Sequence[int],
                        busbw: Sequence[float], latency_scale: float = 1.0
                        ) -> tuple[np.ndarray, int]:
    """Time (µs) of ``kind`` from a measured table: ``f (n-1)/n S / busbw(S) * 1e6`` with
    ``busbw`` interpolated linearly in ``log2 S`` and clamped at the table's ends, minus
    ``(1 - latency_scale)`` times the time of the table's smallest size (at least 0);
    and how many of the sizes lay outside the table. Array in, array out."""
    nb = np.asarray(nbytes, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    ls = np.log2(np.asarray(sizes, dtype=np.float64))
    bw = np.interp(np.log2(np.maximum(nb, 1.0)), ls, np.asarray(busbw, dtype=np.float64))
    f = COLLECTIVE_FACTOR[kind]
    t = (f * (n - 1) / n) * (nb / bw) * 1e6
    if latency_scale != 1.0:
        floor = (f * (n - 1) / n) * (float(sizes[0]) / float(busbw[0])) * 1e6
        t = np.maximum(t - (1.0 - latency_scale) * floor, 0.0)
    outside = int(np.count_nonzero((nb < sizes[0]) | (nb > sizes[-1])))
    return np.where(n > 1, t, 0.0), outside


def _table_of(kind: str, layout: GroupLayout, h: _Links) -> tuple[list, list] | None:
    tables = h.tables
    if tables is None or layout.size <= 1 or layout.size != layout.per_node * layout.nodes:
        return None
    return tables.collective_busbw(kind, layout.per_node, layout.nodes)


def group_collective_us(kind: str, nbytes: Any, layout: GroupLayout, hw: Any) -> Any:
    """Collective ``kind`` of ``nbytes`` (module table) over a group laid out as
    ``layout`` on ``hw``, in µs: the measured table where the profile has one for the
    kind and layout, else :func:`alpha_beta_us` on :func:`group_collective_params`
    (the smaller of that and :func:`tree_params` where NCCL would consider the tree)."""
    h = _Links.of(hw)
    params = mesh_params_of_layouts([layout], h)
    kinds = np.full(np.shape(nbytes), COLLECTIVES.index(kind), dtype=np.intp)
    out = mesh_collectives_us(kinds, nbytes, np.zeros(np.shape(nbytes), dtype=np.intp), params)
    return float(out) if np.ndim(out) == 0 else out


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
    """The parameters of every collective on every row (a mesh dim, or a flattened
    group) of one mesh.

    Attributes:
        group: int64 ``[rows]``, the group size ``n`` of each row.
        lat: float64 ``[rows, len(COLLECTIVES)]``, latency in µs of each collective
            (:data:`~pipeline.costmodel.hardware.COLLECTIVES` order) over the groups of
            each row (:func:`group_collective_params`).
        bw: float64 ``[rows, len(COLLECTIVES)]``, bus bandwidth in bytes/s, likewise.
        tree_lat, tree_bw: the tree's (:func:`tree_params`; NaN: none), or None.
        tables: ``((row, kind index, sizes, busbw bytes/s), ...)``: entries priced by a
            measured table (:func:`table_collective_us`).
        latency_scale: the bucket latency share applied (:meth:`scaled`).
        counter: the profile's :class:`~pipeline.costmodel.profile.Tables`, or None.
    """

    group: np.ndarray
    lat: np.ndarray
    bw: np.ndarray
    tree_lat: np.ndarray | None = None
    tree_bw: np.ndarray | None = None
    tables: tuple = ()
    latency_scale: float = 1.0
    counter: Any = None

    def key(self) -> tuple:
        """A hashable value identity (for caches keyed by the parameters)."""
        tree = b"" if self.tree_lat is None else self.tree_lat.tobytes() + self.tree_bw.tobytes()
        tables = tuple((r, k, tuple(s), tuple(b)) for r, k, s, b in self.tables)
        return (self.group.tobytes(), self.lat.tobytes(), self.bw.tobytes(), tree, tables,
                self.latency_scale)

    def scaled(self, latency_scale: float) -> MeshCollectiveParams:
        """These parameters with every latency times ``latency_scale`` (a bucket
        member's share, :mod:`pipeline.costmodel.fsdp`); tables subtract the share of
        their latency floor (:func:`table_collective_us`)."""
        s = float(latency_scale)
        return MeshCollectiveParams(
            self.group, self.lat * s, self.bw,
            None if self.tree_lat is None else self.tree_lat * s, self.tree_bw,
            self.tables, self.latency_scale * s, self.counter)


def mesh_params_of_layouts(layouts: Sequence[GroupLayout | None], hw: Any,
                           used: Iterable[tuple[int, int]] | None = None
                           ) -> MeshCollectiveParams:
    """:class:`MeshCollectiveParams` with one row per layout (None: a group of one);
    with ``used`` only those ``(row, kind index)`` entries, the others NaN."""
    rows, n_kinds = max(1, len(layouts)), len(COLLECTIVES)
    lat = np.full((rows, n_kinds), np.nan)
    bw = np.full_like(lat, np.nan)
    tree_lat = np.full_like(lat, np.nan)
    tree_bw = np.full_like(lat, np.nan)
    size = np.ones(rows, dtype=np.int64)
    if used is None:
        used = [(i, k) for i in range(len(layouts)) for k in range(n_kinds)]
    used = sorted(set(used))
    h = _Links.of(hw)
    tables = []
    any_tree = False
    for i, layout in enumerate(layouts):
        if layout is not None:
            size[i] = layout.size
    for i, k in used:
        layout = layouts[i]
        if layout is None:
            lat[i, k], bw[i, k] = 0.0, 1.0
            continue
        kind = COLLECTIVES[k]
        lat[i, k], bw[i, k] = group_collective_params(kind, layout, h)
        tree = tree_params(kind, layout, h)
        if tree is not None:
            tree_lat[i, k], tree_bw[i, k] = tree
            any_tree = True
        table = _table_of(kind, layout, h) if layout.size > 1 else None
        if table is not None:
            tables.append((i, k, tuple(table[0]), tuple(table[1])))
        elif h.tables is not None and layout.size > 1:
            h.tables.count_missing_layout()
    return MeshCollectiveParams(size, lat, bw, tree_lat if any_tree else None,
                                tree_bw if any_tree else None, tuple(tables), 1.0,
                                h.tables)


def mesh_collective_params(
    mesh_shape: Sequence[int], hw: Any, used: Iterable[tuple[int, int]] | None = None
) -> MeshCollectiveParams:
    """:class:`MeshCollectiveParams` of ``mesh_shape`` on hardware ``hw``, one row per
    mesh dim.

    With ``used``, an iterable of ``(mesh dim, collective index)`` pairs, only those
    entries are computed and the others are NaN: for a caller that costs those
    collectives only.
    """
    links = _Links.of(hw)
    layouts = [mesh_dim_layout(mesh_shape, m, links.gpus_per_node)
               for m in range(len(mesh_shape))]
    params = mesh_params_of_layouts(layouts, links, used)
    return MeshCollectiveParams(np.asarray(mesh_shape, dtype=np.int64), params.lat, params.bw,
                                params.tree_lat, params.tree_bw, params.tables, 1.0,
                                params.counter)


def flat_group_params(mesh_shape: Sequence[int], hw: Any,
                      groups: Sequence[Sequence[int]]) -> MeshCollectiveParams:
    """:class:`MeshCollectiveParams` whose rows are ``groups`` (each a set of mesh dims
    taken together, a flattened sub-mesh) instead of the mesh dims: row ``i`` holds the
    size of group ``i`` and the parameters of every collective over it
    (:func:`mesh_group_layout`, :func:`group_collective_params`)."""
    links = _Links.of(hw)
    layouts = [mesh_group_layout(mesh_shape, tuple(dims), links.gpus_per_node)
               for dims in groups] or [None]
    return mesh_params_of_layouts(layouts, links)


def mesh_collectives_us(kinds: np.ndarray, nbytes: np.ndarray, mesh_dims: np.ndarray,
                        params: MeshCollectiveParams, counted: Any = None) -> np.ndarray:
    """Element-wise :func:`mesh_collective_us`: collective ``COLLECTIVES[kinds[k]]`` of
    ``nbytes[k]`` bytes over mesh dim ``mesh_dims[k]``, in µs.

    Args:
        kinds: int array of indices into
            :data:`~pipeline.costmodel.hardware.COLLECTIVES`.
        nbytes: int or float array of the collectives' ``S`` (module table).
        mesh_dims: int array of mesh dims (rows of ``params``), broadcastable with
            ``kinds``.
        params: the mesh's :func:`mesh_collective_params`.
        counted: bool array, the entries that are real collectives (counted as table
            lookups); None: all.

    Returns:
        float64 array, each element bit-identical to the scalar
        ``mesh_collective_us(COLLECTIVES[kinds[k]], int(nbytes[k]), mesh_shape,
        mesh_dims[k], hw)`` (both evaluate this function): the ring (or hierarchical)
        alpha-beta time, the smaller of it and the tree's where the tree is
        considered, the measured table's where there is one.
    """
    factor = np.asarray([COLLECTIVE_FACTOR[k] for k in COLLECTIVES])
    kinds = np.asarray(kinds, dtype=np.intp)
    mesh_dims = np.asarray(mesh_dims, dtype=np.intp)
    group = params.group[mesh_dims]
    out = alpha_beta_us(factor[kinds], params.lat[mesh_dims, kinds],
                        params.bw[mesh_dims, kinds], nbytes, group)
    if params.tree_lat is None and not params.tables:
        return out
    out = np.array(out, dtype=np.float64)
    if params.tree_lat is not None:
        tl = params.tree_lat[mesh_dims, kinds]
        has = ~np.isnan(tl)
        if has.any():
            tree = alpha_beta_us(factor[kinds], np.where(has, tl, 0.0),
                                 np.where(has, params.tree_bw[mesh_dims, kinds], 1.0),
                                 nbytes, group)
            out = np.where(has, np.minimum(out, tree), out)
    if params.tables:
        nb = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), out.shape)
        grp = np.broadcast_to(group, out.shape)
        kb = np.broadcast_to(kinds, out.shape)
        db = np.broadcast_to(mesh_dims, out.shape)
        for row, k, sizes, busbw in params.tables:
            mask = (db == row) & (kb == k)
            if not mask.any():
                continue
            t, _ = table_collective_us(COLLECTIVES[k], nb[mask], grp[mask], sizes,
                                       busbw, params.latency_scale)
            out[mask] = t
            if params.counter is not None:
                real = mask if counted is None else mask & np.broadcast_to(counted, mask.shape)
                off = real & ((nb < sizes[0]) | (nb > sizes[-1]))
                params.counter.count_collective(int(real.sum()), int(off.sum()))
    return out
