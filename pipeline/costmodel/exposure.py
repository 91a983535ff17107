"""Exposed shares: what part of each FSDP-class collective the overlapped step
(pipeline/costmodel/steptime.py) cannot hide, as a weight per graph edge.

The step-time objective (pipeline/stages/solve/objective.py) re-prices the additive
objective's communication with these weights: an edge's redistribution counts
``w_e * comm_e`` instead of ``comm_e``. They are evaluated on one plan (its simulation)
and held fixed for the next solve.

* **activation** edges block the compute stream (DTensor redistributes when the op is
  dispatched): ``w_e = 1``.
* **weight** edges (FSDP all-gathers) of FSDP unit ``k`` are prefetched one unit ahead:
  they are issued when the compute stream reaches unit ``k - 1`` and are hidden behind
  its kernels (the simulation's prefetch rule, FSDP2's implicit forward / explicit
  backward prefetching of one unit; sources in steptime.py). With ``G_k`` the unit's
  gather time (the sum of its weight edges' comm) and ``W_k`` the compute of unit
  ``k - 1`` (the busy time of its kernels; ``W_0 = 0``: "the 1st all-gather will not be
  able to overlap with anything", PyTorch FSDP notes), the exposed part is
  ``max(0, G_k - W_k)`` and every weight edge of the unit gets the exposed share

      w_k = max(0, G_k - W_k) / G_k        (G_k > 0)
      w_k = 1 if W_k == 0 else 0            (G_k == 0: the limit of the share)

  so that ``sum_e w_e comm_e = max(0, G_k - W_k)`` on the plan it was evaluated on.
  Worked example (tests/unit/test_exposure.py): a 30 µs gather behind a 20 µs unit is
  exposed by 10 µs, ``w = 1/3``.
* **gradient** edges (reduce-scatters / all-reduces of gradients) are issued when
  their producer ends (time ``t_e`` in the simulation) and overlap the rest of the
  backward: the compute stream's busy time after ``t_e``, ``B(t_e)``. Taken in issue
  order (FIFO), the reductions from the ``i``-th on need ``S_i = sum_{j >= i} R_j`` of
  stream time and have ``B(t_i)`` of compute to hide behind; the tail exposed is
  ``X = max_i (S_i - B(t_i))``. With ``i*`` the (last) index of that maximum and
  ``X > 0``, the edges from ``i*`` on share it, ``w = X / S_{i*}``, the earlier ones
  get 0 (hidden); ``X <= 0``: all 0. A gradient edge without comm at this plan gets the
  share of the suffix it falls in (``t_e >= t_{i*}``), else 1 if ``B(t_e) = 0``, else 0.

These are estimates (the streams of different mesh dims are pooled, the weight gathers
and gradient reductions that share a stream in the backward are not queued together):
the simulation, not this formula, judges every plan the search returns.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from pipeline.costmodel.steptime import StepInputs, StepTime, classify

__all__ = ["exposed_shares", "unit_share"]


def unit_share(gather_us: float, window_us: float) -> float:
    """The exposed share of one unit's gather ``G`` behind a window ``W`` (module
    docstring): ``max(0, G - W) / G``; for ``G == 0``, 1 if ``W == 0`` else 0."""
    if gather_us > 0:
        return max(0.0, gather_us - window_us) / gather_us
    return 1.0 if window_us <= 0 else 0.0


def exposed_shares(g: StepInputs, sim: StepTime) -> np.ndarray:
    """``w_e`` per edge of ``g`` (float64 ``[E]`` in ``[0, 1]``), evaluated on the plan
    ``g`` and its simulation ``sim`` (:func:`pipeline.costmodel.steptime.simulate`)."""
    cls = classify(g)
    n_edges = len(g.edges)
    comm = [math.fsum(us for _, us in s) for s in g.steps]
    w = np.ones(n_edges)
    # ---- weight edges: per unit, the gather behind the previous unit's compute
    unit_compute: dict[int, float] = {}
    for v, u in enumerate(cls.unit):
        if u is not None and cls.kernel[v]:
            unit_compute[u] = unit_compute.get(u, 0.0) + g.compute_us[v]
    gather: dict[int, float] = {}
    for e, (_, v) in enumerate(g.edges):
        if cls.edge_kind[e] == "weight" and cls.unit[v] is not None:
            gather[cls.unit[v]] = gather.get(cls.unit[v], 0.0) + comm[e]
    for e, (_, v) in enumerate(g.edges):
        if cls.edge_kind[e] == "weight" and cls.unit[v] is not None:
            k = cls.unit[v]
            w[e] = unit_share(gather[k], unit_compute.get(k - 1, 0.0) if k > 0 else 0.0)
    # ---- gradient edges: the FIFO tail behind the rest of the backward
    grads = [e for e in range(n_edges) if cls.edge_kind[e] == "gradient"]
    if not grads:
        return w
    kernels = sorted((sim.node_start_us[v], sim.node_end_us[v])
                     for v in range(len(g.names)) if cls.kernel[v])
    starts = [s for s, _ in kernels]
    after = [0.0] * (len(kernels) + 1)  # after[i]: busy time of kernels i, i + 1, ...
    for i in range(len(kernels) - 1, -1, -1):
        after[i] = after[i + 1] + (kernels[i][1] - kernels[i][0])

    def busy_after(t: float) -> float:
        """Compute-stream busy time after ``t`` (kernels run one at a time)."""
        i = bisect.bisect_left(starts, t)
        total = after[i]
        if i > 0:  # the kernel running at t, if any
            s, e = kernels[i - 1]
            total += max(0.0, e - max(s, t))
        return total

    issue = {e: sim.node_end_us[g.edges[e][0]] for e in grads}
    timed = sorted((issue[e], e) for e in grads if comm[e] > 0)
    best, best_i, suffix = -math.inf, -1, 0.0
    tails = []
    for _, e in reversed(timed):
        suffix += comm[e]
        tails.append(suffix)
    tails.reverse()
    for i, (t, _) in enumerate(timed):
        x = tails[i] - busy_after(t)
        if x >= best:
            best, best_i = x, i
    exposed = best_i >= 0 and best > 0
    share = best / tails[best_i] if exposed else 0.0
    cut = timed[best_i][0] if exposed else math.inf
    binding = {e for _, e in timed[best_i:]} if exposed else set()
    for e in grads:
        if comm[e] > 0:
            w[e] = share if e in binding else 0.0
        elif issue[e] >= cut:
            w[e] = share
        else:
            w[e] = 1.0 if busy_after(issue[e]) <= 0 else 0.0
    return w
