"""Step time and memory of a pipelined plan: stages, boundary sends on the ``pp`` mesh
dim, FSDP2's gathers and reductions under ``torch.distributed.pipelining``, and each
rank's memory over the schedule.

Torch-free. The schedules and their simulation are :mod:`pipeline.costmodel.schedules`;
this module prices what runs around them, from per-stage numbers (:class:`StageCost`:
one microbatch's forward and backward time of the stage, its memory and its FSDP
collectives, which the SPMD plan of the stage on the other mesh dims gives).

**Boundary sends.** Stage ``s`` sends its output activation of one microbatch to stage
``s+1`` and receives the gradient of the same shape back. Each device of the stage sends
its own copy (or shard) to its peer of the next stage, all at once:
``lat + S / bw`` (Hockney alpha-beta, as :mod:`pipeline.costmodel.comm`) with ``S`` the
bytes of one device's boundary tensor (:func:`boundary_bytes`). Peers on one node use
NVLink (``intra_node``); peers on two nodes a share of the node's NICs: every GPU of the
node sends at once, one peer per rank, so ``bw = min(b, N b / G)``
(:func:`pipeline.costmodel.comm.rail_bandwidth_per_rank` of a group of one member per
node; ``b`` the NIC bandwidth, ``N`` NICs, ``G`` GPUs per node), latency
``inter_node.latency_us`` (:func:`p2p_us`). The peers of stages ``s`` and ``s+1`` are
the global ranks ``s k`` and ``(s+1) k`` for ``k`` the stride of the ``pp`` mesh dim
(ranks row-major, packed ``gpus_per_node`` per node).

**FSDP2 under pipelining** (torch 2.13, ``torch/distributed/pipelining/stage.py``,
``backward_maybe_with_nosync`` and ``perform_reduce_grad``; ``schedules.py``,
``_add_unshard_reshard``, ``_add_reduce_grad``):

* every backward of a microbatch runs with ``set_requires_gradient_sync(False)`` and
  ``set_reshard_after_backward(False)``: the gradient is *accumulated unsharded*, in the
  reduce dtype (``FSDPParam.to_accumulated_grad_if_needed``), and the parameters stay
  gathered after a backward;
* the gradient is reduced **once per step**: ``ScheduleGPipe`` / ``Schedule1F1B`` call
  ``perform_reduce_grad`` after the last microbatch; ``ScheduleInterleaved1F1B`` (a
  runtime schedule) inserts a ``REDUCE_GRAD`` action right after each stage's last
  backward. It ends with FSDP's final callback, which makes the default stream wait for
  the reduction, so the rank's next op waits: the reduction is exposed;
* parameters are gathered when a stage's forward or backward finds them sharded; a
  forward reshards after itself only with ``reshard_after_forward=True`` (FSDP2's
  ``post_forward``); so with ``reshard_after_forward=False`` (torchtitan's default under
  PP) a single-stage schedule gathers **once per step**, with ``True`` once per forward
  that follows a forward (GPipe: ``m + 1`` per step) or a backward after a forward
  (1F1B: about once per microbatch). ``ScheduleInterleaved1F1B`` also issues its own
  ``UNSHARD`` / ``RESHARD`` per stage, keeping the next 3 distinct stages of the rank's
  order gathered (``max_active_stages=3``) and resharding the others.
  :func:`fsdp_state` replays these rules over a rank's order and counts the gathers.
  The first gather of a rank is exposed (``start_us``; nothing runs before it), the
  others are prefetched and overlapped; :attr:`PipelineStep.gather_us` says how much
  comm they add, to compare with the rank's compute.

**Memory per rank**, in bytes, walking its order (:func:`rank_memory`): the stages'
sharded parameters, gradients and optimizer state (``state_bytes``), plus the saved
activations of the microbatches in flight (GPipe: all ``m``; 1F1B: ``p - r`` on rank
``r``; interleaved: per virtual stage, :func:`pipeline.costmodel.schedules.in_flight`),
plus the gathered parameters of the stages unsharded at that point, plus the unsharded
accumulated gradients from a stage's first backward until its reduction, plus the
transient of the op running (``transient_bytes``). The peak is the largest value over
the ops; ``constraints.device_memory`` applies to every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.dtypes import itemsize
from pipeline.costmodel.comm import GroupLayout, rail_bandwidth_per_rank
from pipeline.costmodel.schedules import Op, Timeline, in_flight, rank_orders, simulate

__all__ = [
    "MAX_ACTIVE_STAGES",
    "PipelineStep",
    "StageCost",
    "boundary_bytes",
    "fsdp_state",
    "p2p_us",
    "pipelined_step",
    "rank_memory",
]

#: ``_add_unshard_reshard``'s ``max_active_stages`` default (torch 2.13): a runtime
#: schedule keeps the next 3 distinct stages of a rank's order gathered.
MAX_ACTIVE_STAGES = 3


@dataclass(frozen=True)
class StageCost:
    """One (virtual) stage on one device, per microbatch where it says so.

    Attributes:
        fwd_us, bwd_us: forward / backward time of one microbatch (compute and the
            activation redistributions of the stage's SPMD plan).
        state_bytes: sharded parameters, gradients and optimizer state.
        activation_bytes: saved activations of one microbatch.
        transient_bytes: the most the stage's ops add on top while one runs.
        unsharded_param_bytes: the stage's parameters as FSDP gathers them (0: not
            FSDP-sharded).
        unsharded_grad_bytes: the unsharded gradient in the reduce dtype, which FSDP2
            accumulates between microbatches (0: not FSDP-sharded).
        gather_us: one all-gather of the stage's parameters.
        reduce_us: the once-per-step reduction of the stage's gradients.
    """

    fwd_us: float
    bwd_us: float
    state_bytes: float = 0.0
    activation_bytes: float = 0.0
    transient_bytes: float = 0.0
    unsharded_param_bytes: float = 0.0
    unsharded_grad_bytes: float = 0.0
    gather_us: float = 0.0
    reduce_us: float = 0.0


def boundary_bytes(microbatch: int, seq_len: int, dim: int, dtype: str, shards: int = 1) -> int:
    """Bytes one device sends across a stage boundary per microbatch: the hidden state
    ``[microbatch, seq_len, dim]`` in the compute dtype, split over ``shards`` devices
    when the stage's plan shards it (sequence parallel); ``microbatch`` is the samples
    of one microbatch on one pipeline (the local batch / microbatches).

    Example: llama70b, one sample of 8192 tokens, bf16: ``8192 * 8192 * 2`` = 128 MiB.
    """
    total = int(microbatch) * int(seq_len) * int(dim) * itemsize(dtype)
    if total % int(shards):
        raise ValueError(f"shards={shards}: must divide the {total} boundary bytes")
    return total // int(shards)


def p2p_us(nbytes: float, mesh_shape: Sequence[int], pp_dim: int, boundary: int,
           hw: Any) -> float:
    """Time of one device's send of ``nbytes`` from stage ``boundary`` to stage
    ``boundary + 1`` over mesh dim ``pp_dim`` (module docstring), µs; 0 for 0 bytes."""
    if nbytes <= 0:
        return 0.0
    stride = math.prod(int(d) for d in mesh_shape[pp_dim + 1:])
    g = int(hw.gpus_per_node)
    src, dst = boundary * stride, (boundary + 1) * stride
    if src // g == dst // g:
        return float(hw.intra_node.latency_us) + nbytes / float(hw.intra_node.bandwidth) * 1e6
    bw = rail_bandwidth_per_rank(GroupLayout(2, 1, 2), hw)
    return float(hw.inter_node.latency_us) + nbytes / bw * 1e6


def _reduced_after(order: list[Op], microbatches: int) -> set[int]:
    """Indices into ``order`` of each stage's last backward (its reduction follows)."""
    seen: dict[int, int] = {}
    out = set()
    for i, op in enumerate(order):
        if op.kind == "B":
            seen[op.stage] = seen.get(op.stage, 0) + 1
            if seen[op.stage] == microbatches:
                out.add(i)
    return out


def _active_next(order: list[Op], i: int) -> list[int]:
    """The next :data:`MAX_ACTIVE_STAGES` distinct stages of ``order[i:]``."""
    out: list[int] = []
    for op in order[i:]:
        if op.stage not in out:
            out.append(op.stage)
            if len(out) == MAX_ACTIVE_STAGES:
                break
    return out


def fsdp_state(order: list[Op], reshard_after_forward: bool,
               runtime: bool) -> tuple[dict[int, int], list[set[int]]]:
    """Replay FSDP2's gather / reshard rules over one rank's order (module docstring).

    Args:
        order: the rank's ops.
        reshard_after_forward: FSDP2's ``reshard_after_forward``.
        runtime: the schedule issues ``UNSHARD`` / ``RESHARD`` itself
            (``interleaved_1f1b``).

    Returns:
        ``(gathers, unsharded)``: all-gathers per stage in one step, and for each op the
        stages gathered while it runs.

    Examples (one stage, ``m`` microbatches): GPipe with ``reshard_after_forward``
    gathers ``m + 1`` times (each forward, then the first backward), without once.
    """
    gathers = {op.stage: 0 for op in order}
    live: set[int] = set()
    during: list[set[int]] = []
    for i, op in enumerate(order):
        if runtime:
            wanted = _active_next(order, i)
            live -= {s for s in live if s not in wanted}
            for s in wanted:
                if s not in live:
                    live.add(s)
                    gathers[s] += 1
        if op.stage not in live:
            live.add(op.stage)
            gathers[op.stage] += 1
        during.append(set(live))
        if op.kind == "F" and reshard_after_forward:
            live.discard(op.stage)
    return gathers, during


def rank_memory(order: list[Op], stages: Sequence[StageCost], during: list[set[int]],
                microbatches: int) -> float:
    """The peak bytes of one rank over its order (module docstring)."""
    mine = sorted({op.stage for op in order})
    base = sum(stages[s].state_bytes for s in mine)
    acts = 0.0
    grads: set[int] = set()
    last = _reduced_after(order, microbatches)
    peak = 0.0
    for i, op in enumerate(order):
        st = stages[op.stage]
        if op.kind == "F":
            acts += st.activation_bytes
        else:
            grads.add(op.stage)
        now = (base + acts + st.transient_bytes
               + sum(stages[s].unsharded_param_bytes for s in during[i])
               + sum(stages[s].unsharded_grad_bytes for s in grads))
        peak = max(peak, now)
        if op.kind == "B":
            acts -= st.activation_bytes
        if i in last:
            grads.discard(op.stage)
    return peak


@dataclass
class PipelineStep:
    """A pipelined step (:func:`pipelined_step`).

    Attributes:
        schedule, ranks, microbatches, virtual_stages: what ran.
        timeline: the simulated schedule (:class:`~pipeline.costmodel.schedules.Timeline`).
        peak_bytes: each rank's memory peak.
        in_flight: each rank's most microbatches of saved activations at once, counted
            per virtual stage.
        gathers: FSDP all-gathers per stage in one step.
        gather_us: each rank's all-gather time in one step (the first is exposed, the
            rest overlap its compute when they fit).
        reduce_us: each rank's gradient reduction time, once per step (exposed).
    """

    schedule: str
    ranks: int
    microbatches: int
    virtual_stages: int
    timeline: Timeline = field(repr=False)
    peak_bytes: list[float]
    in_flight: list[int]
    gathers: dict[int, int]
    gather_us: list[float]
    reduce_us: list[float]

    @property
    def step_us(self) -> float:
        return self.timeline.step_us

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble_fraction

    @property
    def max_peak_bytes(self) -> float:
        return max(self.peak_bytes)


def pipelined_step(schedule: str, stages: Sequence[StageCost], ranks: int, microbatches: int,
                   *, virtual_stages: int = 1, act_send_us: float | Sequence[float] = 0.0,
                   grad_send_us: float | Sequence[float] | None = None,
                   reshard_after_forward: bool = False) -> PipelineStep:
    """Simulate one step of ``schedule`` over ``stages`` (``ranks * virtual_stages`` of
    them, stage ``s`` on rank ``s % ranks``) with ``microbatches`` microbatches.

    ``act_send_us`` / ``grad_send_us``: the boundary sends (:func:`p2p_us`; the gradient
    has the activation's shape, so ``None`` means the same times). Each rank starts after
    its first stage's all-gather and waits for each stage's reduction after that stage's
    last backward.

    Raises:
        ValueError: a schedule torch refuses, or a wrong number of stages.
    """
    n = ranks * virtual_stages
    if len(stages) != n:
        raise ValueError(f"stages: need {n} (ranks {ranks} x virtual_stages "
                         f"{virtual_stages}), got {len(stages)}")
    orders = rank_orders(schedule, ranks, microbatches, virtual_stages)
    runtime = schedule == "interleaved_1f1b"
    hold: dict[Op, float] = {}
    gathers: dict[int, int] = {}
    peaks, flights, gather_us, reduce_us, starts = [], [], [], [], []
    for order in orders:
        counts, during = fsdp_state(order, reshard_after_forward, runtime)
        gathers.update(counts)
        for i in _reduced_after(order, microbatches):
            hold[order[i]] = stages[order[i].stage].reduce_us
        peaks.append(rank_memory(order, stages, during, microbatches))
        flights.append(int(in_flight(order)))
        gather_us.append(sum(stages[s].gather_us * c for s, c in counts.items()))
        reduce_us.append(sum(stages[s].reduce_us for s in counts))
        starts.append(stages[order[0].stage].gather_us)
    timeline = simulate(orders, [s.fwd_us for s in stages], [s.bwd_us for s in stages],
                        act_send_us=act_send_us,
                        grad_send_us=act_send_us if grad_send_us is None else grad_send_us,
                        start_us=starts, hold_us=hold)
    return PipelineStep(schedule, ranks, microbatches, virtual_stages, timeline, peaks,
                        flights, {s: gathers[s] for s in sorted(gathers)}, gather_us,
                        reduce_us)
