"""A certified lower bound on the overlapped step time over every plan.

The simulated step (pipeline/costmodel/steptime.py) runs every kernel on one compute
stream, one at a time, and every redistribution step on the stream of one of the ``D``
mesh dims, one at a time per stream, all starting at time 0 or later. So for every plan
``x`` its makespan covers each stream's busy time:

    step(x) >= C(x)            the compute stream's busy time
    step(x) >= busy_d(x)       for each mesh dim d, hence >= M(x) / D

with ``M(x) = sum_d busy_d(x)`` the plan's total redistribution time. ``C`` and ``M``
are additive over the MRF's labels (pipeline/costmodel/reweight.py, ``StreamObjective``: the
simulated compute of a node is ``max(0, compute + fusion) >= compute + fusion``, and a
node the simulation runs no kernel for has ``compute + fusion <= 0``, so the additive
``C`` is at most the busy time). For every ``theta`` in ``[0, 1]``::

    step(x) >= max(C(x), M(x) / D) >= theta * C(x) + (1 - theta) * M(x) / D

and therefore ``min_x step(x) >= g(theta) = min_x [theta C(x) + (1 - theta) M(x) / D]
>= LB(theta)``, any lower bound of that additive problem (TRW-S's dual bound, an LP or
ILP bound; the problem may drop the linear rows and forbidden pairs, a relaxation, which
only lowers ``g``). The bound reported is ``max(0, max over the thetas tried of
LB(theta))``.

Which thetas: ``g`` is concave in ``theta`` (a minimum of linear functions) with
supergradient ``C(x_theta) - M(x_theta) / D`` at a minimiser ``x_theta``. The search
starts at ``theta = 1`` (the compute stream alone); if its plan's supergradient is
``>= 0``, ``theta = 1`` maximises ``g`` and it stops; else it bisects ``[0, 1]`` on the
sign of the supergradient for ``steps`` more solves (deterministic). ``x_theta`` is the
solver's plan, not necessarily a minimiser: the choice of thetas may then be
suboptimal, the bound stays valid (every ``LB(theta)`` is).

It is weak where the step is neither compute- nor communication-bound (the busy
times of different streams do not add): ``step_time_gap`` says by how much.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.solvers.mrf import MRF
from pipeline.solvers.result import SolverResult

__all__ = ["StepBound", "step_lower_bound"]


@dataclass
class StepBound:
    """The bound and how it was found.

    Attributes:
        lower_bound_us: ``max(0, max LB(theta))`` (module docstring).
        theta: the theta that gave it.
        history: per solve, ``{theta, lower_bound_us, compute_us, comm_us}`` (the
            solver's plan's ``C`` and ``M``).
    """

    lower_bound_us: float
    theta: float
    history: list[dict[str, float]] = field(default_factory=list)


def step_lower_bound(build: Callable[[float, float], MRF],
                     measure: Callable[[np.ndarray], tuple[float, float]],
                     solve: Callable[[MRF], SolverResult], streams: int,
                     steps: int = 3) -> StepBound:
    """The step-time lower bound (module docstring).

    Args:
        build: ``(theta, comm_coef) -> MRF`` of ``theta * C(x) + comm_coef * M(x)``.
        measure: ``labels -> (C(x), M(x))`` of a plan.
        solve: an MRF solver whose ``lower_bound`` is valid (e.g. TRW-S).
        streams: ``D``, the communication streams (mesh dims), >= 1.
        steps: bisection solves after ``theta = 1`` when the compute stream alone
            does not maximise the bound.
    """
    if streams < 1:
        raise ValueError("step_lower_bound: streams must be >= 1")
    best = StepBound(0.0, 1.0)

    def at(theta: float) -> float:
        res = solve(build(theta, (1.0 - theta) / streams))
        lb = float(res.lower_bound)
        c, m = measure(np.asarray(res.labels, dtype=np.int64))
        best.history.append({"theta": theta, "lower_bound_us": lb, "compute_us": c,
                             "comm_us": m})
        if math.isfinite(lb) and lb > best.lower_bound_us:
            best.lower_bound_us, best.theta = lb, theta
        return c - m / streams

    if at(1.0) >= 0:
        return best
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        theta = 0.5 * (lo + hi)
        if at(theta) > 0:
            lo = theta
        else:
            hi = theta
    return best
