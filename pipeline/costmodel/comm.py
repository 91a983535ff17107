"""Alpha-beta cost of NCCL collectives on one mesh dimension, in µs.

This module is the one home of the collective time formula and of the link model: the
scalar helpers (:func:`collective_us`, :func:`all_gather_us`, ...,
:func:`mesh_collective_us`) and the vectorised one the redistribution steps are costed
with (:func:`mesh_collectives_us`, on the per-mesh-dim parameters of
:func:`mesh_collective_params`) all evaluate :func:`alpha_beta_us`, and the link a mesh
dim uses is chosen in one place (:func:`mesh_link`).

Model (Hockney alpha-beta with ring-algorithm volume factors, Thakur, Rabenseifner
& Gropp 2005, "Optimization of Collective Communication Operations in MPICH"; bus
bandwidth as defined in the NCCL docs, "performance.md" of nccl-tests), for a group
of ``n`` ranks and per-device buffer sizes in bytes:

====================  ====================================  ==========================
collective            time (µs)                             ``S`` is
====================  ====================================  ==========================
all_gather            ``lat + (n-1)/n * S / bw * 1e6``      output (gathered) bytes
reduce_scatter        ``lat + (n-1)/n * S / bw * 1e6``      input (unscattered) bytes
all_reduce            ``lat + 2(n-1)/n * S / bw * 1e6``     buffer bytes
all_to_all            ``lat + (n-1)/n * S / bw * 1e6``      local bytes per device
====================  ====================================  ==========================

``lat`` (µs) and ``bw`` (bus bandwidth, bytes/s) come from the
:class:`~pipeline.costmodel.hardware.LinkConfig` of the link the mesh dim uses
(:func:`mesh_dim_link`). A group of one rank costs 0 (no collective is issued).

All functions accept a Python number or a numpy array of byte counts (and of group
sizes) and return the same shape; scalar and array inputs give bit-identical values.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pipeline.costmodel.hardware import COLLECTIVES

__all__ = [
    "COLLECTIVE_FACTOR",
    "MeshCollectiveParams",
    "all_gather_us",
    "all_reduce_us",
    "all_to_all_us",
    "alpha_beta_us",
    "collective_us",
    "mesh_collective_params",
    "mesh_collective_us",
    "mesh_collectives_us",
    "mesh_dim_link",
    "mesh_link",
    "mesh_links",
    "reduce_scatter_us",
]

#: Volume factor numerator multiplier per collective: time uses ``f * (n-1)/n``.
COLLECTIVE_FACTOR: Mapping[str, float] = types.MappingProxyType({
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
        lat: fixed latency in µs, number or array.
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


def _link_params(link: Any, kind: str) -> tuple[float, float]:
    """``(latency µs, bus bandwidth bytes/s)`` of collective ``kind`` on ``link``."""
    return float(getattr(link, f"{kind}_latency_us")), float(getattr(link, f"{kind}_bw"))


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVE_FACTOR:
        raise ValueError(f"unknown collective {kind!r}; allowed: {', '.join(COLLECTIVES)}")


def collective_us(kind: str, nbytes: Any, n: Any, link: Any) -> Any:
    """Time in µs of collective ``kind`` on ``n`` ranks over ``link``.

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
    lat, bw = _link_params(link, kind)
    return alpha_beta_us(COLLECTIVE_FACTOR[kind], lat, bw, nbytes, n)


def all_gather_us(nbytes: Any, n: Any, link: Any) -> Any:
    """All-gather of ``nbytes`` *output* bytes per device: ``lat + (n-1)/n * S / bw`` (µs)."""
    return collective_us("all_gather", nbytes, n, link)


def reduce_scatter_us(nbytes: Any, n: Any, link: Any) -> Any:
    """Reduce-scatter of ``nbytes`` *input* bytes per device: ``lat + (n-1)/n * S / bw`` (µs)."""
    return collective_us("reduce_scatter", nbytes, n, link)


def all_reduce_us(nbytes: Any, n: Any, link: Any) -> Any:
    """All-reduce of an ``nbytes`` buffer: ``lat + 2(n-1)/n * S / bw`` (µs)."""
    return collective_us("all_reduce", nbytes, n, link)


def all_to_all_us(nbytes: Any, n: Any, link: Any) -> Any:
    """All-to-all of ``nbytes`` *local* bytes per device: ``lat + (n-1)/n * S / bw`` (µs)."""
    return collective_us("all_to_all", nbytes, n, link)


# --------------------------------------------------------------------------- mesh dims


def mesh_dim_link(mesh_shape: Sequence[int], mesh_dim: int, gpus_per_node: int) -> Link:
    """Which link a collective over ``mesh_dim`` uses.

    Mesh dims map innermost-first onto the GPUs of a node (the last mesh dim has
    stride 1 in the rank order), so dim ``m`` stays inside one node iff
    ``prod(mesh_shape[m:]) <= gpus_per_node``.

    Example, 8 GPUs/node: ``(8,)`` -> dim 0 intra; ``(8, 8)`` -> dim 0 inter, dim 1
    intra; ``(2, 4, 8)`` -> dims 0, 1 inter, dim 2 intra.

    Raises:
        ValueError: if ``mesh_dim`` is out of range.
    """
    ndim = len(mesh_shape)
    if not -ndim <= mesh_dim < ndim:
        raise ValueError(f"mesh_dim={mesh_dim} out of range for mesh {tuple(mesh_shape)}")
    m = mesh_dim % ndim
    return "intra" if math.prod(mesh_shape[m:]) <= gpus_per_node else "inter"


def mesh_links(mesh_shape: Sequence[int], gpus_per_node: int) -> tuple[Link, ...]:
    """:func:`mesh_dim_link` for every mesh dim."""
    return tuple(mesh_dim_link(mesh_shape, m, gpus_per_node) for m in range(len(mesh_shape)))


def mesh_link(mesh_shape: Sequence[int], mesh_dim: int, hw: Any) -> Any:
    """The :class:`~pipeline.costmodel.hardware.LinkConfig` of ``hw`` that a collective
    over ``mesh_dim`` uses (:func:`mesh_dim_link` with ``hw.gpus_per_node``)."""
    if mesh_dim_link(mesh_shape, mesh_dim, hw.gpus_per_node) == "intra":
        return hw.intra_node
    return hw.inter_node


def mesh_collective_us(
    kind: str, nbytes: Any, mesh_shape: Sequence[int], mesh_dim: int, hw: Any
) -> Any:
    """Collective ``kind`` over mesh dim ``mesh_dim`` of ``mesh_shape`` on hardware ``hw``.

    Picks the group size ``mesh_shape[mesh_dim]`` and the link with :func:`mesh_link`,
    then applies :func:`collective_us`.
    """
    link = mesh_link(mesh_shape, mesh_dim, hw)
    return collective_us(kind, nbytes, int(mesh_shape[mesh_dim]), link)


@dataclass(frozen=True)
class MeshCollectiveParams:
    """The alpha-beta parameters of every collective on every mesh dim of one mesh.

    Attributes:
        group: int64 ``[ndim]``, the group size ``n`` of each mesh dim.
        lat: float64 ``[ndim, len(COLLECTIVES)]``, latency in µs of each collective
            (:data:`~pipeline.costmodel.hardware.COLLECTIVES` order) on the link of
            each mesh dim (:func:`mesh_link`).
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
    entries are read and the others are NaN: for a caller that costs those collectives
    only (reading a DictConfig is slow).
    """
    ndim, n_kinds = len(mesh_shape), len(COLLECTIVES)
    lat = np.full((ndim, n_kinds), np.nan)
    bw = np.full_like(lat, np.nan)
    if used is None:
        used = [(m, k) for m in range(ndim) for k in range(n_kinds)]
    links: dict[int, Any] = {}  # mesh dim -> its link
    # (id(link), k) -> params; the links are kept alive in ``links``, so ids stay unique
    read: dict[tuple[int, int], tuple[float, float]] = {}
    for m, k in sorted(set(used)):
        link = links.get(m)
        if link is None:
            link = links[m] = mesh_link(mesh_shape, m, hw)
        hit = read.get((id(link), k))
        if hit is None:
            hit = read[(id(link), k)] = _link_params(link, COLLECTIVES[k])
        lat[m, k], bw[m, k] = hit
    return MeshCollectiveParams(np.asarray(mesh_shape, dtype=np.int64), lat, bw)


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
        mesh_dims[k], hw)`` (both evaluate :func:`alpha_beta_us`).
    """
    factor = np.asarray([COLLECTIVE_FACTOR[k] for k in COLLECTIVES])
    kinds = np.asarray(kinds, dtype=np.intp)
    mesh_dims = np.asarray(mesh_dims, dtype=np.intp)
    return alpha_beta_us(factor[kinds], params.lat[mesh_dims, kinds],
                         params.bw[mesh_dims, kinds], nbytes, params.group[mesh_dims])
