r"""Exact label pruning (reduced-cost fixing) from a dual reparametrisation.

Used before the ILP / LP (pipeline/solvers/ilp/): it removes labels that
provably belong to no labelling as good as a known one, so the integer program
shrinks (llama1b on a 2x4x8 mesh: 5.5 M -> < 1 M class-pair variables) while
its optimum stays the optimum of the problem as posed.

Reparametrisation
-----------------
For the MRF of :mod:`pipeline.solvers.mrf`,
``E(x) = const + sum_s theta_s(x_s) + sum_e theta_e(x_u, x_v)`` with the edge
terms in class form ``theta_e(k, l) = T_e[r_e(k), c_e(l)]``. For any *finite*
vectors ``a_e`` (over the row classes of ``e``) and ``b_e`` (over its column
classes) the functions::

    theta'_u(k)   = theta_u(k) + sum_{e = (u, .)} a_e[r_e(k)] + ...
    theta'_v(l)   = theta_v(l) + sum_{e = (., v)} b_e[c_e(l)] + ...
    T'_e[i, j]    = T_e[i, j] - a_e[i] - b_e[j]

define the same energy for every ``x`` (the added and subtracted terms cancel
label by label): a *reparametrisation* (Wainwright & Jordan 2008, §8.4;
Werner 2007, PAMI 29(7), §2). TRW-S messages are such vectors
(pipeline/solvers/trws.py: the message into ``v`` lives in the class space of
``v``); entries that are ``+inf`` (dead classes) are replaced by 0, which keeps
every vector finite and the identity exact.

Edge normalisation. Then each edge's row minima ``min_j T'_e[i, j]`` are moved
into ``theta'_u`` and the column minima of the result into ``theta'_v``
(again a reparametrisation). Afterwards ``T''_e >= 0`` entrywise (a value
minus a minimum of values it belongs to is ``>= 0`` in IEEE arithmetic too),
a row that is ``+inf`` everywhere moves ``+inf`` onto the labels of that class
(each such label is incompatible with every label of the neighbour, so no
finite labelling uses it), and therefore for every ``x``::

    E(x) = const + sum_s theta''_s(x_s) + sum_e T''_e(...) >= const + sum_s theta''_s(x_s)

Label bounds. With ``S = const + sum_s min theta''_s``, every ``x`` with
``x_g = k`` has::

    E(x) >= S + theta''_g(k) - min theta''_g                       (*)

and, keeping the (non-negative) edge terms at ``g`` instead of dropping them
(each neighbour ``h`` of ``g`` appears in exactly one of them, since an MRF has
at most one edge per pair)::

    E(x) >= S + theta''_g(k) - min theta''_g
              + sum_{h in N(g)} [ min_l (theta''_h(l) + T''_gh(k, l)) - min theta''_h ]
         =: LB(g, k)                                                (**)

Each bracket is ``>= 0``, so (**) is at least (*); on a single edge it is the
exact min-marginal.

Reduced-cost fixing. If a labelling ``x*`` satisfying every constraint has
energy ``U``, a label with ``LB(g, k) > U`` is in no labelling of energy
``<= U``, in particular in no optimal one, and can be removed: the optimum of
the reduced problem equals the optimum of the full problem, and ``x*``
survives (each of its labels has ``LB <= E(x*) = U``). Any lower bound of the
reduced problem is one of the full problem (the removed labellings cost more
than ``U >= OPT``). This is the MAP analogue of reduced-cost fixing in integer
programming (Nemhauser & Wolsey 1988, "Integer and Combinatorial
Optimization", §II.4.2, fixing by reduced costs against an incumbent).

Linear rows. For rows ``L_i <= g_i(x) <= H_i`` handled by Lagrangian
relaxation with signed multipliers ``mu_i`` (pipeline/solvers/lagrangian.py),
bounds (*) of the penalised energy ``E + sum_i mu_i g_i`` hold for every ``x``,
so for every *feasible* ``x``: ``E(x) >= LB_pen(g, k) - sum_i mu_i T_i`` with
``T_i = H_i`` for ``mu_i > 0`` (upper side) and ``L_i`` for ``mu_i < 0``
(lower side). The maximum of valid bounds is valid, so bounds from several
multiplier vectors are combined entrywise.

A tolerance ``tol = PRUNE_RTOL * max(1, |U|)`` is added to ``U`` before
comparing: it absorbs the floating-point error of the sums (labels within it
are kept, which can only keep more).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipeline.solvers.mrf import MRF

__all__ = ["PRUNE_RTOL", "PruneStats", "label_bounds", "prune"]

PRUNE_RTOL = 1e-7
"""Relative tolerance added to the incumbent energy before pruning."""


def label_bounds(
    unary: list[np.ndarray],
    edges: np.ndarray,
    rcls: list[np.ndarray],
    ccls: list[np.ndarray],
    tables: list[np.ndarray],
    row_msgs: list[np.ndarray],
    col_msgs: list[np.ndarray],
    constant: float,
) -> list[np.ndarray]:
    """Bounds (**) of the module docstring from one set of reparametrisation vectors.

    Args:
        unary: per group float64 ``[K_g]`` (µs, ``+inf`` forbidden).
        edges: int ``[E, 2]`` (u, v) per edge.
        rcls, ccls: per edge int ``[K_u]`` / ``[K_v]`` label -> class.
        tables: per edge float64 ``[R_e, C_e]`` class table (µs, ``+inf`` forbidden).
        row_msgs: per edge ``a_e`` float ``[R_e]`` (added to ``u``, e.g. the TRW-S
            message into ``u``); non-finite entries are taken as 0.
        col_msgs: per edge ``b_e`` float ``[C_e]`` (added to ``v``); likewise.
        constant: the MRF's constant (µs).

    Returns:
        per group float64 ``[K_g]``: ``LB(g, k)`` in µs (``+inf`` for labels in no
        finite labelling).
    """
    theta = [np.asarray(u, dtype=np.float64).copy() for u in unary]
    tables_n: list[np.ndarray] = []
    for e in range(len(tables)):
        u, v = int(edges[e][0]), int(edges[e][1])
        a = np.where(np.isfinite(row_msgs[e]), row_msgs[e], 0.0)
        b = np.where(np.isfinite(col_msgs[e]), col_msgs[e], 0.0)
        t = np.asarray(tables[e], dtype=np.float64) - a[:, None] - b[None, :]
        theta[u] += a[rcls[e]]
        theta[v] += b[ccls[e]]
        if t.size == 0:
            tables_n.append(t)
            continue
        rmin = t.min(axis=1)
        theta[u] += rmin[rcls[e]]  # +inf where a row class is incompatible with all
        t = t - np.where(np.isfinite(rmin), rmin, 0.0)[:, None]
        cmin = t.min(axis=0)
        theta[v] += cmin[ccls[e]]
        tables_n.append(t - np.where(np.isfinite(cmin), cmin, 0.0)[None, :])
    mins = np.array([th.min() if th.size else 0.0 for th in theta])
    total = float(constant) + float(mins.sum())
    bounds = [total + (th - m) for th, m in zip(theta, mins)]
    # Star terms (**): what each neighbour adds given the label of g.
    for e, t in enumerate(tables_n):
        if t.size == 0:
            continue
        u, v = int(edges[e][0]), int(edges[e][1])
        # neighbour v seen from u: min_j T''[i, j] + min_{c(l)=j} theta''_v(l) - min theta''_v
        hv = _class_min(theta[v] - mins[v], ccls[e], t.shape[1])
        bounds[u] += np.nan_to_num(np.min(t + hv[None, :], axis=1), nan=np.inf)[rcls[e]]
        hu = _class_min(theta[u] - mins[u], rcls[e], t.shape[0])
        bounds[v] += np.nan_to_num(np.min(t + hu[:, None], axis=0), nan=np.inf)[ccls[e]]
    return bounds


def _class_min(values: np.ndarray, cls: np.ndarray, n: int) -> np.ndarray:
    """``out[j] = min {values[l] : cls[l] = j}`` (``+inf`` for an unused class)."""
    out = np.full(n, np.inf)
    np.minimum.at(out, cls, values)
    return out


@dataclass(frozen=True)
class PruneStats:
    """What :func:`prune` removed.

    Attributes:
        labels_before: allowed (finite-unary) labels before pruning.
        labels_after: allowed labels after pruning.
        upper_bound: the incumbent energy ``U`` (µs).
        tolerance: the tolerance added to ``U`` (µs).
    """

    labels_before: int
    labels_after: int
    upper_bound: float
    tolerance: float


def prune(mrf: MRF, bounds: list[np.ndarray], upper_bound: float,
          rtol: float = PRUNE_RTOL) -> tuple[MRF, PruneStats]:
    """Remove (unary ``+inf``) every label whose bound exceeds ``upper_bound``.

    Args:
        mrf: the problem (linear constraints are kept as they are).
        bounds: per group ``LB(g, k)`` valid for every feasible labelling.
        upper_bound: ``E(x*)`` of a labelling ``x*`` satisfying every constraint.
        rtol: relative tolerance (:data:`PRUNE_RTOL`).

    Returns:
        ``(reduced MRF, stats)``; the reduced MRF has the same groups, labels,
        factors and constraints, and the same optimum (module docstring).

    Raises:
        ValueError: ``bounds`` do not match the domains or ``upper_bound`` is
            not finite.
    """
    if not np.isfinite(upper_bound):
        raise ValueError(f"upper_bound must be finite, got {upper_bound}")
    if len(bounds) != mrf.num_groups:
        raise ValueError(f"{len(bounds)} bound vectors for {mrf.num_groups} groups")
    tol = rtol * max(1.0, abs(float(upper_bound)))
    unary, before, after = [], 0, 0
    for g, (u, lb) in enumerate(zip(mrf.unary, bounds)):
        u = np.asarray(u, dtype=np.float64)
        lb = np.asarray(lb, dtype=np.float64)
        if lb.shape != u.shape:
            raise ValueError(f"bounds[{g}] has shape {lb.shape}, unary {u.shape}")
        ok = np.isfinite(u)
        keep = ok & (lb <= upper_bound + tol)
        before += int(ok.sum())
        after += int(keep.sum())
        unary.append(np.where(keep, u, np.inf))
    return replace(mrf, unary=unary), PruneStats(before, after, float(upper_bound), tol)
