"""How the ranks of a communication group sit on the nodes of a device mesh.

Global ranks are the row-major order of the mesh (the last mesh dim has stride 1, as
``init_device_mesh`` lays out ``arange(world).view(mesh_shape)``), packed
``gpus_per_node`` per node. The group of a mesh dim (or of several mesh dims taken
together, a flattened sub-mesh) is laid out as ``k`` nodes spanned x ``m`` members per
node (:func:`mesh_group_layout`; a non-uniform layout is described by its most
constrained group: fewest members on a node, most nodes). The collective times over
these layouts are :mod:`pipeline.costmodel.comm`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = [
    "GroupLayout",
    "Link",
    "mesh_dim_layout",
    "mesh_dim_link",
    "mesh_group_layout",
    "mesh_link",
    "mesh_links",
]

Link = Literal["intra", "inter"]



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
