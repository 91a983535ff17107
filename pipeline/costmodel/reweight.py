"""The group MRF of the additive objective with its terms weighted differently.

The additive objective of pipeline/costmodel/model.py is, per graph edge ``e``,
``B_e = comm_e + transition_e + fusion_e`` and per node ``U_v = compute_v + opcomm_v``
(:meth:`~pipeline.costmodel.model.CostModel.edge_terms`, ``CostModel.op_comm``). Two
other objectives are built here over the same groups, labels and linear rows:

* :class:`Surrogate`, the step-time surrogate of the search
  (pipeline/stages/solve/objective.py): ``comm_e`` weighted by ``w_e``
  (pipeline/costmodel/exposure.py), everything else unchanged. Only the group factors
  (and group unaries, for edges inside a group) with a member edge of ``w_e != 1`` are
  rebuilt, from the base factor and those members' redistribution tables; the others
  are the base MRF's own.
* :class:`StreamObjective`, the stream objective of the step-time lower bound
  (pipeline/solvers/step_bound.py): ``theta * C(x) + c * M(x)`` with ``C`` the compute
  stream's additive part, ``sum_v (compute_v + fusion_v)`` (the simulated compute
  stream runs ``max(0, compute_v + fusion_v)`` per node, pipeline/costmodel/steptime.py),
  and ``M`` every redistribution, ``sum_e comm_e``; no transitions (they are no time),
  no in-op collectives (the simulation has none). A forbidden label of the base problem
  stays forbidden, and so does a forbidden pair when ``c > 0``; with ``c = 0`` only the
  group edges with a fusion term are kept (no redistribution table is computed; the
  forbidden pairs are dropped, a relaxation).

A group factor of the stream objective is built as
:class:`~pipeline.costmodel.factors.FactorProvider` builds one: the joint classes of its
member edges (``np.unique`` over the stacked class vectors), each member's table
gathered and added in graph-edge order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.solvers.mrf import MRF, PairwiseFactor

__all__ = ["StreamObjective", "Surrogate", "surrogate_mrf"]

Terms = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _weighted(comm: np.ndarray, w: float) -> np.ndarray:
    """``w * comm`` with ``+inf`` (a forbidden pair) kept for every ``w >= 0``."""
    return np.where(np.isinf(comm), np.inf, w * np.where(np.isinf(comm), 0.0, comm))


class _Terms:
    """Edge terms memoised by edge class (the copies of a repeated layer share them)."""

    def __init__(self, cost_model: Any, with_comm: bool = True):
        self.cm = cost_model
        self.cls = cost_model.edge_classes()
        self.with_comm = with_comm
        self.memo: dict[int, Terms] = {}

    def __call__(self, e: int) -> Terms:
        c = int(self.cls[e])
        hit = self.memo.get(c)
        if hit is None:
            hit = self.memo[c] = self.cm.edge_terms(e, comm=self.with_comm)
        return hit


def _group_factor(members: list[tuple[int, bool]],
                  table_of: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]]
                  ) -> PairwiseFactor:
    """The group factor of ``members`` (graph edge, flipped) with each member's
    ``(row_cls, col_cls, table)`` from ``table_of``."""
    rows, cols, tables = [], [], []
    for e, flipped in members:
        r, c, t = table_of(e)
        if flipped:
            r, c, t = c, r, t.T
        rows.append(r)
        cols.append(c)
        tables.append(t)
    if len(members) == 1:
        return PairwiseFactor(np.asarray(rows[0], np.int32), np.asarray(cols[0], np.int32),
                              np.ascontiguousarray(tables[0], dtype=np.float64))
    ur, rinv = np.unique(np.stack(rows, axis=1), axis=0, return_inverse=True)
    uc, cinv = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
    table = np.zeros((len(ur), len(uc)))
    for k, t in enumerate(tables):
        np.add(table, t[np.ix_(ur[:, k], uc[:, k])], out=table)
    return PairwiseFactor(rinv.reshape(-1).astype(np.int32), cinv.reshape(-1).astype(np.int32),
                          table)


class Surrogate:
    """The step-time surrogates of one base MRF (module docstring): :meth:`mrf` gives
    ``base`` with every graph edge's redistribution weighted by ``weight[e]``.

    A rebuilt group factor is the base factor's table plus ``(w_e - 1) comm_e`` of each
    member edge with ``w_e != 1``, gathered onto the base factor's joint classes (the
    classes :class:`~pipeline.costmodel.factors.FactorProvider` builds, recomputed from the
    member edges' class vectors and checked against the base factor's); a forbidden pair
    stays forbidden. The redistribution tables, joint classes and each member's table
    gathered onto them (``comm_e`` with a forbidden pair as 0) are memoised across calls
    (the rounds of a search re-weight the same edges): a later call only adds the
    weighted tables (llama1b 2x4x8: 2.1 s a call before the gathered tables were kept).
    The joint classes and gathered tables are keyed by the group edge's *signature*, its
    members' (edge class, flipped) in order: equal classes give equal ``(row_cls,
    col_cls, comm)`` (``CostModel.edge_classes``), hence equal joint classes and
    gathers, so the copies of a repeated layer share them (llama1b 2x4x8: 2,948 group
    edges re-weighted, one gather each before). Each group edge's own factor classes
    are still checked against them.
    """

    def __init__(self, base: MRF, cost_model: Any, groups: Any):
        self.base, self.cm, self.groups = base, cost_model, groups
        self.terms = _Terms(cost_model)
        self._joint: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._checked: set[int] = set()
        self._parts: dict[tuple[tuple, int], np.ndarray] = {}
        cls = cost_model.edge_classes()
        self._sig = [tuple((int(cls[e]), bool(flipped)) for e, flipped in members)
                     for members in groups.edge_members]

    def _part(self, ge: int, k: int, e: int, flipped: bool) -> np.ndarray:
        """Member ``k`` (graph edge ``e``) of group edge ``ge``: its redistribution
        table on the group factor's joint classes, a forbidden pair as 0 (it is +inf
        in the base table already). Shared by the group edges of one signature."""
        ur, uc = self._classes(ge)
        key = (self._sig[ge], k)
        hit = self._parts.get(key)
        if hit is None:
            comm = self.terms(e)[2]
            if flipped:
                comm = comm.T
            part = comm[np.ix_(ur[:, k], uc[:, k])]
            hit = self._parts[key] = np.where(np.isinf(part), 0.0, part)
        return hit

    def _classes(self, ge: int) -> tuple[np.ndarray, np.ndarray]:
        """Per member of group edge ``ge``, its row / column class within the joint
        classes (``[R, members]``, ``[C, members]``), checked (once per group edge)
        against the base factor's classes."""
        sig = self._sig[ge]
        hit = self._joint.get(sig)
        if hit is None:
            rows, cols = [], []
            for e, flipped in self.groups.edge_members[ge]:
                r, c = self.terms(e)[:2]
                rows.append(c if flipped else r)
                cols.append(r if flipped else c)
            if len(rows) == 1:
                ur = np.arange(int(np.max(rows[0])) + 1)[:, None]
                uc = np.arange(int(np.max(cols[0])) + 1)[:, None]
                rinv, cinv = rows[0], cols[0]
            else:
                ur, rinv = np.unique(np.stack(rows, axis=1), axis=0, return_inverse=True)
                uc, cinv = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
            hit = self._joint[sig] = (ur, uc, np.reshape(rinv, -1), np.reshape(cinv, -1))
        ur, uc, rinv, cinv = hit
        if ge not in self._checked:
            f = self.base.factor(ge)
            if not (np.array_equal(rinv, f.row_cls) and np.array_equal(cinv, f.col_cls)
                    and f.table.shape == (len(ur), len(uc))):
                raise RuntimeError(f"Surrogate: group edge {ge}: its member edges' classes "
                                   "differ from the base factor's")
            self._checked.add(ge)
        return ur, uc

    def mrf(self, weight: np.ndarray) -> MRF:
        """The surrogate MRF for ``weight`` (float64 ``[num graph edges]``, ``>= 0``).
        The linear rows are ``base``'s; it offers no table to share."""
        groups, base = self.groups, self.base
        weight = np.asarray(weight, dtype=np.float64)
        if weight.shape != (groups.num_graph_edges,) or (weight < 0).any():
            raise ValueError("Surrogate.mrf: one weight >= 0 per graph edge expected")
        changed = weight != 1.0
        factors: dict[int, PairwiseFactor] = {}
        for ge, members in enumerate(groups.edge_members):
            moved = [(k, e, flipped) for k, (e, flipped) in enumerate(members) if changed[e]]
            if not moved:
                continue
            f = base.factor(ge)
            table = np.array(f.table, dtype=np.float64, copy=True)
            for k, e, flipped in moved:
                table += (float(weight[e]) - 1.0) * self._part(ge, k, e, flipped)
            factors[ge] = PairwiseFactor(f.row_cls, f.col_cls, table)
        unary = list(base.unary)
        for g, inside in enumerate(groups.self_edges):
            for e in inside:
                if changed[e]:
                    r, c, comm = self.terms(e)[:3]
                    d = comm[r, c]
                    # an infinite entry is infinite in the base unary already
                    unary[g] = unary[g] + (float(weight[e]) - 1.0) * np.where(
                        np.isinf(d), 0.0, d)
        base_factor = base.factor
        return dataclasses.replace(
            base, unary=unary, share=None,
            factor=lambda ge: factors[ge] if ge in factors else base_factor(ge))


def surrogate_mrf(base: MRF, cost_model: Any, groups: Any, weight: np.ndarray) -> MRF:
    """``Surrogate(base, cost_model, groups).mrf(weight)`` (one surrogate)."""
    return Surrogate(base, cost_model, groups).mrf(weight)


class StreamObjective:
    """``theta * C(x) + comm_coef * M(x)`` over ``base``'s groups (module docstring),
    without linear rows (a relaxation of ``base``'s feasible set).

    The compute and fusion parts are built on creation; the redistribution parts on the
    first :meth:`mrf` with ``comm_coef > 0``; each later :meth:`mrf` only combines them.
    """

    def __init__(self, base: MRF, cost_model: Any, groups: Any):
        self.base, self.cm, self.groups = base, cost_model, groups
        cm = cost_model
        fusion = _Terms(cm, with_comm=False)

        def fusion_of(e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            r, c, _, _, fus = fusion(e)
            return r, c, fus

        def fuses(e: int) -> bool:
            return cm.fusion is not None and bool(cm.fusion.edge_key(e))

        self.fusing = [ge for ge, members in enumerate(groups.edge_members)
                       if any(fuses(e) for e, _ in members)]
        self.fusion = {ge: _group_factor(groups.edge_members[ge], fusion_of)
                       for ge in self.fusing}
        self.compute: list[np.ndarray] = []
        for g, mem in enumerate(groups.members):
            u = np.zeros(int(groups.domain[g]))
            for v in mem:
                inside = cm.op_comm(v)
                u = u + (cm.unary(v) if inside is None else cm.unary(v) - inside)
            for e in groups.self_edges[g]:
                if fuses(e):
                    r, c, t = fusion_of(e)
                    u = u + t[r, c]
            self.compute.append(np.where(np.isinf(base.unary[g]), np.inf, u))
        self.comm: list[PairwiseFactor] | None = None
        self.self_comm: list[np.ndarray] | None = None

    def _build_comm(self) -> None:
        terms = _Terms(self.cm)

        def comm_of(e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            r, c, comm, _, _ = terms(e)
            return r, c, comm

        self.comm = [_group_factor(members, comm_of) for members in self.groups.edge_members]
        self.self_comm = []
        for g, inside in enumerate(self.groups.self_edges):
            u = np.zeros(int(self.groups.domain[g]))
            for e in inside:
                r, c, t = comm_of(e)
                u = u + t[r, c]
            self.self_comm.append(u)

    def mrf(self, theta: float, comm_coef: float) -> MRF:
        """The MRF of ``theta * C + comm_coef * M`` (both coefficients ``>= 0``)."""
        if theta < 0 or comm_coef < 0:
            raise ValueError("StreamObjective.mrf: theta and comm_coef must be >= 0")
        base, groups = self.base, self.groups
        if comm_coef == 0:
            keep = self.fusing
            factors = [PairwiseFactor(f.row_cls, f.col_cls, theta * f.table)
                       for f in (self.fusion[ge] for ge in keep)]
            unary = [np.where(np.isinf(u), np.inf, theta * np.where(np.isinf(u), 0.0, u))
                     for u in self.compute]
            edges = np.asarray(groups.edges, dtype=np.int64)[keep].reshape(len(keep), 2)
            return MRF(domain_sizes=np.asarray(base.domain_sizes).copy(), unary=unary,
                       edges=edges, factor=factors.__getitem__)
        if self.comm is None:
            self._build_comm()
        factors = []
        for ge, f in enumerate(self.comm):
            table = _weighted(f.table, comm_coef)
            fus = self.fusion.get(ge)
            if fus is None:
                factors.append(PairwiseFactor(f.row_cls, f.col_cls, table))
                continue
            # both built from the same members' class vectors: the same joint classes
            if not (np.array_equal(f.row_cls, fus.row_cls)
                    and np.array_equal(f.col_cls, fus.col_cls)):
                raise RuntimeError(f"StreamObjective: group edge {ge}: the comm and fusion "
                                   "factors have different classes")
            factors.append(PairwiseFactor(f.row_cls, f.col_cls, table + theta * fus.table))
        unary = []
        for u, sc in zip(self.compute, self.self_comm):
            finite = np.where(np.isinf(u), 0.0, u)
            unary.append(np.where(np.isinf(u), np.inf, theta * finite + _weighted(sc, comm_coef)))
        return MRF(domain_sizes=np.asarray(base.domain_sizes).copy(), unary=unary,
                   edges=np.asarray(groups.edges, dtype=np.int64).copy(),
                   factor=factors.__getitem__)
