"""A domain restriction of an MRF, compacted: the labels kept, renumbered.

Given, for some groups, the labels to keep (``keep[g]``, sorted; the others kept whole),
:func:`restrict` returns the MRF over the kept labels only and the map back. For every
labelling ``y`` of the restricted MRF, with ``x_g = keep[g][y_g]``::

    E'(y) = constant + sum_g U_g(x_g) + sum_e T_e[r_e(x_u), c_e(x_v)] = E(x)

since the unaries and the label -> class maps are indexed through ``keep`` and each edge
table is cut to the classes its kept labels use (``T'_e = T_e[used rows, used cols]``,
the classes renumbered); linear rows take their coefficients through ``keep`` too. So
the restricted problem is the original one with every other label forbidden, and it is
smaller: the solvers' work grows with the labels and the table entries (a recipe's pins
leave most groups one label). A group left one label is conditioned out (its label is
fixed): its unary and the edges between fixed groups go into the constant, an edge to a
free group ``v`` into ``v``'s unary (``T_e[r_e(x_u), c_e(.)]``), and a row's bounds move
by the fixed groups' coefficients (``low - c``, ``high - c``); the energy and the row
values are unchanged. Factors are cut on first use and memoised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline.solvers.mrf import MRF, LinearConstraint, PairwiseFactor

__all__ = ["Restriction", "restrict"]


@dataclass
class Restriction:
    """The restricted MRF (``mrf``, over the groups ``free``: the groups left more than
    one label), per original group its kept labels (``keep``)."""

    mrf: MRF
    keep: list[np.ndarray]
    free: np.ndarray

    def expand(self, labels: np.ndarray) -> np.ndarray:
        """The original labels of a labelling of the restricted MRF."""
        y = np.asarray(labels, dtype=np.int64)
        x = np.array([int(k[0]) for k in self.keep], dtype=np.int64)
        for i, g in enumerate(self.free.tolist()):
            x[g] = int(self.keep[g][y[i]])
        return x


def _cut(cls: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(classes used by the kept labels, the kept labels' renumbered classes)."""
    used, inverse = np.unique(np.asarray(cls)[keep], return_inverse=True)
    return used, inverse.reshape(-1).astype(np.int32)


def restrict(mrf: MRF, keep: dict[int, np.ndarray | list[int]]) -> Restriction:
    """Restrict ``mrf`` to the labels ``keep[g]`` of each group ``g`` it names (module
    docstring). Raises ValueError for an empty or out-of-range label set."""
    sizes = np.asarray(mrf.domain_sizes, dtype=np.int64)
    kept: list[np.ndarray] = []
    for g in range(mrf.num_groups):
        if g in keep:
            k = np.unique(np.asarray(keep[g], dtype=np.int64))
            if k.size == 0 or k[0] < 0 or k[-1] >= sizes[g]:
                raise ValueError(f"restrict: group {g}: labels {list(keep[g])[:5]} not a "
                                 f"non-empty subset of 0..{int(sizes[g]) - 1}")
        else:
            k = np.arange(int(sizes[g]), dtype=np.int64)
        kept.append(k)
    free = np.array([g for g, k in enumerate(kept) if len(k) > 1] or [0], dtype=np.int64)
    index = np.full(mrf.num_groups, -1, dtype=np.int64)
    index[free] = np.arange(len(free))
    constant = float(mrf.constant)
    unary = [np.asarray(mrf.unary[g], dtype=np.float64)[kept[g]] for g in free.tolist()]
    for g in range(mrf.num_groups):
        if index[g] < 0:
            constant += float(mrf.unary[g][kept[g][0]])
    edges, origin = [], []
    for e in range(mrf.num_edges):
        u, v = (int(x) for x in mrf.edges[e])
        if index[u] >= 0 and index[v] >= 0:
            edges.append((int(index[u]), int(index[v])))
            origin.append(e)
            continue
        f = mrf.factor(e)
        if index[u] < 0 and index[v] < 0:  # both fixed: a constant
            constant += float(f.table[f.row_cls[kept[u][0]], f.col_cls[kept[v][0]]])
        elif index[u] < 0:  # u fixed: a unary term of v
            unary[index[v]] = unary[index[v]] + f.table[f.row_cls[kept[u][0]],
                                                         f.col_cls[kept[v]]]
        else:
            unary[index[u]] = unary[index[u]] + f.table[f.row_cls[kept[u]],
                                                         f.col_cls[kept[v][0]]]
    rows = []
    for r in mrf.linear_constraints:
        fixed = math.fsum(float(c[kept[g][0]]) for g, c in r.coef.items() if index[g] < 0)
        rows.append(LinearConstraint(
            r.name, {int(index[g]): np.asarray(c)[kept[g]] for g, c in r.coef.items()
                     if index[g] >= 0}, r.low - fixed, r.high - fixed))
    memo: dict[int, PairwiseFactor] = {}
    base_factor = mrf.factor

    def factor(i: int) -> PairwiseFactor:
        hit = memo.get(i)
        if hit is None:
            e = origin[i]
            u, v = (int(x) for x in mrf.edges[e])
            f = base_factor(e)
            if len(kept[u]) == int(sizes[u]) and len(kept[v]) == int(sizes[v]):
                hit = f
            else:
                ur, rc = _cut(f.row_cls, kept[u])
                uc, cc = _cut(f.col_cls, kept[v])
                hit = PairwiseFactor(rc, cc, np.ascontiguousarray(f.table[np.ix_(ur, uc)]))
            memo[i] = hit
        return hit

    out = MRF(domain_sizes=np.array([len(kept[g]) for g in free.tolist()], dtype=np.int64),
              unary=unary, edges=np.asarray(edges, dtype=np.int64).reshape(len(edges), 2),
              factor=factor, constant=constant, linear_constraints=rows)
    return Restriction(out, kept, free)
