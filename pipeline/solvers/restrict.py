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
leave most groups one label). Factors are cut on first use and memoised.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pipeline.solvers.mrf import MRF, LinearConstraint, PairwiseFactor

__all__ = ["Restriction", "restrict"]


@dataclass
class Restriction:
    """The restricted MRF (``mrf``) and, per group, its kept labels (``keep``)."""

    mrf: MRF
    keep: list[np.ndarray]

    def expand(self, labels: np.ndarray) -> np.ndarray:
        """The original labels of a labelling of the restricted MRF."""
        y = np.asarray(labels, dtype=np.int64)
        return np.array([int(k[i]) for k, i in zip(self.keep, y.tolist())], dtype=np.int64)


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
    unary = [np.asarray(u, dtype=np.float64)[k] for u, k in zip(mrf.unary, kept)]
    rows = [LinearConstraint(r.name, {g: np.asarray(c)[kept[g]] for g, c in r.coef.items()},
                             r.low, r.high) for r in mrf.linear_constraints]
    memo: dict[int, PairwiseFactor] = {}
    base_factor = mrf.factor

    def factor(e: int) -> PairwiseFactor:
        hit = memo.get(e)
        if hit is None:
            u, v = (int(x) for x in mrf.edges[e])
            f = base_factor(e)
            if len(kept[u]) == int(sizes[u]) and len(kept[v]) == int(sizes[v]):
                hit = f
            else:
                ur, rc = _cut(f.row_cls, kept[u])
                uc, cc = _cut(f.col_cls, kept[v])
                hit = PairwiseFactor(rc, cc, np.ascontiguousarray(f.table[np.ix_(ur, uc)]))
            memo[e] = hit
        return hit

    out = dataclasses.replace(
        mrf, domain_sizes=np.array([len(k) for k in kept], dtype=np.int64), unary=unary,
        factor=factor, linear_constraints=rows, share=None)
    return Restriction(out, kept)
