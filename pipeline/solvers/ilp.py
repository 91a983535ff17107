"""Exact integer program (and its LP relaxation) for the pairwise MRF.

Model
-----
Notation from :mod:`pipeline.solvers.mrf`: groups ``g`` with unaries ``U_g``
(float64 ``[K_g]``, µs, ``+inf`` = forbidden label); edges ``e = (u, v)`` with a
factor in placement-class form ``B_e(k, l) = T_e[r_e(k), c_e(l)]`` where
``r_e = row_cls`` (labels of ``u`` -> row classes), ``c_e = col_cls`` and
``T_e = table`` (float64 ``[R_e, C_e]``, µs, ``+inf`` = forbidden pair).

Allowed labels ``A_g = {k : U_g(k) < inf}``. Active classes of an edge are the
classes that contain at least one allowed label:
``I_e = r_e(A_u)``, ``J_e = c_e(A_v)``. Allowed class pairs
``P_e = {(i, j) in I_e x J_e : T_e[i, j] < inf}``.

Variables::

    x[g, k] in {0, 1}     for g, k in A_g               (one-hot label choice)
    y[e, i, j] in [0, 1]  for e, (i, j) in P_e          (class-pair indicator)

Forbidden labels and forbidden pairs have *no variable at all* (no big-M).

Constraints::

    sum_{k in A_g} x[g, k] = 1                                  for every g
    sum_{j: (i,j) in P_e} y[e, i, j] = sum_{k in A_u: r_e(k)=i} x[u, k]
                                                        for every e, i in I_e
    sum_{i: (i,j) in P_e} y[e, i, j] = sum_{l in A_v: c_e(l)=j} x[v, l]
                                                        for every e, j in J_e
    low_c <= sum_g sum_{k in A_g} coef_c[g][k] x[g, k] <= high_c
                                          for every LinearConstraint c

Objective (µs)::

    minimise  constant + sum_{g,k} U_g(k) x[g,k] + sum_{e,(i,j)} T_e[i,j] y[e,i,j]

Exactness and why ``y`` is continuous. For integral ``x`` every group has one
label ``k_g``; for edge ``e`` exactly one row class ``i* = r_e(k_u)`` has
right-hand side 1 and all others 0, and likewise ``j* = c_e(k_v)`` for the
columns. With ``y >= 0`` the zero rows force ``y[e, i, j] = 0`` for every
``i != i*`` and every ``j != j*``, so the row ``i*`` reads ``y[e, i*, j*] = 1``
-- feasible iff ``(i*, j*)`` is an allowed pair. Hence integral ``x`` forces
integral ``y``, the objective equals ``E(labels)``, and labellings that use a
forbidden pair are infeasible. Declaring ``y`` integer would add no cuts but
would multiply the integer variables by ~10x (edges hold far more class pairs
than groups hold labels) and slow presolve/branching, so ``y`` is continuous.

LP relaxation = local polytope. Relax ``x`` to ``[0, 1]``. The standard LP
relaxation of MAP inference is ``min <theta, mu>`` over the local polytope
``L(G)`` (Wainwright & Jordan 2008, "Graphical Models, Exponential Families,
and Variational Inference", §4.1.1 and §8.4; Werner 2007, PAMI 29(7)):
``mu_g >= 0``, ``sum_k mu_g(k) = 1``, ``mu_e >= 0``,
``sum_l mu_e(k, l) = mu_u(k)``, ``sum_k mu_e(k, l) = mu_v(l)``, with
``mu = 0`` on forbidden labels/pairs. Our relaxation has the same optimum:

* L -> ours: given ``mu`` in ``L(G)`` set ``x = mu_g`` and
  ``y[e,i,j] = sum_{r(k)=i, c(l)=j} mu_e(k, l)``. Nonnegativity, the
  one-hot rows and both class marginals follow by summing the label
  marginals over a class; ``y`` is zero on forbidden class pairs because every
  label pair in such a class pair is forbidden; the cost is identical because
  ``theta_e(k, l) = T_e[r(k), c(l)]`` is constant on each class block.
* ours -> L: given ``(x, y)`` let ``X_u(i) = sum_{r(k)=i} x[u, k]`` and
  ``X_v(j) = sum_{c(l)=j} x[v, l]``, and set
  ``mu_e(k, l) = y[e,i,j] * x[u,k] / X_u(i) * x[v,l] / X_v(j)`` (0 when a
  denominator is 0; then ``y[e,i,j] <= X_u(i) = 0`` anyway). Summing over
  ``l`` gives ``x[u,k] / X_u(i) * sum_j y[e,i,j] = x[u,k]`` (and 0 = x[u,k]
  when ``X_u(i) = 0``); symmetrically for ``k``. ``mu_e > 0`` only where
  ``y > 0``, i.e. on allowed pairs, and ``sum_{k,l} theta_e mu_e =
  sum_{i,j} T_e[i,j] y[e,i,j]`` because the weights within a block sum to 1.

So ``LP(ours) = min_{L(G)} <theta, mu>`` (with the linear rows added to both
sides). TRW-S (Kolmogorov 2006, PAMI 28(10)) maximises a lower bound that is
the value of a feasible point of the dual of that LP, so by weak duality every
TRW-S bound is ``<=`` the LP bound here ``<=`` the ILP optimum. For a TRW-S
run that handles the linear rows by Lagrangian relaxation the same holds: the
Lagrangian dual of the LP over ``L(G)`` with those rows is ``<=`` its optimum.

Dominated labels (exact presolve, ``build_model(dominance=True)``, the
default). Two allowed labels ``k, k'`` of group ``g`` with the same *signature*
-- the same class on every incident edge (``r_e`` where ``g = u``, ``c_e``
where ``g = v``) and the same coefficient in every linear constraint -- have
identical pairwise costs against every neighbour labelling and identical
constraint activity, so ``k'`` can be swapped for ``k`` whenever
``U_g(k) <= U_g(k')`` without losing feasibility or increasing ``E``. Per
signature only the cheapest label (lowest index on ties) gets an ``x``
column; the others are treated like forbidden labels. The ILP optimum is
unchanged. The LP of the reduced model is the local-polytope LP of the reduced
MRF: it is still ``<=`` the ILP optimum and ``>=`` the LP of the full model
(fewer variables), hence still ``>=`` any TRW-S bound of the original MRF.
Every active class keeps at least one label, so the ``y`` variables and rows
are the same as without the reduction.

Matrix layout (used by tests and the MPS file). Columns: all ``x`` ordered by
``(g, k)`` (names ``x{g}_{k}``), then all ``y`` ordered by ``(e, i, j)``
(names ``y{e}_{i}_{j}``, ``i``/``j`` class ids). Rows: ``G`` one-hot rows
(``one{g}``), then per edge its active row classes and then its active column
classes, each in increasing class id (``e{e}_{t}``, ``t`` = position within
the edge), then the linear constraints (``lc{n}``, in list order). The
constraint matrix is built once as numpy CSC arrays (no scipy) and handed to
HiGHS through
``highspy.Highs.passModel(HighsLp)`` (HiGHS docs, "Python interface /
passModel"). The MPS file is written by ``highspy.Highs.writeModel`` (HiGHS
picks the format from the ``.mps`` suffix; the objective offset is stored as
the RHS of the objective row, which CBC and HiGHS both honour).

Backends:

* ``"highs"``: HiGHS (``highspy``), fed the CSC arrays directly.
* ``"cbc"``: the CBC binary bundled with PuLP (``pulp.PULP_CBC_CMD().path``)
  run on the MPS written by HiGHS, with the command-line options PuLP's
  ``PULP_CBC_CMD`` would pass; the solution file is read by PuLP's own
  ``COIN_CMD.get_status`` so the ``(status, sol_status)`` pair is exactly
  PuLP's, then mapped by :func:`pipeline.solvers.status.map_pulp_status`.
  Going through ``pulp.LpProblem`` instead was measured (5.6e6 columns,
  1.31e7 nonzeros, 2 cores): 38 s to build the PuLP objects (2.9 µs per
  nonzero), 82 s for PuLP's own ``writeMPS`` (which ``PULP_CBC_CMD`` always
  calls, and which drops the objective constant) and 10.7 GB peak RSS, against
  2.3 s for :func:`build_model` plus 15-21 s for HiGHS' ``writeModel``
  including names; so PuLP objects are not built.

Errors: ``ValueError`` for malformed MRFs (shape mismatch, NaN, ``-inf``);
:class:`~pipeline.solvers.errors.InfeasibleError` when no labelling exists;
:class:`~pipeline.solvers.errors.FractionalRelaxationError` when
``relax=True`` and the LP optimum is fractional.
"""

from __future__ import annotations

import contextlib
import decimal
import math
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.solvers.errors import FractionalRelaxationError, InfeasibleError
from pipeline.solvers.mrf import MRF
from pipeline.solvers.result import SolverResult
from pipeline.solvers.status import (
    FEASIBLE_TIME_LIMIT,
    INFEASIBLE,
    NOT_SOLVED,
    OPTIMAL,
    map_highs_status,
    map_pulp_status,
)

__all__ = [
    "BACKENDS",
    "INTEGRALITY_TOL",
    "IlpModel",
    "build_model",
    "lp_lower_bound",
    "solve_ilp",
    "write_mps",
]

BACKENDS = ("highs", "cbc")
CBC_HARD_LIMIT_FACTOR = 2.0
"""CBC is killed after ``max(2 * time_limit_s, time_limit_s + 60)`` s of wall time."""
INTEGRALITY_TOL = 1e-6
"""An LP solution counts as integral if every ``x`` is within this of 0 or 1."""


@dataclass
class IlpModel:
    """The integer program of an MRF as numpy arrays (column-wise CSC matrix).

    Shapes: ``n = num_x + num_y`` columns, ``m`` rows, ``nnz`` nonzeros.

    Attributes:
        num_groups: ``G``.
        num_x: number of ``x`` columns (columns ``0 .. num_x-1``).
        num_y: number of ``y`` columns (columns ``num_x .. n-1``).
        col_cost: float64 ``[n]`` objective coefficient (µs).
        integrality: bool ``[n]``; True for ``x`` columns.
        a_start: int32 ``[n + 1]`` CSC column starts.
        a_index: int32 ``[nnz]`` row index of each nonzero.
        a_value: float64 ``[nnz]`` coefficient of each nonzero.
        row_lower, row_upper: float64 ``[m]`` row bounds (``±inf`` allowed).
        offset: objective constant (µs), ``MRF.constant``.
        x_group, x_label: int64 ``[num_x]`` the ``(g, k)`` of each ``x`` column.
        x_start: int64 ``[G + 1]``; columns of group ``g`` are
            ``x_start[g] : x_start[g + 1]``.
        y_edge, y_row, y_col: int32 ``[num_y]`` the ``(e, i, j)`` of each ``y``.
        edge_row_start: int64 ``[E + 1]``; rows of edge ``e``.
        num_linear: number of linear-constraint rows (the last rows).
        labels_dominated: allowed labels dropped as dominated (module docstring).
        build_seconds: wall time of :func:`build_model`.
    """

    num_groups: int
    num_x: int
    num_y: int
    col_cost: np.ndarray
    integrality: np.ndarray
    a_start: np.ndarray
    a_index: np.ndarray
    a_value: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    offset: float
    x_group: np.ndarray
    x_label: np.ndarray
    x_start: np.ndarray
    y_edge: np.ndarray
    y_row: np.ndarray
    y_col: np.ndarray
    edge_row_start: np.ndarray
    num_linear: int
    labels_dominated: int = 0
    build_seconds: float = 0.0

    @property
    def num_cols(self) -> int:
        return self.num_x + self.num_y

    @property
    def num_rows(self) -> int:
        return int(self.row_lower.shape[0])

    @property
    def nnz(self) -> int:
        return int(self.a_index.shape[0])

    def labels_from_x(self, col_value: np.ndarray) -> np.ndarray:
        """Return int64 ``[G]`` labels: per group the label of its largest ``x``."""
        xv = np.asarray(col_value[: self.num_x], dtype=np.float64)
        labels = np.empty(self.num_groups, dtype=np.int64)
        for g in range(self.num_groups):
            a, b = self.x_start[g], self.x_start[g + 1]
            labels[g] = self.x_label[a + int(np.argmax(xv[a:b]))]
        return labels

    def fractionality(self, col_value: np.ndarray) -> float:
        """Max distance of an ``x`` value to the nearest integer."""
        xv = np.asarray(col_value[: self.num_x], dtype=np.float64)
        if xv.size == 0:
            return 0.0
        return float(np.max(np.abs(xv - np.round(xv))))

    def col_names(self) -> list[str]:
        """Column names ``x{g}_{k}`` then ``y{e}_{i}_{j}`` (MPS-safe)."""
        xs = [
            f"x{g}_{k}" for g, k in zip(self.x_group.tolist(), self.x_label.tolist(), strict=True)
        ]
        ys = [
            f"y{e}_{i}_{j}"
            for e, i, j in zip(
                self.y_edge.tolist(), self.y_row.tolist(), self.y_col.tolist(), strict=True
            )
        ]
        return xs + ys

    def row_names(self) -> list[str]:
        """Row names ``one{g}``, ``e{e}_{t}``, ``lc{n}``.

        ``t`` is the local row of edge ``e``: first its active row classes in
        increasing class id, then its active column classes likewise.
        """
        names = [f"one{g}" for g in range(self.num_groups)]
        ers = self.edge_row_start
        for e in range(ers.shape[0] - 1):
            n = int(ers[e + 1] - ers[e])
            names.extend(f"e{e}_{t}" for t in range(n))
        names.extend(f"lc{n}" for n in range(self.num_linear))
        return names


def _check_values(arr: np.ndarray, what: str) -> None:
    if np.isnan(arr).any():
        raise ValueError(f"{what} contains NaN")
    if np.isneginf(arr).any():
        raise ValueError(f"{what} contains -inf")


def _cat32(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _dominance_keep(unary: np.ndarray, ok: np.ndarray, signature: np.ndarray) -> np.ndarray:
    """Among allowed labels ``ok`` keep, per distinct signature row, the label
    with the smallest unary (lowest index on ties); returns sorted label ids."""
    if signature.shape[1] == 0:
        sig_id = np.zeros(ok.size, dtype=np.int64)
    else:
        _, sig_id = np.unique(signature[ok], axis=0, return_inverse=True)
        sig_id = sig_id.reshape(-1)
    order = np.lexsort((ok, unary[ok], sig_id))
    _, first = np.unique(sig_id[order], return_index=True)
    return np.sort(ok[order[first]])


def build_model(mrf: MRF, *, dominance: bool = True) -> IlpModel:
    """Build the integer program of ``mrf`` (see the module docstring).

    Args:
        mrf: the MRF; ``factor(e)`` is called once per edge.
        dominance: drop dominated labels first (exact; module docstring).

    Returns:
        An :class:`IlpModel` with the CSC matrix; ``build_seconds`` and
        ``labels_dominated`` are set.

    Raises:
        ValueError: malformed unary/factor (shape, NaN, ``-inf``, bad class id).
        InfeasibleError: a group has every label forbidden (``+inf`` unary).
    """
    t0 = time.perf_counter()
    num_groups = mrf.num_groups
    dom = np.asarray(mrf.domain_sizes, dtype=np.int64)
    if len(mrf.unary) != num_groups:
        raise ValueError(f"{len(mrf.unary)} unaries for {num_groups} groups")
    edges = np.asarray(mrf.edges, dtype=np.int64).reshape(-1, 2)
    num_edges = edges.shape[0]

    # Fetch and validate every factor once; collect per-group label signatures
    # (class on each incident edge, coefficient in each linear constraint).
    factors: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    sig_cols: list[list[np.ndarray]] = [[] for _ in range(num_groups)]
    for e in range(num_edges):
        u, v = int(edges[e, 0]), int(edges[e, 1])
        f = mrf.factor(e)
        rc = np.asarray(f.row_cls)
        cc = np.asarray(f.col_cls)
        table = np.asarray(f.table, dtype=np.float64)
        if rc.shape != (int(dom[u]),) or cc.shape != (int(dom[v]),) or table.ndim != 2:
            raise ValueError(
                f"factor({e}) shapes row_cls {rc.shape}, col_cls {cc.shape}, table "
                f"{table.shape} do not match domains ({int(dom[u])}, {int(dom[v])})"
            )
        if rc.size and (rc.min() < 0 or rc.max() >= table.shape[0]):
            raise ValueError(f"factor({e}).row_cls out of range [0, {table.shape[0]})")
        if cc.size and (cc.min() < 0 or cc.max() >= table.shape[1]):
            raise ValueError(f"factor({e}).col_cls out of range [0, {table.shape[1]})")
        _check_values(table, f"factor({e}).table")
        factors.append((rc, cc, table))
        if dominance:
            sig_cols[u].append(rc.astype(np.float64))
            sig_cols[v].append(cc.astype(np.float64))
    lin_coef: list[dict[int, np.ndarray]] = []
    for lc in mrf.linear_constraints:
        if math.isnan(lc.low) or math.isnan(lc.high):
            raise ValueError(f"linear constraint {lc.name!r}: NaN bound")
        coefs = {}
        for g, coef in lc.coef.items():
            g = int(g)
            coef = np.asarray(coef, dtype=np.float64)
            if not 0 <= g < num_groups or coef.shape != (int(dom[g]),):
                raise ValueError(f"linear constraint {lc.name!r}: bad coef[{g}] {coef.shape}")
            if not np.isfinite(coef).all():
                raise ValueError(f"linear constraint {lc.name!r}: coef[{g}] not finite")
            coefs[g] = coef
            if dominance:
                sig_cols[g].append(coef)
        lin_coef.append(coefs)

    labels_ok: list[np.ndarray] = []
    costs_x: list[np.ndarray] = []
    dominated = 0
    for g in range(num_groups):
        u = np.asarray(mrf.unary[g], dtype=np.float64)
        if u.shape != (int(dom[g]),):
            raise ValueError(f"unary[{g}] has shape {u.shape}, expected ({int(dom[g])},)")
        _check_values(u, f"unary[{g}]")
        ok = np.flatnonzero(np.isfinite(u))
        if ok.size == 0:
            raise InfeasibleError(f"group {g}: every label has unary +inf")
        if dominance and ok.size > 1:
            sig = np.stack(sig_cols[g], axis=1) if sig_cols[g] else np.zeros((u.size, 0))
            kept = _dominance_keep(u, ok, sig)
            dominated += ok.size - kept.size
            ok = kept
        labels_ok.append(ok)
        costs_x.append(u[ok])
    del sig_cols
    counts = np.array([a.size for a in labels_ok], dtype=np.int64)
    x_start = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(counts, out=x_start[1:])
    num_x = int(x_start[-1])
    x_label = np.concatenate(labels_ok) if num_groups else np.zeros(0, np.int64)
    x_group = np.repeat(np.arange(num_groups, dtype=np.int64), counts)

    # COO blocks, emitted in increasing row order so a stable sort by column
    # leaves the row indices of every column sorted.
    rows: list[np.ndarray] = [x_group.astype(np.int64)]
    cols: list[np.ndarray] = [np.arange(num_x, dtype=np.int64)]
    vals: list[np.ndarray] = [np.ones(num_x)]
    row_lo: list[np.ndarray] = [np.ones(num_groups)]
    row_hi: list[np.ndarray] = [np.ones(num_groups)]
    y_cost: list[np.ndarray] = []
    y_e: list[np.ndarray] = []
    y_i: list[np.ndarray] = []
    y_j: list[np.ndarray] = []

    edge_row_start = np.zeros(num_edges + 1, dtype=np.int64)
    next_row = num_groups
    next_col = num_x
    for e in range(num_edges):
        u, v = int(edges[e, 0]), int(edges[e, 1])
        rc, cc, table = factors[e]
        au = np.arange(x_start[u], x_start[u + 1])
        av = np.arange(x_start[v], x_start[v + 1])
        act_r, inv_u = np.unique(rc[x_label[au]], return_inverse=True)
        act_c, inv_v = np.unique(cc[x_label[av]], return_inverse=True)
        sub = table[np.ix_(act_r, act_c)]
        ii, jj = np.nonzero(np.isfinite(sub))
        nr, nc, ny = act_r.size, act_c.size, ii.size
        ycols = np.arange(next_col, next_col + ny, dtype=np.int64)
        rows += [next_row + ii, next_row + nr + jj, next_row + inv_u, next_row + nr + inv_v]
        cols += [ycols, ycols, au, av]
        vals += [np.ones(ny), np.ones(ny), -np.ones(au.size), -np.ones(av.size)]
        row_lo.append(np.zeros(nr + nc))
        row_hi.append(np.zeros(nr + nc))
        y_cost.append(sub[ii, jj])
        y_e.append(np.full(ny, e, dtype=np.int32))
        y_i.append(act_r[ii].astype(np.int32))
        y_j.append(act_c[jj].astype(np.int32))
        next_row += nr + nc
        next_col += ny
        edge_row_start[e + 1] = next_row
    edge_row_start[0] = num_groups
    if num_edges == 0:
        edge_row_start[:] = num_groups

    x_pos = np.full(int(dom.sum()), -1, dtype=np.int64)
    dom_start = np.concatenate([[0], np.cumsum(dom)])
    x_pos[dom_start[x_group] + x_label] = np.arange(num_x)
    for n, lc in enumerate(mrf.linear_constraints):
        for g, coef in lin_coef[n].items():
            ks = labels_ok[g]
            c = coef[ks]
            nz = c != 0.0
            rows.append(np.full(int(nz.sum()), next_row, dtype=np.int64))
            cols.append(x_pos[dom_start[g] + ks[nz]])
            vals.append(c[nz])
        row_lo.append(np.array([float(lc.low)]))
        row_hi.append(np.array([float(lc.high)]))
        next_row += 1

    num_cols = next_col
    row_all = np.concatenate(rows)
    col_all = np.concatenate(cols)
    val_all = np.concatenate(vals)
    order = np.argsort(col_all, kind="stable")
    a_index = row_all[order].astype(np.int32)
    a_value = val_all[order]
    a_start = np.zeros(num_cols + 1, dtype=np.int64)
    np.cumsum(np.bincount(col_all, minlength=num_cols), out=a_start[1:])
    del row_all, col_all, val_all, order

    num_y = num_cols - num_x
    col_cost = np.concatenate([np.concatenate(costs_x) if costs_x else np.zeros(0)] + y_cost)
    integrality = np.zeros(num_cols, dtype=bool)
    integrality[:num_x] = True
    model = IlpModel(
        num_groups=num_groups,
        num_x=num_x,
        num_y=num_y,
        col_cost=col_cost,
        integrality=integrality,
        a_start=a_start.astype(np.int32) if a_start[-1] < 2**31 else a_start,
        a_index=a_index,
        a_value=a_value,
        row_lower=np.concatenate(row_lo),
        row_upper=np.concatenate(row_hi),
        offset=float(mrf.constant),
        x_group=x_group,
        x_label=x_label.astype(np.int64),
        x_start=x_start,
        y_edge=_cat32(y_e),
        y_row=_cat32(y_i),
        y_col=_cat32(y_j),
        edge_row_start=edge_row_start,
        num_linear=len(mrf.linear_constraints),
        labels_dominated=dominated,
    )
    model.build_seconds = time.perf_counter() - t0
    return model


# --------------------------------------------------------------------------- HiGHS


def _highs_lp(model: IlpModel, *, relax: bool, names: bool):
    """The model as a ``highspy.HighsLp`` (column-wise matrix, minimise)."""
    import highspy

    lp = highspy.HighsLp()
    lp.num_col_ = model.num_cols
    lp.num_row_ = model.num_rows
    lp.col_cost_ = model.col_cost
    lp.col_lower_ = np.zeros(model.num_cols)
    lp.col_upper_ = np.ones(model.num_cols)
    lp.row_lower_ = model.row_lower
    lp.row_upper_ = model.row_upper
    lp.offset_ = model.offset
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_ = model.num_cols
    lp.a_matrix_.num_row_ = model.num_rows
    lp.a_matrix_.start_ = model.a_start
    lp.a_matrix_.index_ = model.a_index
    lp.a_matrix_.value_ = model.a_value
    if not relax:
        k_int = highspy.HighsVarType.kInteger
        k_cont = highspy.HighsVarType.kContinuous
        lp.integrality_ = [k_int] * model.num_x + [k_cont] * model.num_y
    if names:
        lp.col_names_ = model.col_names()
        lp.row_names_ = model.row_names()
    return lp


_HIGHS_THREADS: list[int] = []


@contextlib.contextmanager
def _stdout_to_devnull() -> Iterator[None]:
    """Send file descriptor 1 (C-level stdout) to /dev/null for the block."""
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _new_highs(msg: bool, threads: int):
    import highspy

    # HiGHS keeps one global task scheduler per process; asking a later solve
    # for a different thread count fails unless the scheduler is reset first.
    if _HIGHS_THREADS and _HIGHS_THREADS[0] != threads:
        highspy.Highs.resetGlobalScheduler(True)
    _HIGHS_THREADS[:] = [threads]
    if msg:
        h = highspy.Highs()
    else:
        with _stdout_to_devnull():  # the constructor prints a banner before any option
            h = highspy.Highs()
    h.setOptionValue("output_flag", bool(msg))
    h.setOptionValue("threads", int(threads))
    return h


def _write_mps_highs(h, path: Path) -> float:
    """Write the model held by ``h`` to ``path`` atomically; return seconds."""
    t0 = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".mps", dir=path.parent)
    os.close(fd)
    try:
        status = h.writeModel(tmp)
        if status.name != "kOk" and status.name != "kWarning":
            raise OSError(f"HiGHS writeModel({tmp}) returned {status}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return time.perf_counter() - t0


def write_mps(model: IlpModel, path: str | Path, *, relax: bool = False) -> float:
    """Write ``model`` (``relax``: without integrality) as an MPS file.

    Names follow the module docstring so a re-solve can be mapped back. The
    file is written through HiGHS' ``writeModel`` (atomic rename into place).

    Returns:
        Seconds spent (name generation + pass + write).
    """
    t0 = time.perf_counter()
    h = _new_highs(False, _HIGHS_THREADS[0] if _HIGHS_THREADS else 1)
    h.passModel(_highs_lp(model, relax=relax, names=True))
    _write_mps_highs(h, Path(path))
    return time.perf_counter() - t0


@dataclass
class _Outcome:
    status: str
    col_value: np.ndarray | None
    backend_objective: float
    dual_bound: float
    mip_gap: float
    backend_seconds: float
    iterations: int
    extra: dict = field(default_factory=dict)


def _solve_highs(model, *, relax, time_limit_s, mip_gap, threads, msg, mps_path):
    t0 = time.perf_counter()
    h = _new_highs(msg, threads)
    names = mps_path is not None
    lp = _highs_lp(model, relax=relax, names=names)
    h.passModel(lp)
    del lp
    pass_seconds = time.perf_counter() - t0
    extra = {"pass_seconds": pass_seconds}
    if mps_path is not None:
        extra["mps_seconds"] = _write_mps_highs(h, Path(mps_path))
    if time_limit_s is not None:
        h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("random_seed", 0)
    if relax:
        # Interior point + crossover: a basic (vertex) optimum, ~7x faster than
        # dual simplex on the degenerate local-polytope LPs measured here.
        h.setOptionValue("solver", "ipm")
        h.setOptionValue("run_crossover", "on")
    t1, c1 = time.perf_counter(), time.process_time()
    h.run()
    wall, cpu = time.perf_counter() - t1, time.process_time() - c1
    info = h.getInfo()
    model_status = h.getModelStatus()
    has_solution = int(info.primal_solution_status) == 2
    status = map_highs_status(model_status, has_solution)
    if relax and status == FEASIBLE_TIME_LIMIT:
        status = NOT_SOLVED  # an LP stopped early gives neither a bound nor an optimum
    col_value = None
    if has_solution and status in (OPTIMAL, FEASIBLE_TIME_LIMIT):
        col_value = np.asarray(h.getSolution().col_value, dtype=np.float64)
    obj = float(info.objective_function_value) if col_value is not None else math.inf
    if relax:
        bound = obj if status == OPTIMAL else -math.inf
        gap = 0.0 if status == OPTIMAL else math.inf
        iterations = int(info.ipm_iteration_count) + int(info.simplex_iteration_count)
    else:
        bound = float(info.mip_dual_bound)
        gap = float(info.mip_gap)
        iterations = int(info.mip_node_count)
    extra.update(
        highs_model_status=model_status.name,
        simplex_iterations=int(info.simplex_iteration_count),
        ipm_iterations=int(info.ipm_iteration_count),
        mip_nodes=int(info.mip_node_count) if not relax else 0,
        wall_solve_seconds=wall,
        backend_cpu_seconds=cpu,
    )
    return _Outcome(status, col_value, obj, bound, gap, float(h.getRunTime()), iterations, extra)


# ----------------------------------------------------------------------------- CBC

_CBC_FLOAT = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf|infinity|nan))"


def parse_cbc_log(text: str) -> dict:
    """Extract the summary of a CBC run from its stdout.

    Returns a dict with any of: ``result`` (the "Result - ..." phrase),
    ``objective``, ``lower_bound`` (as printed, i.e. rounded),
    ``lower_bound_rounding`` (half a unit of its last printed digit), ``gap``,
    ``nodes``, ``iterations``, ``wall_seconds``, ``cpu_seconds``.
    """
    out: dict = {}
    pats = {
        "objective": r"^Objective value:\s*" + _CBC_FLOAT,
        "lower_bound": r"^Lower bound:\s*" + _CBC_FLOAT,
        "gap": r"^Gap:\s*" + _CBC_FLOAT,
        "nodes": r"^Enumerated nodes:\s*(\d+)",
        "iterations": r"^Total iterations:\s*(\d+)",
        "cpu_seconds": r"^Total time \(CPU seconds\):\s*" + _CBC_FLOAT,
        "wall_seconds": r"^Total time \(CPU seconds\):.*\(Wallclock seconds\):\s*" + _CBC_FLOAT,
    }
    for key, pat in pats.items():
        m = re.findall(pat, text, flags=re.MULTILINE | re.IGNORECASE)
        if m:
            val = m[-1]
            out[key] = int(val) if key in ("nodes", "iterations") else float(val)
            if key == "lower_bound" and math.isfinite(out[key]):
                # CBC rounds the bound it prints (e.g. 3 decimals); step down by
                # half a unit of the last printed digit so it stays a valid bound.
                exponent = decimal.Decimal(val).as_tuple().exponent
                out["lower_bound_rounding"] = 0.5 * 10.0 ** int(exponent)
    m = re.findall(r"^Result - (.*)$", text, flags=re.MULTILINE)
    if m:
        out["result"] = m[-1].strip()
    return out


def _read_cbc_solution(path: str, num_cols: int) -> np.ndarray:
    """Column values from a CBC ``-solution`` file (rows ``idx name value dj``)."""
    values = np.zeros(num_cols)
    with open(path) as fh:
        fh.readline()
        for line in fh:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "**":
                parts = parts[1:]
            idx = int(parts[0])
            if idx < num_cols:
                values[idx] = float(parts[2])
    return values


def _solve_cbc(model, *, relax, time_limit_s, mip_gap, threads, msg, mps_path):
    import warnings

    import pulp

    with warnings.catch_warnings():  # PuLP 3.3 deprecates PULP_CBC_CMD (removal in 4.0)
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=False)
    if not solver.available():
        raise RuntimeError(f"PuLP's bundled CBC is not executable: {solver.path}")
    extra: dict = {}
    with tempfile.TemporaryDirectory(prefix="ilp_cbc_") as tmp:
        t0 = time.perf_counter()
        h = _new_highs(False, threads)
        h.passModel(_highs_lp(model, relax=relax, names=True))
        # CBC reads the requested MPS file itself (written once), else a temp one.
        run_mps = str(mps_path) if mps_path is not None else os.path.join(tmp, "model.mps")
        _write_mps_highs(h, Path(run_mps))
        del h
        extra["mps_seconds"] = time.perf_counter() - t0
        sol = os.path.join(tmp, "model.sol")
        args = [solver.path, run_mps]
        if time_limit_s is not None:
            args += ["-sec", repr(float(time_limit_s))]
        args += ["-timeMode", "elapsed", "-threads", str(int(threads))]
        if not relax:
            args += ["-ratio", repr(float(mip_gap))]
        args += ["-initialSolve" if relax else "-solve", "-solution", sol]
        # CBC checks -sec only between phases (not inside the root LP), so a
        # run is killed once it overruns the limit by CBC_HARD_LIMIT_FACTOR.
        hard = None
        if time_limit_s is not None:
            hard = max(CBC_HARD_LIMIT_FACTOR * float(time_limit_s), float(time_limit_s) + 60.0)
        t1 = time.perf_counter()
        killed = False
        try:
            proc = subprocess.run(
                args,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=hard,
                check=False,
            )
            stdout, returncode = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:  # subprocess.run has killed CBC
            killed = True
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            returncode = None
        wall = time.perf_counter() - t1
        if msg:
            print(stdout)
        log = parse_cbc_log(stdout)
        extra.update(cbc_result=log.get("result"), cbc_returncode=returncode, cbc_killed=killed)
        if killed or returncode != 0 or not os.path.exists(sol):
            status, values = NOT_SOLVED, None
            extra["pulp_status"] = None
        else:
            pulp_status, sol_status = solver.get_status(sol)
            status = map_pulp_status(pulp_status, sol_status)
            extra["pulp_status"] = (int(pulp_status), int(sol_status))
            values = _read_cbc_solution(sol, model.num_cols)
    if relax and status == FEASIBLE_TIME_LIMIT:
        status = NOT_SOLVED
    col_value = values if status in (OPTIMAL, FEASIBLE_TIME_LIMIT) else None
    obj = math.inf
    if col_value is not None:
        obj = float(model.col_cost @ col_value + model.offset)
    cbc_obj = log.get("objective")
    # CBC prints "Lower bound:" whenever optimality is not proven outright,
    # including "Optimal solution found (within gap tolerance)" for -ratio > 0.
    bound = -math.inf
    if not relax and "lower_bound" in log:
        bound = float(log["lower_bound"]) - log.get("lower_bound_rounding", 0.0)
        if cbc_obj is not None and col_value is not None:
            bound += obj - float(cbc_obj)  # same offset convention as our objective
    elif status == OPTIMAL:
        bound = obj
    gap = math.inf
    if col_value is not None and math.isfinite(bound):
        gap = max(0.0, obj - bound) / max(abs(obj), 1e-12)
    extra.update(
        cbc_objective=cbc_obj,
        mip_nodes=log.get("nodes", 0),
        simplex_iterations=log.get("iterations", 0),
        wall_solve_seconds=wall,
        backend_cpu_seconds=log.get("cpu_seconds", math.nan),
    )
    iterations = int(log.get("iterations" if relax else "nodes", 0))
    backend_seconds = float(log.get("wall_seconds", wall))
    return _Outcome(status, col_value, obj, bound, gap, backend_seconds, iterations, extra)


# ------------------------------------------------------------------------------ API


def _solve_model(model, backend, **kw) -> _Outcome:
    if backend == "highs":
        return _solve_highs(model, **kw)
    if backend == "cbc":
        return _solve_cbc(model, **kw)
    raise ValueError(f"unknown ILP backend {backend!r}; choose one of {BACKENDS}")


def _check_labels(mrf: MRF, labels: np.ndarray, tol: float = 1e-6) -> list[str]:
    """Names of linear constraints violated by more than ``tol`` (relative)."""
    bad = []
    for lc in mrf.linear_constraints:
        val = sum(float(np.asarray(c)[labels[g]]) for g, c in lc.coef.items())
        scale = tol * max(
            1.0,
            abs(lc.low) if math.isfinite(lc.low) else 1.0,
            abs(lc.high) if math.isfinite(lc.high) else 1.0,
        )
        if val < lc.low - scale or val > lc.high + scale:
            bad.append(lc.name)
    return bad


def solve_ilp(
    mrf: MRF,
    *,
    backend: str = "highs",
    relax: bool = False,
    time_limit_s: float | None = None,
    mip_gap: float = 0.0,
    threads: int = 1,
    mps_path: str | Path | None = None,
    msg: bool = False,
) -> SolverResult:
    """Solve the MRF exactly as an integer program (or its LP relaxation).

    Args:
        mrf: the problem.
        backend: ``"highs"`` (highspy) or ``"cbc"`` (PuLP's bundled CBC).
        relax: solve the LP relaxation (= local polytope) instead; accepted only
            if every ``x`` is within :data:`INTEGRALITY_TOL` of 0/1.
        time_limit_s: wall-clock limit of the backend solve (s); ``None`` = none.
            Building the model and writing the MPS file are not counted.
        mip_gap: relative MIP gap at which the backend may stop and call the
            incumbent optimal (0 = prove optimality).
        threads: backend threads.
        mps_path: if given, the full model (integer unless ``relax``) is
            written there as MPS, names as in the module docstring.
        msg: print the backend log.

    Returns:
        :class:`SolverResult` with ``labels`` int64 ``[G]`` (all ``-1`` when
        ``status == "Not Solved"``), ``objective = mrf.evaluate(labels)`` (µs,
        ``+inf`` when not solved), ``lower_bound`` (µs; the objective for an
        ``"Optimal"`` run with ``mip_gap == 0``, else the backend's dual bound;
        ``-inf`` if none), ``lower_bound_source`` ``"ilp"`` or ``"lp"``,
        ``iterations`` (B&B nodes for the ILP; for the LP, HiGHS IPM + crossover
        iterations or CBC simplex iterations),
        ``bound_history`` ``[lower_bound]`` (one final value) and ``extra``
        with ``backend``, ``variables``, ``constraints``, ``nonzeros``,
        ``integer_variables``, ``labels_dominated``, ``build_seconds``,
        ``backend_seconds`` (the backend's own wall-clock solve time),
        ``backend_cpu_seconds``, ``mip_gap`` (reported), ``backend_objective``
        and backend-specific diagnostics.

    Raises:
        ValueError: unknown backend or malformed MRF.
        InfeasibleError: no labelling satisfies the forbidden entries and
            linear constraints (proved by the backend or found while building).
        FractionalRelaxationError: ``relax=True`` and the LP optimum is
            fractional.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown ILP backend {backend!r}; choose one of {BACKENDS}")
    t_start = time.perf_counter()
    model = build_model(mrf)
    out = _solve_model(
        model,
        backend,
        relax=relax,
        time_limit_s=time_limit_s,
        mip_gap=mip_gap,
        threads=threads,
        msg=msg,
        mps_path=mps_path,
    )
    extra = {
        "backend": backend,
        "relax": relax,
        "variables": model.num_cols,
        "integer_variables": 0 if relax else model.num_x,
        "constraints": model.num_rows,
        "nonzeros": model.nnz,
        "labels_dominated": model.labels_dominated,
        "build_seconds": model.build_seconds,
        "backend_seconds": out.backend_seconds,
        "mip_gap": out.mip_gap,
        "backend_objective": out.backend_objective,
        "time_limit_s": time_limit_s,
        "threads": threads,
    }
    extra.update(out.extra)
    if out.status == INFEASIBLE:
        kind = "LP relaxation" if relax else "ILP"
        raise InfeasibleError(
            f"{kind} is infeasible ({backend}): no labelling satisfies "
            "the forbidden entries and linear constraints"
        )
    source = "lp" if relax else "ilp"
    if out.status == NOT_SOLVED:
        labels = np.full(model.num_groups, -1, dtype=np.int64)
        bound = out.dual_bound if math.isfinite(out.dual_bound) else -math.inf
        return SolverResult(
            labels=labels,
            objective=math.inf,
            lower_bound=bound,
            lower_bound_source=source,
            status=NOT_SOLVED,
            iterations=out.iterations,
            bound_history=[bound],
            solve_seconds=time.perf_counter() - t_start,
            extra=extra,
        )
    labels = model.labels_from_x(out.col_value)
    if relax:
        frac = model.fractionality(out.col_value)
        extra["max_fractionality"] = frac
        if frac > INTEGRALITY_TOL:
            raise FractionalRelaxationError(
                f"LP relaxation is fractional (max distance to integral = {frac:.3g}); "
                "use solver=ilp"
            )
    objective = mrf.evaluate(labels)
    if not math.isfinite(objective):
        raise RuntimeError(
            f"{backend} returned a labelling with a forbidden entry (objective {objective})"
        )
    violated = _check_labels(mrf, labels)
    if violated:
        raise RuntimeError(f"{backend} labelling violates linear constraints {violated}")
    if out.status == OPTIMAL and not relax and mip_gap == 0.0:
        bound = objective
    else:
        bound = min(objective, out.dual_bound)
    return SolverResult(
        labels=labels,
        objective=objective,
        lower_bound=bound,
        lower_bound_source=source,
        status=out.status,
        iterations=out.iterations,
        bound_history=[bound],
        solve_seconds=time.perf_counter() - t_start,
        extra=extra,
    )


def lp_lower_bound(
    mrf: MRF,
    backend: str = "highs",
    *,
    time_limit_s: float | None = None,
    threads: int = 1,
) -> float:
    """Optimum of the LP relaxation (local polytope + linear rows), in µs.

    A valid lower bound on the MRF minimum, ``>=`` any TRW-S bound (module
    docstring). Integral or not, the LP optimum is returned.

    Raises:
        InfeasibleError: the LP (hence the MRF) is infeasible.
        RuntimeError: the LP was not solved to optimality (e.g. time limit).
    """
    model = build_model(mrf)
    out = _solve_model(
        model,
        backend,
        relax=True,
        time_limit_s=time_limit_s,
        mip_gap=0.0,
        threads=threads,
        msg=False,
        mps_path=None,
    )
    if out.status == INFEASIBLE:
        raise InfeasibleError(f"LP relaxation is infeasible ({backend})")
    if out.status != OPTIMAL:
        raise RuntimeError(f"LP relaxation not solved to optimality ({backend}): {out.status}")
    return float(out.dual_bound)
