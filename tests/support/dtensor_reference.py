"""DTensor's own redistribution planner as the reference our planners are checked against.

:meth:`DTensorReference.plan` runs ``torch.distributed.tensor._redistribute.
_gen_transform_infos_non_cached`` (greedy planner, or the Dijkstra planner when a
``_StridedShard`` is involved) on specs of a process-group-free planning mesh and turns
its transform infos into our :class:`~pipeline.costmodel.redistribute.Step` s with the
production classifier (so only the planners are compared).

DTensor caches one graph planner per (mesh, tensor meta) whose sets of Partial reduce
ops and ``_StridedShard`` targets *accumulate* over calls, which makes its Dijkstra
plans depend on call history (and can blow up its state space); the planner is dropped
after each call, so every plan is made by a fresh planner.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Placement

from pipeline.costmodel.redistribute.planner import planning_shape
from pipeline.costmodel.redistribute.steps import Step, mixed_partials, steps_from_transforms


class DTensorReference:
    """DTensor's planner with its own planning meshes and spec cache."""

    def __init__(self) -> None:
        self.meshes: dict[tuple[int, ...], Any] = {}
        self.specs: dict[tuple, Any] = {}

    def mesh(self, mesh_shape: tuple[int, ...]) -> Any:
        """``DeviceMesh(..., _init_backend=False, _rank=0)``: no process group needed."""
        if mesh_shape not in self.meshes:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.arange(math.prod(mesh_shape), dtype=torch.int).reshape(mesh_shape)
            self.meshes[mesh_shape] = DeviceMesh("cpu", ranks, _init_backend=False, _rank=0)
        return self.meshes[mesh_shape]

    def spec(self, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
             shape: tuple[int, ...]) -> Any:
        """DTensorSpec of ``placements`` for a contiguous float32 tensor of ``shape``."""
        key = (placements, mesh_shape, shape)
        if key not in self.specs:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

            stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
            meta = TensorMeta(torch.Size(shape), stride, torch.float32)
            self.specs[key] = DTensorSpec(self.mesh(mesh_shape), tuple(placements),
                                          tensor_meta=meta)
        return self.specs[key]

    def plan(
        self,
        src: tuple[Placement, ...],
        dst: tuple[Placement, ...],
        mesh_shape: tuple[int, ...],
        shape: tuple[int, ...] | None,
    ) -> tuple[Step, ...] | None:
        """DTensor's plan (``_gen_transform_infos_non_cached``, fresh planner) of
        normalized ``src -> dst`` for ``shape`` (None: the canonical planning tensor);
        None if DTensor cannot plan it or a step is illegal."""
        from torch.distributed.tensor import _redistribute

        if mixed_partials(src) or mixed_partials(dst):
            return None
        shape = planning_shape(src, dst, mesh_shape, shape)
        try:
            src_spec = self.spec(src, mesh_shape, shape)
            dst_spec = self.spec(dst, mesh_shape, shape)
            _drop_dtensor_planner(src_spec)
            try:
                infos = _redistribute._gen_transform_infos_non_cached(src_spec, dst_spec)
            finally:
                _drop_dtensor_planner(src_spec)
        except (AssertionError, ValueError, RuntimeError, NotImplementedError):
            return None  # DTensor cannot plan it, so it cannot run it
        return steps_from_transforms(
            src, [(info.mesh_dim, *info.src_dst_placements) for info in infos]
        )


def _drop_dtensor_planner(spec: Any) -> None:
    """Forget DTensor's cached planner for ``spec``'s (private planning) mesh and meta."""
    from torch.distributed.tensor import _redistribute

    cache = getattr(_redistribute, "_planner_cache", None)
    if cache is not None:
        cache.pop((weakref.ref(spec.mesh), spec.tensor_meta), None)
