"""The split of the repeated layers into pipeline stages: an exact dynamic program over
layer boundaries (the inter-operator pass of Alpa, Zheng et al. 2022, "Alpa: Automating
Inter- and Intra-Operator Parallelism for Distributed Deep Learning", OSDI'22, Section 5).

Stages are contiguous: stage ``s`` of ``S`` holds ``n_s >= 1`` layers, ``sum n_s = L``;
the first also holds the embedding, the last the final norm, head and loss, so a stage's
time per microbatch (forward + backward), ``t(n, first, last)``, depends on its layer
count and on whether it is first or last (the stage plans of distinct shapes, solved
once each). The objective is Alpa's pipeline latency (Section 5.1, for a synchronous
GPipe / 1F1B pipeline of ``m`` microbatches)::

    T = sum_s t_s + (m - 1) max_s t_s

(the first microbatch passes every stage once, the other ``m - 1`` follow at the pace of
the slowest stage; with equal stages ``(m + p - 1) t``, the closed form of
:mod:`pipeline.costmodel.schedules`). Each stage must fit its memory, ``fits(s, n)`` (the
caller knows its in-flight microbatches: ``p - s`` under 1F1B).

Exact minimisation (:func:`best_split`): for each candidate bound ``B`` on ``max t_s``
(every distinct value ``t(n, first, last)`` takes), a dynamic program gives the least
``sum t_s`` over splits whose stages all take at most ``B`` and fit:
``D[s][k] = min_n D[s-1][k-n] + t_s(n)`` over ``n`` with ``t_s(n) <= B``; the best ``T``
over the bounds is the optimum, since the optimal split's own maximum is one of the
candidates and its sum is at least that bound's DP value. ``O(C S L^2)`` for ``C <= 3 L``
bounds, vectorised over ``k`` with numpy; the bounds are tried in increasing order and the
search stops at the first ``B`` with ``(least sum of any split) + (m - 1) B`` no better
than the best found (every later split has a maximum of at least ``B``). Ties are broken
deterministically, not towards balance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Split", "best_split", "pipeline_latency"]


@dataclass(frozen=True)
class Split:
    """The best split: ``boundaries`` ``[0, b1, ..., L]``, each stage's time ``times`` and
    the objective ``latency_us`` (:func:`pipeline_latency`)."""

    boundaries: tuple[int, ...]
    times: tuple[float, ...]
    latency_us: float


def pipeline_latency(times: list[float] | tuple[float, ...], microbatches: int) -> float:
    """``sum t_s + (m - 1) max t_s`` (module docstring)."""
    return float(sum(times)) + (int(microbatches) - 1) * float(max(times))


def best_split(n_layers: int, stages: int, microbatches: int,
               stage_time: Callable[[int, bool, bool], float],
               fits: Callable[[int, int], bool] | None = None) -> Split | None:
    """The split of ``n_layers`` into ``stages`` contiguous stages minimising the pipeline
    latency (module docstring); ``None`` when no split fits.

    Args:
        stage_time: ``t(n, first, last)``, µs per microbatch, forward and backward.
        fits: ``fits(s, n)``: whether stage ``s`` with ``n`` layers fits its memory
            (``None``: every stage fits).

    Raises:
        ValueError: for ``stages`` outside ``1 .. n_layers`` or ``microbatches < 1``.
    """
    L, S, m = int(n_layers), int(stages), int(microbatches)
    if not 1 <= S <= L or m < 1:
        raise ValueError(f"stages={stages}, n_layers={n_layers}, microbatches={microbatches}: "
                         "allowed 1 <= stages <= n_layers and microbatches >= 1")
    t = np.full((S, L + 1), np.inf)  # t[s, n]: stage s with n layers (inf: not allowed)
    for s in range(S):
        for n in range(1, L - S + 2):
            if fits is None or fits(s, n):
                t[s, n] = float(stage_time(n, s == 0, s == S - 1))
    least = _least_sum(t)  # the smallest sum of any split: a lower bound on every sum
    if least is None:
        return None
    best: Split | None = None
    for bound in np.unique(t[np.isfinite(t)]):  # ascending
        if best is not None and least[0] + (m - 1) * bound >= best.latency_us:
            break  # a split whose maximum is this bound or more cannot do better
        found = _least_sum(np.where(t <= bound, t, np.inf))
        if found is None:
            continue
        sizes = found[1]
        times = tuple(float(t[s, n]) for s, n in enumerate(sizes))
        latency = pipeline_latency(times, m)
        if best is None or latency < best.latency_us:
            bounds = tuple(int(b) for b in np.concatenate([[0], np.cumsum(sizes)]))
            best = Split(bounds, times, latency)
    return best


def _least_sum(t: np.ndarray) -> tuple[float, list[int]] | None:
    """The least ``sum_s t[s, n_s]`` over splits of ``L`` layers into ``S`` stages, and the
    sizes ``n_s``; ``None`` when every split uses an ``inf`` entry."""
    S, L = t.shape[0], t.shape[1] - 1
    d = np.full(L + 1, np.inf)
    d[0] = 0.0
    choice = np.zeros((S, L + 1), dtype=np.int64)
    for s in range(S):
        nxt = np.full(L + 1, np.inf)
        for n in range(1, L + 1):
            if not np.isfinite(t[s, n]):
                continue
            cand = d[:L + 1 - n] + t[s, n]
            better = cand < nxt[n:]
            nxt[n:][better] = cand[better]
            choice[s, n:][better] = n
        d = nxt
    if not np.isfinite(d[L]):
        return None
    sizes, k = [], L
    for s in range(S - 1, -1, -1):
        sizes.append(int(choice[s, k]))
        k -= sizes[-1]
    return float(d[L]), sizes[::-1]
