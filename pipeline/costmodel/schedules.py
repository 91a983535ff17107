"""Pipeline schedules: each rank's order of forward and backward ops, a discrete-event
simulation of that order, and the closed forms the simulation is tested against.

Torch-free (no numpy either). The names are those of ``torch.distributed.pipelining``'s
schedule classes (torch 2.13, ``torch/distributed/pipelining/schedules.py``):

==================  ===========================  =========================================
name                torch class                  order of rank ``r`` (``p`` ranks, ``m``
                                                 microbatches)
==================  ===========================  =========================================
``gpipe``           ``ScheduleGPipe``            ``F0 .. F(m-1)``, then ``B0 .. B(m-1)``
                                                 (Huang et al. 2019, "GPipe")
``1f1b``            ``Schedule1F1B``             ``w = min(m, p-1-r)`` forwards, then
                                                 ``m - w`` pairs ``F B``, then ``w``
                                                 backwards (PipeDream-Flush, Narayanan et
                                                 al. 2021, Fig. 4 top; torch warms up
                                                 ``p - r`` forwards and then runs ``B F``
                                                 pairs: the same sequence)
``interleaved_1f1b``  ``ScheduleInterleaved1F1B``  ``v`` virtual stages per rank, stage
                                                 ``r + k p`` for ``k < v`` (torch's
                                                 "loop" placement); see below
==================  ===========================  =========================================

Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", SC'21, Section 2.2.2, Fig. 4 bottom), as torch's
``ScheduleInterleaved1F1B._calculate_single_rank_operations`` orders it: with
``rounds = max(1, m // p)`` and ``mpr = m // rounds`` microbatches per round (torch
requires ``m % rounds == 0``), rank ``r`` runs ``w = min((v-1) mpr + 2 (p-1-r), v m)``
warm-up forwards, then ``v m - w`` pairs ``F B``, then ``w`` backwards. Its ``k``-th
forward runs local stage ``(k // mpr) % v`` and its ``k``-th backward local stage
``v - 1 - (k // mpr) % v``; on each stage the microbatches run in order 0, 1, ...

Simulation (:func:`simulate`): each rank is one compute stream that runs its ops in
order; op ``F(s, i)`` (forward of stage ``s`` on microbatch ``i``) starts when its rank
is free and ``F(s-1, i)`` has ended plus the send of the boundary activation;
``B(s, i)`` when ``B(s+1, i)`` has ended plus the send of the boundary gradient (the
last stage's ``B(S-1, i)`` after ``F(S-1, i)``, the loss being part of the last stage's
forward). A send between stages on one rank (``p = 1``) is free. Sends run on their own
stream (torch posts them with ``batch_isend_irecv`` and the receiver waits), so only
their latency on the critical path is paid. Each rank may start with a delay (its
first, not overlapped, FSDP all-gather), and stays held after a stage's last backward
while its once-per-step gradient reduction runs; the step time is the last rank's end.

Closed forms (equal stages, forward ``f`` and backward ``b`` per microbatch on a rank's
whole share of the model, no communication): GPipe and 1F1B take ``(m + p - 1)(f + b)``,
so the bubble, the idle share of the ranks' time, is ``(p - 1) / (m + p - 1)``
(Narayanan et al. 2021, Section 2.2.1: bubble time ``(p-1)(f+b)``, ideal time
``m (f+b)``, bubble-time fraction ``(p-1)/m`` of the ideal time, hence ``(p-1)/(m+p-1)``
of the step). Interleaved with ``v`` virtual stages of ``f/v`` and ``b/v`` and
``m % p == 0``: bubble time ``(p-1)(f+b)/v`` (Section 2.2.2: the bubble "reduces by a
factor of v"), so the step is ``m (f+b) + (p-1)(f+b)/v`` and the bubble
``(p - 1) / (v m + p - 1)`` of it. :func:`closed_form_bubble` gives these; the tests
check the simulation against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "SCHEDULES",
    "TORCH_CLASSES",
    "Op",
    "Timeline",
    "check_schedule",
    "closed_form_bubble",
    "closed_form_step_us",
    "in_flight",
    "rank_of_stage",
    "rank_orders",
    "simulate",
]

#: The schedules, by the name ``pipeline.schedule`` takes.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")

#: The ``torch.distributed.pipelining`` class of each schedule.
TORCH_CLASSES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}


@dataclass(frozen=True)
class Op:
    """One op of a schedule: ``kind`` ``"F"`` (forward) or ``"B"`` (full backward) of
    virtual stage ``stage`` on microbatch ``microbatch``."""

    kind: str
    stage: int
    microbatch: int


def check_schedule(schedule: str, p: int, m: int, v: int = 1) -> None:
    """Refuse what torch's schedule classes refuse, and what this model does not run.

    * ``schedule`` one of :data:`SCHEDULES`; ``p, m, v >= 1``;
    * ``1f1b``: ``m >= p`` (``Schedule1F1B``: "Number of microbatches must be >= number
      of stages");
    * ``interleaved_1f1b``: ``v >= 2``, ``m >= p`` and ``m % max(1, m // p) == 0``
      (``ScheduleInterleaved1F1B``: microbatches a multiple of the number of rounds);
    * ``gpipe`` and ``1f1b``: ``v == 1`` (one stage per rank).

    Raises:
        ValueError: one line naming the value and what is allowed.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule}: allowed {', '.join(SCHEDULES)}")
    for name, val in (("stages", p), ("microbatches", m), ("virtual_stages", v)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name}={val}: allowed an integer >= 1")
    if schedule != "interleaved_1f1b" and v != 1:
        raise ValueError(f"virtual_stages={v}: {schedule} runs one stage per rank; allowed 1 "
                         "(interleaved_1f1b for more)")
    if schedule == "interleaved_1f1b" and v < 2:
        raise ValueError(f"virtual_stages={v}: interleaved_1f1b needs at least 2 stages per "
                         "rank; allowed an integer >= 2 (1f1b for one)")
    if schedule in ("1f1b", "interleaved_1f1b") and m < p:
        raise ValueError(f"microbatches={m}: {schedule} needs at least as many microbatches "
                         f"as pipeline ranks ({p})")
    if schedule == "interleaved_1f1b" and m % max(1, m // p):
        raise ValueError(f"microbatches={m}: interleaved_1f1b needs a multiple of its "
                         f"{m // p} rounds (max(1, microbatches // {p}))")


def rank_of_stage(stage: int, p: int) -> int:
    """The rank holding virtual stage ``stage``: ``stage % p`` (torch's loop placement)."""
    return stage % p


def _single_order(schedule: str, r: int, p: int, m: int) -> list[Op]:
    if schedule == "gpipe":
        return [Op("F", r, i) for i in range(m)] + [Op("B", r, i) for i in range(m)]
    w = min(m, p - 1 - r)
    ops = [Op("F", r, i) for i in range(w)]
    for i in range(m - w):
        ops += [Op("F", r, w + i), Op("B", r, i)]
    return ops + [Op("B", r, m - w + i) for i in range(w)]


def _interleaved_order(r: int, p: int, m: int, v: int) -> list[Op]:
    mpr = m // max(1, m // p)
    warmup = min((v - 1) * mpr + 2 * (p - 1 - r), v * m)
    next_mb = {"F": [0] * v, "B": [0] * v}
    count = {"F": 0, "B": 0}

    def take(kind: str) -> Op:
        k = count[kind]
        local = (k // mpr) % v
        if kind == "B":
            local = v - 1 - local
        count[kind] += 1
        mb = next_mb[kind][local]
        next_mb[kind][local] += 1
        return Op(kind, r + local * p, mb)

    ops = [take("F") for _ in range(warmup)]
    for _ in range(v * m - warmup):
        ops += [take("F"), take("B")]
    return ops + [take("B") for _ in range(warmup)]


def rank_orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """Each rank's ops in the order it runs them (module docstring).

    Example: ``rank_orders("1f1b", 2, 3)[0]`` is ``F0 F1 B0 F2 B1 B2`` of stage 0.

    Raises:
        ValueError: as :func:`check_schedule`.
    """
    check_schedule(schedule, p, m, v)
    if schedule == "interleaved_1f1b":
        return [_interleaved_order(r, p, m, v) for r in range(p)]
    return [_single_order(schedule, r, p, m) for r in range(p)]


@dataclass
class Timeline:
    """The simulated step of a schedule.

    Attributes:
        step_us: the step time: the last rank's end.
        busy_us: each rank's compute time (its ops' durations).
        end_us: each rank's end (its last op, and what holds it after).
        spans: ``{op: (start, end)}`` of every op, µs.
        bubble_fraction: the ranks' idle share of the step,
            ``1 - sum(busy) / (p * step)``, counting the start delays and holds as idle.
    """

    step_us: float
    busy_us: list[float]
    end_us: list[float]
    spans: dict[Op, tuple[float, float]] = field(repr=False)

    @property
    def bubble_fraction(self) -> float:
        p = len(self.busy_us)
        return 1.0 - sum(self.busy_us) / (p * self.step_us) if self.step_us > 0 else 0.0


def _per_stage(values: float | Sequence[float], n: int, name: str) -> list[float]:
    out = [float(values)] * n if isinstance(values, (int, float)) else [float(x) for x in values]
    if len(out) != n or any(x < 0 for x in out):
        raise ValueError(f"{name}: need {n} values >= 0, got {values}")
    return out


def simulate(orders: list[list[Op]], fwd_us: float | Sequence[float],
             bwd_us: float | Sequence[float], *, act_send_us: float | Sequence[float] = 0.0,
             grad_send_us: float | Sequence[float] = 0.0,
             start_us: float | Sequence[float] = 0.0,
             hold_us: dict[Op, float] | None = None) -> Timeline:
    """Run the ranks' orders as a discrete-event simulation (module docstring).

    Args:
        orders: :func:`rank_orders`; ``S = p v`` stages, stage ``s`` on rank ``s % p``.
        fwd_us, bwd_us: forward / backward time of one microbatch on each stage (one
            number for all, or ``S`` numbers).
        act_send_us: time of sending stage ``s``'s output activation to stage ``s+1``
            (``S - 1`` numbers or one); ``grad_send_us``: the gradient back, likewise.
        start_us: per rank (or one), when its first op may start (its first FSDP
            all-gather, which nothing overlaps).
        hold_us: ``{op: µs}``, how long the rank stays held after ``op`` ends, not
            computing (a stage's gradient reduction after its last backward, once per
            step).

    Raises:
        ValueError: a bad length or a negative time; RuntimeError if the orders
            deadlock (a wrong order: each waits for another's op).
    """
    p = len(orders)
    n_stages = 1 + max(op.stage for order in orders for op in order)
    fwd = _per_stage(fwd_us, n_stages, "fwd_us")
    bwd = _per_stage(bwd_us, n_stages, "bwd_us")
    send_f = _per_stage(act_send_us, n_stages - 1, "act_send_us")
    send_b = _per_stage(grad_send_us, n_stages - 1, "grad_send_us")
    free = _per_stage(start_us, p, "start_us")
    hold = dict(hold_us or {})
    if any(v < 0 for v in hold.values()):
        raise ValueError(f"hold_us: need values >= 0, got {hold}")
    spans: dict[Op, tuple[float, float]] = {}
    nxt = [0] * p

    def ready(op: Op) -> float | None:
        if op.kind == "F":
            if op.stage == 0:
                return 0.0
            dep, delay = Op("F", op.stage - 1, op.microbatch), send_f[op.stage - 1]
        elif op.stage == n_stages - 1:
            dep, delay = Op("F", op.stage, op.microbatch), 0.0
        else:
            dep, delay = Op("B", op.stage + 1, op.microbatch), send_b[op.stage]
        if dep not in spans:
            return None
        same_rank = rank_of_stage(dep.stage, p) == rank_of_stage(op.stage, p)
        return spans[dep][1] + (0.0 if same_rank else delay)

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                op = orders[r][nxt[r]]
                at = ready(op)
                if at is None:
                    break
                start = max(free[r], at)
                end = start + (fwd[op.stage] if op.kind == "F" else bwd[op.stage])
                spans[op] = (start, end)
                free[r] = end + hold.get(op, 0.0)
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [orders[r][nxt[r]] for r in range(p) if nxt[r] < len(orders[r])]
            raise RuntimeError(f"schedule deadlocks: every rank waits ({stuck})")
    busy = [sum(e - s for op, (s, e) in spans.items() if rank_of_stage(op.stage, p) == r)
            for r in range(p)]
    return Timeline(step_us=max(free), busy_us=busy, end_us=list(free), spans=spans)


def in_flight(order: list[Op], weights: dict[int, float] | None = None) -> float:
    """The most microbatches a rank holds forward activations for at once: after each
    ``F`` one more, after each ``B`` one fewer (a microbatch's saved activations live
    from its forward to its backward). With ``weights`` (``{stage: bytes of one
    microbatch's saved activations}``) the largest sum of bytes instead.

    Examples: GPipe holds ``m``; 1F1B holds ``min(m, p - r)`` on rank ``r``, so ``p`` on
    the first (Narayanan et al. 2021, Section 2.2.1: "at most p" microbatches in flight).
    """
    live = peak = 0.0
    for op in order:
        w = 1.0 if weights is None else float(weights[op.stage])
        live += w if op.kind == "F" else -w
        peak = max(peak, live)
    return peak


def closed_form_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble fraction of equal stages without communication (module docstring):
    ``(p-1)/(m+p-1)`` for gpipe and 1f1b, ``(p-1)/(v m + p - 1)`` for interleaved."""
    check_schedule(schedule, p, m, v)
    return (p - 1) / ((v if schedule == "interleaved_1f1b" else 1) * m + p - 1)


def closed_form_step_us(schedule: str, p: int, m: int, f: float, b: float, v: int = 1) -> float:
    """The step time of equal stages without communication, ``f`` and ``b`` a rank's
    forward / backward of one microbatch over all its layers: ``(m + p - 1)(f + b)``;
    interleaved ``m (f + b) + (p - 1)(f + b) / v``."""
    check_schedule(schedule, p, m, v)
    if schedule == "interleaved_1f1b":
        return m * (f + b) + (p - 1) * (f + b) / v
    return (m + p - 1) * (f + b)
