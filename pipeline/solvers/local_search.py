"""Deterministic local search that polishes a labelling of the pairwise MRF.

Two moves, both exact given the rest of the labelling, applied in a fixed
order so that the result is deterministic:

* ICM (iterated conditional modes, Besag 1986): visit the groups in the
  compiled order (increasing group index unless a TRW-S order is reused) and
  set ``x_s = argmin_x theta_s(x) + sum_{t in N(s)} theta_st(x, x_t)``; a label
  changes only on a strict improvement, so the energy never increases and the
  sweep terminates.
* Pairwise (edge) move, used when an ICM sweep changes nothing: for every edge
  ``(u, v)`` in edge order, jointly re-choose ``(x_u, x_v)`` given all other
  labels. In class form this is ``min_{i,j} a_u(i) + a_v(j) + T[i, j]`` with
  ``a_u(i) = min_{x: row_cls(x)=i} (theta_u(x) + sum_{t != v} theta_ut(x, x_t))``
  (and likewise ``a_v``), an ``R x C`` problem. It escapes the local minima of
  ICM where a forbidden pair (``+inf``) blocks every single-group change.

Linear constraints are ignored (as in TRW-S).
"""

from __future__ import annotations

import numpy as np

from pipeline.solvers.batches import conditional_sweep
from pipeline.solvers.compiled import CompiledMRF
from pipeline.solvers.mrf import MRF

_INF = np.inf


def _improves(current: float, new: float, rtol: float) -> bool:
    """True if ``new`` beats ``current`` by more than ``rtol * max(1, |new|)``."""
    if new == _INF:
        return False
    if current == _INF:
        return True
    return current - new > rtol * max(1.0, abs(new))


def _cost_without(cm: CompiledMRF, buf: np.ndarray, labels: np.ndarray, s: int, j: int):
    """Cost of every label of ``s`` given its neighbours, leaving out incident edge ``j``."""
    vals = cm.local_costs(buf, labels, s)
    if vals.shape[1] == 1:
        return cm.unary[s].copy()
    return np.delete(vals, j, axis=1).sum(axis=1) + cm.unary[s]


def pairwise_sweep(
    cm: CompiledMRF, buf: np.ndarray, labels: np.ndarray, rtol: float = 1e-12
) -> int:
    """Apply the best joint move on every edge in edge order; return #edges moved.

    ``labels`` (int64 ``[G]``) is updated in place. A move is taken only if it
    lowers the energy by more than ``rtol * max(1, |new|)``.
    """
    moved = 0
    for e in range(cm.num_edges):
        u, v = int(cm.edges[e, 0]), int(cm.edges[e, 1])
        au = _cost_without(cm, buf, labels, u, int(cm.pos_u[e]))
        av = _cost_without(cm, buf, labels, v, int(cm.pos_v[e]))
        rc, cc, t = cm.rcls[e], cm.ccls[e], cm.tables[e]
        hu = np.full(t.shape[0], _INF)
        np.minimum.at(hu, rc, au)
        hv = np.full(t.shape[1], _INF)
        np.minimum.at(hv, cc, av)
        total = (hu[:, None] + t) + hv[None, :]
        k = int(np.argmin(total))
        i, jc = divmod(k, t.shape[1])
        xu, xv = int(labels[u]), int(labels[v])
        current = float(au[xu] + av[xv] + t[rc[xu], cc[xv]])
        if _improves(current, float(total[i, jc]), rtol):
            labels[u] = int(np.argmin(np.where(rc == i, au, _INF)))
            labels[v] = int(np.argmin(np.where(cc == jc, av, _INF)))
            moved += 1
    return moved


def coordinate_descent(
    mrf: MRF,
    labels: np.ndarray,
    max_rounds: int = 50,
    *,
    pairwise: bool = True,
    compiled: CompiledMRF | None = None,
    buf: np.ndarray | None = None,
) -> np.ndarray:
    """Polish ``labels`` by ICM sweeps, plus edge moves when ICM is stuck.

    One round is one ICM sweep over all groups; when it changes nothing, a
    pairwise sweep over all edges runs in the same round, and the search stops
    when that moves nothing either (a local minimum for both moves) or after
    ``max_rounds`` rounds. The energy never increases.

    Args:
        mrf: the problem.
        labels: int64-compatible ``[G]`` starting labelling (not modified).
        max_rounds: cap on rounds (0 returns a copy of ``labels``).
        pairwise: enable the edge move.
        compiled, buf: reuse an existing :class:`CompiledMRF` and its buffer
            (the TRW-S solver passes its own; only the table part is read).
            Groups are visited in the compiled order (group order by default).

    Returns:
        int64 ``[G]`` labelling with ``E(result) <= E(labels)``.

    Raises:
        ValueError: ``labels`` has the wrong shape or a label out of range.
    """
    cm = compiled if compiled is not None else CompiledMRF(mrf)
    ext = np.array(labels, dtype=np.int64).reshape(-1)
    if ext.shape != (cm.num_groups,):
        raise ValueError(f"labels has shape {ext.shape}, expected ({cm.num_groups},)")
    out = cm.to_internal(ext)
    if out.size and (out.min() < 0 or (out >= cm.sizes).any()):
        raise ValueError("labels contains a label outside its group's domain")
    if buf is None:
        buf = cm.new_buffer()
    # Isolated groups: their exact minimum, once.
    out[cm.isolated] = cm.isolated_labels()
    for _ in range(max_rounds):
        if conditional_sweep(cm, buf, out, cm.icm_batches, improve_only=True):
            continue
        if not pairwise or pairwise_sweep(cm, buf, out) == 0:
            break
    return cm.to_external(out)
