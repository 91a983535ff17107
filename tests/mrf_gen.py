"""Random pairwise MRFs in placement-class form, for solver tests and benchmarks.

Every generator takes a ``numpy.random.Generator`` and is deterministic given
it. Forbidden (``+inf``) entries are placed so that a hidden labelling stays
feasible (``feasible=True``): the unary of its label and the table entry of
its class pair are never forbidden.
"""

from __future__ import annotations

import numpy as np

from pipeline.solvers.mrf import MRF, PairwiseFactor, eager_factors


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
    feasible: bool = True,
    constant: float = 0.0,
    scale: float = 10.0,
) -> MRF:
    """A random MRF on ``edges`` with domains in ``[kmin, kmax]``.

    Row/column class maps are random surjections-or-not onto ``R <= K``
    classes (unused classes allowed, to exercise compaction); tables and
    unaries are uniform in ``[0, scale)``. A fraction ``inf_frac`` of unary and
    table entries is ``+inf``, except on a hidden labelling when ``feasible``.
    """
    sizes = rng.integers(kmin, kmax + 1, size=n).astype(np.int64)
    hidden = np.array([rng.integers(0, k) for k in sizes], dtype=np.int64)
    unary = []
    for g in range(n):
        u = rng.random(sizes[g]) * scale
        mask = rng.random(sizes[g]) < inf_frac
        if feasible:
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
        table = rng.random((r, c)) * scale
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
    )


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


def large_instance(
    rng: np.random.Generator,
    n: int = 3000,
    m: int = 6000,
    kmax: int = 300,
    classes: int = 30,
) -> MRF:
    """The benchmark-sized instance: ~``n`` groups, ``m`` edges, domains up to
    ``kmax``, class tables up to ``classes x classes``, a few forbidden pairs.
    Domain sizes are log-uniform in ``[1, kmax]`` (many small, some large)."""
    edges = graph_like_edges(rng, n, m)
    sizes = np.exp(rng.uniform(0, np.log(kmax), size=n)).astype(np.int64).clip(1, kmax)
    unary = [rng.random(k) * 100.0 for k in sizes]
    factors = []
    for u, v in edges:
        ku, kv = int(sizes[u]), int(sizes[v])
        r, c = min(ku, classes), min(kv, classes)
        row_cls = (np.arange(ku) % r).astype(np.int32)
        col_cls = (np.arange(kv) % c).astype(np.int32)
        table = rng.random((r, c)) * 50.0
        np.fill_diagonal(table, 0.0)
        table[(rng.random((r, c)) < 0.05) & (table > 0)] = np.inf
        factors.append(PairwiseFactor(row_cls, col_cls, table))
    return MRF(
        domain_sizes=sizes,
        unary=unary,
        edges=edges,
        factor=eager_factors(factors),
    )
