"""Gradient accumulation without pipelining (``model.microbatches = k``): the step time and
memory of a step that runs its batch as ``k`` microbatches, from the simulated step of
one microbatch (:mod:`pipeline.costmodel.steptime` on the graph of one microbatch).

What runs (PyTorch FSDP2, ``FSDPModule.set_requires_gradient_sync``; DDP ``no_sync``):
the first ``k - 1`` microbatches run forward and backward *without gradient
synchronisation* (no gradient reduce-scatter / all-reduce; FSDP2 accumulates the
unsharded gradient in the reduce dtype, ``FSDPParam.to_accumulated_grad_if_needed``,
and still reshards the parameters after each backward, so every microbatch gathers them
again); the last microbatch runs with it, and its reductions carry the sum of all ``k``.
So, with ``T_sync`` the simulated step of one microbatch and ``T_nosync`` the same step
with its gradient edges (:func:`pipeline.costmodel.steptime.gradient_edges`) free:

    step = (k - 1) T_nosync + T_sync

compute ``k x`` one microbatch's, weight gathers and activation redistributions ``k x``,
the gradient reduction once per step (:func:`accumulated_step`). Memory
(:func:`accumulated_peak_bytes`): one microbatch's activations (the graph is one
microbatch's), plus for ``k > 1`` the unsharded accumulated gradients of the
FSDP-sharded parameters in the reduce dtype, which live from the first backward to the
last microbatch's reduction; a replicated parameter's gradient accumulates in place and
adds nothing. One microbatch's peak may already hold one unit's unsharded gradient before
its reduce-scatter, so the sum is an upper bound by at most that.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.costmodel.steptime import StepInputs, StepTime, gradient_edges, simulate

__all__ = ["AccumulatedStep", "accumulated_peak_bytes", "accumulated_step", "without_sync"]


@dataclass
class AccumulatedStep:
    """A step of ``microbatches`` microbatches (module docstring), µs.

    Attributes:
        microbatches: ``k``.
        step_us: ``(k - 1) T_nosync + T_sync``.
        compute_us: ``k`` x one microbatch's compute.
        gradient_comm_us: the gradient reductions, once.
        with_sync, without_sync: the simulated microbatch with and without them.
    """

    microbatches: int
    step_us: float
    compute_us: float
    gradient_comm_us: float
    with_sync: StepTime
    without_sync: StepTime


def without_sync(g: StepInputs) -> StepInputs:
    """``g`` with its gradient edges' redistributions removed (a microbatch run without
    gradient synchronisation)."""
    grad = gradient_edges(g)
    return dataclasses.replace(g, steps=[[] if grad[e] else list(s)
                                         for e, s in enumerate(g.steps)])


def accumulated_step(g: StepInputs, microbatches: int) -> AccumulatedStep:
    """The step of ``microbatches`` microbatches of the plan ``g`` (one microbatch's graph).

    Raises:
        ValueError: for ``microbatches < 1``.
    """
    k = int(microbatches)
    if k < 1:
        raise ValueError(f"microbatches={microbatches}: allowed an integer >= 1")
    sync = simulate(g)
    nosync = simulate(without_sync(g)) if k > 1 else sync
    return AccumulatedStep(
        microbatches=k, step_us=(k - 1) * nosync.step_time_us + sync.step_time_us,
        compute_us=k * sync.compute_us,
        gradient_comm_us=sync.comm_us_by_kind.get("gradient", 0.0),
        with_sync=sync, without_sync=nosync)


def accumulated_peak_bytes(microbatch_peak_bytes: float, unsharded_grad_bytes: float,
                           microbatches: int) -> float:
    """The memory peak of a step of ``microbatches`` microbatches: one microbatch's peak
    plus, for ``k > 1``, the unsharded accumulated gradients (module docstring)."""
    return float(microbatch_peak_bytes) + (float(unsharded_grad_bytes)
                                           if int(microbatches) > 1 else 0.0)
