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

from torch.distributed.tensor.placement_types import Placement

from pipeline.costmodel.redistribute.flatten import FlatGroups, flat_parts, run_row, uniform_row
from pipeline.costmodel.redistribute.interner import DEFAULT_INTERNER, PlacementInterner
from pipeline.costmodel.redistribute.planner import plan_normalized
from pipeline.costmodel.redistribute.steps import (
    KINDS,
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
        mesh_dim: the mesh dim the step runs over (the first of ``mesh_dims``).
        bytes: bytes each device sends into the collective (the ``S`` of the
            alpha-beta model: ``n * L`` for all-gather / reduce-scatter, ``L`` for
            all-to-all, ``G`` for all-reduce); 0 for a local op.
        us: the step's time in µs, collective plus local reshuffle.
        mesh_dims: the mesh dims of its group, sorted: ``(mesh_dim,)``, or several for
            a flattened collective (``flatten=True``, :mod:`.flatten`).
    """

    kind: str
    mesh_dim: int
    bytes: int
    us: float
    mesh_dims: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.mesh_dims is None:
            object.__setattr__(self, "mesh_dims", (self.mesh_dim,))

    @property
    def flattened(self) -> bool:
        """One collective over the flattened group of several mesh dims (:mod:`.flatten`)."""
        return len(self.mesh_dims) > 1


def _checked_plan(
    interner: PlacementInterner, shape: tuple[int, ...], itemsize: int,
    src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: tuple[int, ...],
) -> tuple[tuple[Step, ...] | None, tuple[Placement, ...], tuple[Placement, ...]]:
    """DTensor's plan of ``src -> dst`` (None: illegal) and the normalized placements."""
    check_inputs(shape, itemsize, mesh_shape)
    check_dims(src, len(shape), len(mesh_shape), "src")
    check_dims(dst, len(shape), len(mesh_shape), "dst")
    src_n = interner.normalize(src, len(shape))
    dst_n = interner.normalize(dst, len(shape))
    return plan_normalized(interner, src_n, dst_n, mesh_shape, shape), src_n, dst_n


def _costed(steps: tuple[Step, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...],
            shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, ...], hw: Any,
            reduce_itemsize: int = 0, latency_scale: float = 1.0,
            flatten: bool = False) -> list[StepCost]:
    """The steps on mesh dims of size > 1 as :class:`StepCost` s; with ``flatten``, a
    uniform redistribution as one flattened collective, else runs of one collective over
    several mesh dims as one (:mod:`.flatten`)."""
    ndim = len(shape)
    live = [st for st in steps if mesh_shape[st.mesh_dim] > 1]
    rows = [step_row(st, mesh_shape, ndim) for st in live]
    uniform = uniform_row(src, dst, mesh_shape, ndim) if flatten else None
    parts = [] if uniform is not None else (
        flat_parts(rows) if flatten else [(k,) for k in range(len(rows))])
    single = [p[0] for p in parts if len(p) == 1]
    params = CostParams.of(mesh_shape, hw, [rows[k] for k in single],
                           latency_scale=latency_scale)
    us, s_bytes = step_costs(StepRows.of([rows[k] for k in single], ndim), shape, itemsize,
                             params, reduce_itemsize)
    one = dict(zip(single, zip(s_bytes.tolist(), us.tolist(), strict=True)))
    groups = FlatGroups(mesh_shape)
    flat_rows = [groups.number(*uniform)] if uniform is not None else [
        groups.number(*run_row(rows, p, mesh_shape)) for p in parts if len(p) > 1]
    flat: list[tuple[int, float]] = []
    if flat_rows:
        f_us, f_bytes = step_costs(StepRows.of(flat_rows, ndim), shape, itemsize,
                                   groups.cost_params(hw, params.hbm, latency_scale),
                                   reduce_itemsize)
        flat = list(zip(f_bytes.tolist(), f_us.tolist(), strict=True))
    if uniform is not None:
        dims = uniform[0]
        return [StepCost(KINDS[flat_rows[0].kind], dims[0], int(flat[0][0]), flat[0][1], dims)]
    out: list[StepCost] = []
    it = iter(zip(flat_rows, flat))
    for p in parts:
        st = live[p[0]]
        if len(p) == 1:
            b, t = one[p[0]]
            out.append(StepCost(st.kind, st.mesh_dim, int(b), t))
            continue
        row, (b, t) = next(it)
        dims = groups.dims[row.mesh_dim]
        out.append(StepCost(st.kind, dims[0], int(b), t, dims))
    return out


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
    flatten: bool = False,
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
        flatten: price a run of one collective over several mesh dims as one
            collective over their flattened group, as FSDP2 runs a parameter's
            (:mod:`.flatten`); False: one collective per mesh dim, as DTensor.

    Returns:
        0.0 if ``src == dst``; ``math.inf`` if DTensor forbids the redistribution;
        else the sum of the per-step costs (see :mod:`.steps`) in plan order. No
        transition penalty is included.

    Raises:
        ValueError: for inconsistent shapes / placements / mesh.
    """
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    steps, src_n, dst_n = _checked_plan(interner or DEFAULT_INTERNER, shape, itemsize, src,
                                        dst, mesh_shape)
    if steps is None:
        return math.inf
    if not steps:
        return 0.0
    total = 0.0
    for part in _costed(steps, src_n, dst_n, shape, int(itemsize), mesh_shape, hw,
                        int(reduce_itemsize), float(latency_scale), bool(flatten)):
        total += part.us
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
    flatten: bool = False,
) -> list[StepCost] | None:
    """The steps of :func:`redistribute_us` with their kinds, bytes and µs.

    Same arguments and errors as :func:`redistribute_us`; steps over mesh dims of
    size 1 (which cost nothing) are left out; with ``flatten`` a flattened collective
    is one entry (its ``mesh_dims`` name its dims). The ``us`` fields summed in order
    equal ``redistribute_us`` exactly.

    Returns:
        ``[]`` if ``src == dst``; ``None`` if DTensor forbids the redistribution.
    """
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    steps, src_n, dst_n = _checked_plan(interner or DEFAULT_INTERNER, shape, itemsize, src,
                                        dst, mesh_shape)
    if steps is None:
        return None
    return _costed(steps, src_n, dst_n, shape, int(itemsize), mesh_shape, hw,
                   int(reduce_itemsize), float(latency_scale), bool(flatten))
