"""Alpha-beta cost of NCCL collectives on one mesh dimension, in µs.

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
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from pipeline.costmodel.hardware import COLLECTIVES

__all__ = [
    "COLLECTIVE_FACTOR",
    "all_gather_us",
    "all_reduce_us",
    "all_to_all_us",
    "collective_us",
    "mesh_collective_us",
    "mesh_dim_link",
    "mesh_links",
    "reduce_scatter_us",
]

#: Volume factor numerator multiplier per collective: time uses ``f * (n-1)/n``.
COLLECTIVE_FACTOR: dict[str, float] = {
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "all_reduce": 2.0,
    "all_to_all": 1.0,
}

Link = Literal["intra", "inter"]


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
    if kind not in COLLECTIVE_FACTOR:
        raise ValueError(f"unknown collective {kind!r}; allowed: {', '.join(COLLECTIVES)}")
    lat = float(getattr(link, f"{kind}_latency_us"))
    bw = float(getattr(link, f"{kind}_bw"))
    return _alpha_beta(COLLECTIVE_FACTOR[kind], lat, bw, nbytes, n)


def _alpha_beta(factor: float, lat: Any, bw: Any, nbytes: Any, n: Any) -> Any:
    """``lat + factor*(n-1)/n * nbytes / bw * 1e6``, 0 where n <= 1 (scalar or array)."""
    if np.ndim(nbytes) == 0 and np.ndim(n) == 0 and np.ndim(lat) == 0 and np.ndim(bw) == 0:
        if n <= 1:
            return 0.0
        return lat + (factor * (n - 1) / n) * (nbytes / bw) * 1e6
    nbytes = np.asarray(nbytes, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    t = lat + (factor * (n - 1) / n) * (nbytes / bw) * 1e6
    return np.where(n > 1, t, 0.0)


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


def mesh_collective_us(
    kind: str, nbytes: Any, mesh_shape: Sequence[int], mesh_dim: int, hw: Any
) -> Any:
    """Collective ``kind`` over mesh dim ``mesh_dim`` of ``mesh_shape`` on hardware ``hw``.

    Picks the group size ``mesh_shape[mesh_dim]`` and the intra/inter-node link with
    :func:`mesh_dim_link` (``hw.gpus_per_node``), then applies :func:`collective_us`.
    """
    link = (
        hw.intra_node
        if mesh_dim_link(mesh_shape, mesh_dim, hw.gpus_per_node) == "intra"
        else hw.inter_node
    )
    return collective_us(kind, nbytes, int(mesh_shape[mesh_dim]), link)
