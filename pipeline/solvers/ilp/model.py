"""The integer program (and its LP relaxation) of the pairwise MRF, as numpy arrays.

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
constraint matrix is built once as numpy CSC arrays (no scipy); the backends
(pipeline/solvers/ilp/highs.py, cbc.py) read it from :class:`IlpModel`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from pipeline.solvers.errors import InfeasibleError
from pipeline.solvers.mrf import MRF

__all__ = ["INTEGRALITY_TOL", "BackendOutcome", "IlpModel", "build_model"]

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


@dataclass
class BackendOutcome:
    """What a backend (highs.py, cbc.py) returns for an :class:`IlpModel`.

    Attributes:
        status: one of :data:`pipeline.solvers.status.STATUSES`.
        col_value: float64 ``[num_cols]`` solution, or None without one.
        backend_objective: objective of ``col_value`` (µs; ``+inf`` without one).
        dual_bound: the backend's lower bound (µs; ``-inf`` if none).
        mip_gap: the backend's reported relative gap.
        backend_seconds: the backend's own wall-clock solve time.
        iterations: B&B nodes (ILP) or LP iterations (relaxation).
        extra: backend-specific diagnostics.
    """

    status: str
    col_value: np.ndarray | None
    backend_objective: float
    dual_bound: float
    mip_gap: float
    backend_seconds: float
    iterations: int
    extra: dict = field(default_factory=dict)
