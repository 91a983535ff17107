"""Random pairwise MRFs in placement-class form and brute-force oracles, for the
solver tests (test_trws, test_ilp, test_pruning, test_progress, ...) and benchmarks.

Every generator takes a ``numpy.random.Generator`` and is deterministic given
it. :func:`random_mrf` is the one small-instance generator: forbidden (``+inf``)
entries are placed so that a hidden labelling stays feasible (``feasible=True``):
the unary of its label and the table entry of its class pair are never
forbidden; optional linear rows (:func:`random_rows`) come last, so instances
without rows do not depend on them. :func:`step_sized_mrf` is the large,
benchmark-sized one.

Oracles (exact, by enumeration; :func:`pipeline.solvers.brute.brute_force`
honours the rows): :func:`optimum`, :func:`feasible_labellings`,
:func:`min_marginals`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np

from pipeline.solvers.brute import brute_force, feasible_mask
from pipeline.solvers.errors import InfeasibleError
from pipeline.solvers.mrf import MRF, LinearConstraint, PairwiseFactor, eager_factors


def chain_edges(n: int) -> np.ndarray:
    """Edges of the path ``0 - 1 - ... - n-1``, int64 ``[n-1, 2]``."""
    return np.stack([np.arange(n - 1), np.arange(1, n)], axis=1).astype(np.int64)


def tree_edges(rng: np.random.Generator, n: int) -> np.ndarray:
    """A random tree: every group ``v > 0`` links to a random earlier group."""
    if n < 2:
        return np.zeros((0, 2), dtype=np.int64)
    parents = np.array([rng.integers(0, v) for v in range(1, n)])
    return np.stack([parents, np.arange(1, n)], axis=1).astype(np.int64)


def random_edges(rng: np.random.Generator, n: int, m: int) -> np.ndarray:
    """``m`` distinct random pairs ``u < v`` (fewer if the graph is complete)."""
    pairs = [(u, v) for u in range(n) for v in range(u + 1, n)]
    m = min(m, len(pairs))
    pick = rng.choice(len(pairs), size=m, replace=False)
    return np.array(sorted(pairs[i] for i in pick), dtype=np.int64).reshape(-1, 2)


def random_mrf(
    rng: np.random.Generator,
    n: int,
    edges: np.ndarray,
    *,
    kmin: int = 2,
    kmax: int = 5,
    max_classes: int | None = None,
    inf_frac: float = 0.0,
    unary_inf_frac: float | None = None,
    feasible: bool = True,
    unary_feasible: bool | None = None,
    integer_costs: bool = False,
    constant: float = 0.0,
    scale: float = 10.0,
    rows: Sequence[str] = (),
) -> MRF:
    """A random MRF on ``edges`` with domains in ``[kmin, kmax]``.

    Row/column class maps are random surjections-or-not onto ``R <= K``
    classes (unused classes allowed, to exercise compaction; classes shared by
    several labels make the tables smaller than the dense matrices); tables and
    unaries are uniform in ``[0, scale)``, or integers in ``[0, 6)`` with
    ``integer_costs`` (ties, i.e. several optima, become common). A fraction
    ``inf_frac`` of table entries and ``unary_inf_frac`` (default ``inf_frac``)
    of unary entries is ``+inf``, except on a hidden labelling: its pairs when
    ``feasible``, its unary labels when ``unary_feasible`` (default ``feasible``;
    ``feasible=False, unary_feasible=True`` keeps an allowed label in every group
    while pairs may still make the instance infeasible). ``rows``: linear rows
    appended by :func:`random_rows` (e.g. ``("upper", "lower")``).
    """
    u_frac = inf_frac if unary_inf_frac is None else unary_inf_frac
    u_feasible = feasible if unary_feasible is None else unary_feasible

    def costs(shape: int | tuple[int, int]) -> np.ndarray:
        if integer_costs:
            return rng.integers(0, 6, size=shape).astype(np.float64)
        return rng.random(shape) * scale

    sizes = rng.integers(kmin, kmax + 1, size=n).astype(np.int64)
    hidden = np.array([rng.integers(0, k) for k in sizes], dtype=np.int64)
    unary = []
    for g in range(n):
        u = costs(int(sizes[g]))
        mask = rng.random(sizes[g]) < u_frac
        if u_feasible:
            mask[hidden[g]] = False
        u[mask] = np.inf
        unary.append(u)
    factors = []
    for u, v in edges:
        ku, kv = int(sizes[u]), int(sizes[v])
        cap_r = ku if max_classes is None else min(ku, max_classes)
        cap_c = kv if max_classes is None else min(kv, max_classes)
        r = int(rng.integers(1, cap_r + 1))
        c = int(rng.integers(1, cap_c + 1))
        row_cls = rng.integers(0, r, size=ku).astype(np.int32)
        col_cls = rng.integers(0, c, size=kv).astype(np.int32)
        table = costs((r, c))
        mask = rng.random((r, c)) < inf_frac
        if feasible:
            mask[row_cls[hidden[u]], col_cls[hidden[v]]] = False
        table[mask] = np.inf
        factors.append(PairwiseFactor(row_cls, col_cls, table))
    return MRF(
        domain_sizes=sizes,
        unary=unary,
        edges=np.asarray(edges, dtype=np.int64).reshape(-1, 2),
        factor=eager_factors(factors),
        constant=constant,
        linear_constraints=random_rows(rng, sizes, rows),
    )


def random_rows(rng: np.random.Generator, sizes: np.ndarray,
                sides: Sequence[str]) -> list[LinearConstraint]:
    """One row per entry of ``sides`` over every group, integer coefficients in
    ``[0, 4)`` per label (like a memory weight); the bound is the sum of the
    groups' mean coefficients, so a row binds for some instances and not others.
    ``"upper"``: ``g(x) <= bound``; ``"lower"``: ``g(x) >= bound``."""
    out = []
    for i, side in enumerate(sides):
        coef = {g: rng.integers(0, 4, size=int(k)).astype(np.float64)
                for g, k in enumerate(sizes)}
        bound = float(sum(c.mean() for c in coef.values()))
        if side == "upper":
            out.append(LinearConstraint(f"row{i}", coef, -math.inf, bound))
        elif side == "lower":
            out.append(LinearConstraint(f"row{i}", coef, bound, math.inf))
        else:
            raise ValueError(f"side={side!r}: allowed 'upper', 'lower'")
    return out


def graph_like_edges(rng: np.random.Generator, n: int, m: int, window: int = 40) -> np.ndarray:
    """A sparse DAG-like edge set resembling a traced training graph.

    Group ``v`` links to ``v - 1`` (the main data path) and the remaining
    edges join ``v`` to a random earlier group, mostly within ``window``
    (local operands), sometimes anywhere (parameters / saved activations
    read by the backward pass). Returns about ``m`` unique pairs ``u < v``.
    """
    pairs = {(v - 1, v) for v in range(1, n)}
    while len(pairs) < m:
        v = int(rng.integers(2, n))
        if rng.random() < 0.8:
            u = int(rng.integers(max(0, v - window), v - 1))
        else:
            u = int(rng.integers(0, v - 1))
        pairs.add((u, v))
    return np.array(sorted(pairs), dtype=np.int64)


def step_sized_mrf(
    num_groups: int = 3000,
    num_edges: int = 6000,
    dom: tuple[int, int] = (100, 300),
    cls: tuple[int, int] = (24, 36),
    p_inf: float = 0.05,
    seed: int = 0,
) -> MRF:
    """Step-sized random MRF (the benchmark instance): unaries 10..1000 µs, tables
    0..500 µs (0 on the diagonal = matching placements), ``p_inf`` forbidden pairs,
    a chain backbone plus random extra edges; domains in ``dom``, classes per group
    in ``cls``."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(dom[0], dom[1] + 1, size=num_groups)
    ncls = rng.integers(cls[0], cls[1] + 1, size=num_groups)
    cls_of = [rng.integers(0, ncls[g], sizes[g]).astype(np.int32) for g in range(num_groups)]
    unary = [rng.uniform(10.0, 1000.0, sizes[g]) for g in range(num_groups)]
    pairs = {(g, g + 1) for g in range(num_groups - 1)}
    while len(pairs) < num_edges:
        u, v = sorted(rng.integers(0, num_groups, 2).tolist())
        if u != v:
            pairs.add((u, v))
    edges = np.array(sorted(pairs), dtype=np.int64)
    factors = []
    for u, v in edges:
        r, c = ncls[u], ncls[v]
        t = rng.uniform(0.0, 500.0, (r, c))
        t[rng.random((r, c)) < p_inf] = np.inf
        d = min(r, c)
        t[np.arange(d), np.arange(d)] = 0.0
        factors.append(PairwiseFactor(cls_of[u], cls_of[v], t))
    return MRF(sizes.astype(np.int64), unary, edges, eager_factors(factors))


# --------------------------------------------------------------------------- oracles


def optimum(mrf: MRF) -> float:
    """``min E`` over the labellings satisfying every row (brute force); ``+inf``
    when there is none."""
    try:
        return brute_force(mrf).objective
    except InfeasibleError:
        return math.inf


def feasible_labellings(mrf: MRF) -> Iterator[tuple[np.ndarray, float]]:
    """Every labelling that satisfies the rows, with its energy (possibly ``+inf``),
    in lexicographic order."""
    ok = feasible_mask(mrf)
    for lab in itertools.product(*[range(int(k)) for k in mrf.domain_sizes]):
        if ok[lab]:
            lab = np.asarray(lab, dtype=np.int64)
            yield lab, mrf.evaluate(lab)


def min_marginals(mrf: MRF) -> list[np.ndarray]:
    """Exact ``min {E(x) : x satisfies the rows, x_g = k}`` per group and label
    (``+inf`` if none)."""
    mm = [np.full(int(k), math.inf) for k in mrf.domain_sizes]
    for lab, e in feasible_labellings(mrf):
        for g, k in enumerate(lab):
            mm[g][k] = min(mm[g][k], e)
    return mm


def loopy_mrf(seed: int, n: int = 5, *, edge_frac: float = 0.6, kmin: int = 2, kmax: int = 4,
              max_classes: int = 3, inf_frac: float = 0.1, unary_inf_frac: float = 0.1,
              integer_costs: bool = True, rows: Sequence[str] = ()) -> MRF:
    """A small loopy instance for the exact solvers: :func:`random_mrf` on
    ``round(edge_frac * n (n - 1) / 2)`` random edges, integer costs (ties), shared
    classes, forbidden labels (never all of a group) and forbidden pairs (so some
    instances are infeasible), constant 2.5; ``rows`` as in :func:`random_rows`."""
    rng = np.random.default_rng(seed)
    edges = random_edges(rng, n, round(edge_frac * n * (n - 1) / 2))
    return random_mrf(rng, n, edges, kmin=kmin, kmax=kmax, max_classes=max_classes,
                      inf_frac=inf_frac, unary_inf_frac=unary_inf_frac, feasible=False,
                      unary_feasible=True, integer_costs=integer_costs, constant=2.5,
                      rows=rows)
