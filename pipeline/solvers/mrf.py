"""The pairwise Markov random field (MRF) handed to every solver.

The solvers never see torch.fx or DTensor objects (the Alpa design): the
topology and cost stages flatten the sharding problem into this structure.

Problem (groups are the nodes decided jointly, labels their joint strategies)::

    minimise  E(x) = constant + sum_g U_g(x_g) + sum_e B_e(x_u(e), x_v(e))
    over      x_g in {0, ..., K_g - 1} for every group g

* ``U_g`` is a float64 vector of length ``K_g`` (µs). ``+inf`` marks a
  forbidden label (e.g. a pinned placement excludes the others).
* ``B_e`` is stored *factored over placement classes*: every label of the
  producer group ``u`` maps to a row class, every label of ``v`` to a column
  class, and ``B_e(i, j) = table[row_cls[i], col_cls[j]]``. Classes are the
  distinct (output placement, expected input placement) combinations, so a
  table is small (tens of rows) even when domains hold hundreds of labels.
  ``+inf`` entries are forbidden pairs (illegal redistributions) and must be
  handled with masks, never turned into NaN.
* Edges are unique unordered pairs with ``u < v``; parallel graph edges and
  edges of repeated-layer copies are already accumulated into one factor.
* Pairwise factors may be lazy: ``factor(e)`` is called on demand and is
  expected to memoise, so solvers call it freely.
* ``linear_constraints`` are optional rows ``low <= sum_g coef_g[x_g] <= high``
  (e.g. the parameter-memory budget); solvers that cannot honour them
  natively (TRW-S) are wrapped in Lagrangian relaxation
  (pipeline/solvers/lagrangian.py, any number of rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PairwiseFactor:
    """One pairwise factor ``B_e`` in placement-class form.

    Attributes:
        row_cls: int32 ``[K_u]``, class of each label of the lower group ``u``.
        col_cls: int32 ``[K_v]``, class of each label of the higher group ``v``.
        table: float64 ``[R, C]`` cost in µs; ``+inf`` = forbidden pair.
    """

    row_cls: np.ndarray
    col_cls: np.ndarray
    table: np.ndarray

    def dense(self) -> np.ndarray:
        """Return the dense ``[K_u, K_v]`` matrix (for tests and small ILPs)."""
        return self.table[np.ix_(self.row_cls, self.col_cls)]

    def transposed(self) -> PairwiseFactor:
        """The same factor seen from ``v`` to ``u``."""
        return PairwiseFactor(self.col_cls, self.row_cls, np.ascontiguousarray(self.table.T))


@dataclass(frozen=True)
class LinearConstraint:
    """A row ``low <= sum_g coef[g][x_g] <= high`` over group labels.

    Attributes:
        name: identifier used in error messages and reports.
        coef: mapping group index -> float64 ``[K_g]`` coefficient per label.
        low, high: bounds; ``-inf`` / ``+inf`` for a one-sided row.
    """

    name: str
    coef: dict[int, np.ndarray]
    low: float
    high: float


#: Relative tolerance of a row check: ``low - tol <= g(x) <= high + tol`` with
#: ``tol = ROW_RTOL * max(1, |low|, |high|)`` over the finite bounds.
ROW_RTOL = 1e-9


def row_value(row: LinearConstraint, labels: np.ndarray) -> float:
    """``g(labels) = sum_g coef[g][labels[g]]``, summed in increasing group order."""
    return float(sum(float(c[labels[g]]) for g, c in sorted(row.coef.items())))


def row_tolerance(row: LinearConstraint) -> float:
    """Absolute tolerance of ``row``'s bounds (see :data:`ROW_RTOL`)."""
    return ROW_RTOL * max([1.0] + [abs(v) for v in (row.low, row.high) if math.isfinite(v)])


def row_holds(row: LinearConstraint, value: float | np.ndarray) -> bool | np.ndarray:
    """Whether ``value`` (a row value, or an array of them) satisfies ``row``."""
    tol = row_tolerance(row)
    return (value >= row.low - tol) & (value <= row.high + tol)


@dataclass
class MRF:
    """A pairwise MRF over groups; see the module docstring for the maths.

    Attributes:
        domain_sizes: int64 ``[G]`` label count ``K_g`` per group (all >= 1).
        unary: list of ``G`` float64 arrays, ``unary[g].shape == (K_g,)``.
        edges: int64 ``[E, 2]``; row ``e`` is ``(u, v)`` with ``u < v``.
        factor: ``factor(e) -> PairwiseFactor`` for edge ``e`` (may be lazy and
            memoised by the provider).
        constant: objective offset in µs (factors folded away by the builder).
        linear_constraints: optional side constraints (see LinearConstraint).
        share: optional ``share(e, table)``: a solver that holds an equal copy of
            ``factor(e).table`` (same shape and values, read-only) offers it, so a
            memoising provider may keep that copy instead of its own (one copy of
            the tables in memory); None: nothing is offered.
    """

    domain_sizes: np.ndarray
    unary: list[np.ndarray]
    edges: np.ndarray
    factor: Callable[[int], PairwiseFactor]
    constant: float = 0.0
    linear_constraints: list[LinearConstraint] = field(default_factory=list)
    share: Callable[[int, np.ndarray], None] | None = None

    @property
    def num_groups(self) -> int:
        return int(self.domain_sizes.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.edges.shape[0])

    def evaluate(self, labels: np.ndarray) -> float:
        """Return ``E(labels)`` (µs; ``+inf`` if any chosen entry is forbidden).

        Summation order is fixed (constant, unaries by group, pairwise by edge)
        so the value is bit-identical across processes.
        """
        total = float(self.constant)
        for g in range(self.num_groups):
            total += float(self.unary[g][labels[g]])
        for e in range(self.num_edges):
            u, v = self.edges[e]
            f = self.factor(e)
            total += float(f.table[f.row_cls[labels[u]], f.col_cls[labels[v]]])
        return total


def eager_factors(factors: list[PairwiseFactor]) -> Callable[[int], PairwiseFactor]:
    """Wrap a precomputed factor list as the ``MRF.factor`` callable."""
    return factors.__getitem__
