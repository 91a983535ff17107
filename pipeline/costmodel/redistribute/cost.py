"""Time of one redistribution, in µs: :func:`redistribute_us` and its per-step
breakdown :func:`redistribute_steps`.

The redistribution is planned (:func:`.planner.plan`), steps on mesh dims of size 1
are dropped (DTensor skips them; they cost nothing), and the remaining steps are costed
by :func:`.steps.step_costs` (collective from :mod:`pipeline.costmodel.comm` plus local
reshuffle) and summed in plan order. :mod:`.tables` costs the same steps with the same
function, so a table entry equals :func:`redistribute_us` bit for bit.

The transition penalty of the pairwise factor (1.0 when placements differ) is *not*
added here; the caller adds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.distributed.tensor.placement_types import Placement

from pipeline.costmodel.redistribute.interner import DEFAULT_INTERNER, PlacementInterner
from pipeline.costmodel.redistribute.planner import plan_normalized
from pipeline.costmodel.redistribute.steps import (
    CostParams,
    Step,
    StepRows,
    check_dims,
    check_inputs,
    step_costs,
    step_row,
)

__all__ = ["StepCost", "redistribute_steps", "redistribute_us"]


@dataclass(frozen=True)
class StepCost:
    """One step of a costed redistribution, for reports.

    Attributes:
        kind: one of :data:`~.steps.KINDS` (all_gather, reduce_scatter, all_reduce,
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


def _checked_plan(
    interner: PlacementInterner, shape: tuple[int, ...], itemsize: int,
    src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: tuple[int, ...],
) -> tuple[Step, ...] | None:
    check_inputs(shape, itemsize, mesh_shape)
    check_dims(src, len(shape), len(mesh_shape), "src")
    check_dims(dst, len(shape), len(mesh_shape), "dst")
    src_n = interner.normalize(src, len(shape))
    dst_n = interner.normalize(dst, len(shape))
    return plan_normalized(interner, src_n, dst_n, mesh_shape, shape)


def _costed(steps: tuple[Step, ...], shape: tuple[int, ...], itemsize: int,
            mesh_shape: tuple[int, ...], hw: Any, reduce_itemsize: int = 0,
            latency_scale: float = 1.0) -> tuple[list[Step], np.ndarray, np.ndarray]:
    """The steps on mesh dims of size > 1, their µs and their collective bytes ``S``."""
    live = [st for st in steps if mesh_shape[st.mesh_dim] > 1]
    rows = [step_row(st, mesh_shape, len(shape)) for st in live]
    params = CostParams.of(mesh_shape, hw, rows, latency_scale=latency_scale)
    us, s_bytes = step_costs(StepRows.of(rows, len(shape)), shape, itemsize, params,
                             reduce_itemsize)
    return live, us, s_bytes


def redistribute_us(
    shape: Sequence[int],
    itemsize: int,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int],
    hw: Any,
    *,
    interner: PlacementInterner | None = None,
    reduce_itemsize: int = 0,
    latency_scale: float = 1.0,
) -> float:
    """Time in µs to redistribute a tensor from ``src`` to ``dst`` placements.

    Args:
        shape: the tensor's global (logical) shape.
        itemsize: bytes per element (e.g. 2 for bf16, 4 for fp32).
        src, dst: placements, one per mesh dim.
        mesh_shape: the device mesh shape.
        hw: :class:`~pipeline.costmodel.hardware.HardwareConfig` (or DictConfig).
        interner: the caches to use (default :data:`~.interner.DEFAULT_INTERNER`).
        reduce_itemsize: bytes per element the reductions (reduce-scatter, all-reduce)
            run in when larger than ``itemsize``: a gradient reduced in its reduce dtype
            (:func:`.steps.step_itemsize`); 0 for the tensor's own.
        latency_scale: factor on every collective's latency, the member's share of its
            bucket's latency (:mod:`pipeline.costmodel.fsdp`); 1.0 for none.

    Returns:
        0.0 if ``src == dst``; ``math.inf`` if DTensor forbids the redistribution;
        else the sum of the per-step costs (see :mod:`.steps`) in plan order. No
        transition penalty is included.

    Raises:
        ValueError: for inconsistent shapes / placements / mesh.
    """
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    steps = _checked_plan(interner or DEFAULT_INTERNER, shape, itemsize, src, dst, mesh_shape)
    if steps is None:
        return math.inf
    if not steps:
        return 0.0
    total = 0.0
    for us in _costed(steps, shape, int(itemsize), mesh_shape, hw, int(reduce_itemsize),
                      float(latency_scale))[1].tolist():
        total += us
    return total


def redistribute_steps(
    shape: Sequence[int],
    itemsize: int,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int],
    hw: Any,
    *,
    interner: PlacementInterner | None = None,
    reduce_itemsize: int = 0,
    latency_scale: float = 1.0,
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
    steps = _checked_plan(interner or DEFAULT_INTERNER, shape, itemsize, src, dst, mesh_shape)
    if steps is None:
        return None
    live, us, s_bytes = _costed(steps, shape, int(itemsize), mesh_shape, hw,
                                int(reduce_itemsize), float(latency_scale))
    return [StepCost(st.kind, st.mesh_dim, b, t)
            for st, b, t in zip(live, s_bytes.tolist(), us.tolist(), strict=True)]
