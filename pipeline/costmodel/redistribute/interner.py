"""Interned placements and every cache built on them: one :class:`PlacementInterner`.

Placements are interned to small ints ("pids"): equal placements (by their own ``==``;
normalized first, so equal-valued ``_MaskPartial`` s are one object) share a pid, so
the planners compare ints instead of calling torch's slow ``__eq__``, and the tables
index numpy arrays by pid. Every cache that stores pids or is keyed by them (and the
plan caches built from them) lives in the same object, so that :meth:`clear` drops
all of them together and no stale pid can survive a clear:

==========================  ===========================================================
attribute                   holds
==========================  ===========================================================
``canon_masks``             one canonical ``_MaskPartial`` per value (normalization)
``pid_of`` / ``objs``       placement -> pid, pid -> placement
``cats``/``dims``/``ops``   per pid: category code, shard dim (-1), Partial reduce op
``transforms``              per pid pair: the classified step (:func:`.steps.classify`)
``meshes``                  process-group-free planning ``DeviceMesh`` per mesh shape
``plans``                   :func:`.planner.plan` results per (src, dst, mesh, shape)
``graph_states``            graph-planner start states per (placements, mesh)
``graph_contexts``          graph-planner edges and searches per (mesh, ndim, numel)
``table_contexts``          :mod:`.records` pair records per (mesh, tensor ndim)
``differ_ids``              :func:`.tables.placements_differ` tuple ids
==========================  ===========================================================

Callers may pass their own interner to every public function of the package; when they
do not, :data:`DEFAULT_INTERNER` is used. That module-level default instance is the
single place this state lives in a process: it makes plans and pair records shared
across cost builds (one model costed on several meshes, sweeps), and
:func:`clear_caches` clears it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from pipeline.costmodel.redistribute.steps import (
    CATEGORY_CODE,
    KIND_CODE,
    category,
    classify,
    is_partial,
    is_shard_like,
    partial_key,
)
from pipeline.dtensor.torch_compat import StridedShard

__all__ = ["DEFAULT_INTERNER", "PidArrays", "PlacementInterner", "clear_caches",
           "normalize_placements"]

#: A pid pair's step: (kind code, reshuffle, reshuffle_local, own dim or -1).
PidTransform = tuple[int, bool, bool, int]


@dataclass(frozen=True)
class PidArrays:
    """numpy copies of the per-pid tables and of :meth:`PlacementInterner.transform`
    over all pid pairs (``kind`` -1 where illegal or equal)."""

    n: int
    cat: np.ndarray  # int64 [n]
    dim: np.ndarray  # int64 [n]
    kind: np.ndarray  # int64 [n, n]
    resh: np.ndarray  # int64 [n, n]
    resh_local: np.ndarray  # int64 [n, n]
    own: np.ndarray  # int64 [n, n]


class PlacementInterner:
    """Interned placement ids and the caches keyed by them (module docstring)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Drop every cache and interned id (a fresh interner's state)."""
        self.canon_masks: dict[tuple, Placement] = {}
        self.pid_of: dict[Placement, int] = {}
        self.objs: list[Placement] = []
        self.cats: list[int] = []
        self.dims: list[int] = []  # shard dim, -1 if not shard-like
        self.ops: list[str | None] = []  # reduce op of a Partial (any subclass), else None
        self.transforms: dict[tuple[int, int], PidTransform | None] = {}
        self._arrays: PidArrays | None = None
        self.meshes: dict[tuple[int, ...], Any] = {}
        self.plans: dict[tuple, Any] = {}
        self.graph_states: dict[tuple, Any] = {}
        self.graph_contexts: dict[tuple, Any] = {}
        self.table_contexts: dict[tuple, Any] = {}
        self.differ_ids: dict[tuple, int] = {}  # placement tuple -> id (by value)
        self.differ_objs: dict[int, tuple[tuple, int]] = {}  # id() of a kept tuple -> id
        self.replicate = self.pid(Replicate())  # pid 0

    # -- placements ------------------------------------------------------------------------

    def canon(self, p: Placement, ndim: int | None) -> Placement:
        """``p`` normalized: a non-negative shard dim (needs ``ndim``), one
        ``_MaskPartial`` object per value."""
        c = category(p)
        if c == "MP":
            return self.canon_masks.setdefault(partial_key(p), p)
        if ndim is not None and c == "SS" and p.dim < 0:
            return StridedShard(p.dim + ndim, split_factor=p.split_factor)
        if ndim is not None and c == "S" and p.dim < 0:
            return Shard(p.dim + ndim)
        return p

    def normalize(self, placements: Sequence[Placement], ndim: int | None = None
                  ) -> tuple[Placement, ...]:
        """:meth:`canon` of each placement."""
        return tuple(self.canon(p, ndim) for p in placements)

    def pid(self, p: Placement) -> int:
        """Interned id of one (normalized) placement."""
        i = self.pid_of.get(p)
        if i is None:
            i = self.pid_of[p] = len(self.objs)
            self.objs.append(p)
            self.cats.append(CATEGORY_CODE[category(p)])
            self.dims.append(int(p.dim) if is_shard_like(p) else -1)
            self.ops.append(p.reduce_op if is_partial(p) else None)
        return i

    def shard_pid(self, d: int) -> int:
        """Pid of ``Shard(d)``."""
        return self.pid(Shard(d))

    def transform(self, a: int, b: int) -> PidTransform | None:
        """:func:`~.steps.classify` of pids ``a -> b`` with the kind as a code."""
        t = self.transforms.get((a, b), False)
        if t is False:
            cls = classify(self.objs[a], self.objs[b])
            t = None if cls is None else (
                KIND_CODE[cls.kind], cls.reshuffle, cls.reshuffle_local,
                -1 if cls.own_dim is None else cls.own_dim)
            self.transforms[(a, b)] = t
        return t

    def arrays(self) -> PidArrays:
        """:class:`PidArrays` of every pid so far (rebuilt when pids were added)."""
        n = len(self.objs)
        if self._arrays is None or self._arrays.n != n:
            kind = np.full((n, n), -1, dtype=np.int64)
            resh = np.zeros((n, n), dtype=np.int64)
            resh_local = np.zeros((n, n), dtype=np.int64)
            own = np.full((n, n), -1, dtype=np.int64)
            for a in range(n):
                for b in range(n):
                    t = self.transform(a, b) if a != b else None
                    if t is not None:
                        kind[a, b], resh[a, b], resh_local[a, b], own[a, b] = t
            self._arrays = PidArrays(n, np.asarray(self.cats, dtype=np.int64),
                                     np.asarray(self.dims, dtype=np.int64),
                                     kind, resh, resh_local, own)
        return self._arrays

    # -- planning mesh ---------------------------------------------------------------------

    def planning_mesh(self, mesh_shape: tuple[int, ...]) -> Any:
        """A ``DeviceMesh`` of ``mesh_shape`` that needs no process group (rank 0's
        view: ``_init_backend=False, _rank=0``)."""
        mesh = self.meshes.get(mesh_shape)
        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.arange(math.prod(mesh_shape), dtype=torch.int).reshape(mesh_shape)
            mesh = self.meshes[mesh_shape] = DeviceMesh("cpu", ranks, _init_backend=False,
                                                        _rank=0)
        return mesh


#: The default interner (module docstring): used when a caller passes none.
DEFAULT_INTERNER = PlacementInterner()


def normalize_placements(
    placements: Sequence[Placement], ndim: int | None = None, *,
    interner: PlacementInterner | None = None,
) -> tuple[Placement, ...]:
    """Canonical form used as cache key: negative shard dims made non-negative (needs
    the tensor ``ndim``) and equal-valued ``_MaskPartial`` s mapped to one instance."""
    return (interner or DEFAULT_INTERNER).normalize(placements, ndim)


def clear_caches() -> None:
    """Drop every plan, pair-record and interning cache of :data:`DEFAULT_INTERNER`."""
    DEFAULT_INTERNER.clear()
