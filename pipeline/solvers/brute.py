"""Exact minimisation of a small MRF by enumeration (the test oracle).

Builds the full energy tensor of shape ``(K_0, ..., K_{G-1})`` by
broadcasting (constant + unaries + dense pairwise matrices) and takes its
argmin. Ties go to the lexicographically smallest labelling (C order).
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.solvers.errors import InfeasibleError
from pipeline.solvers.mrf import MRF

#: Default cap on the number of joint labellings (float64 tensor of 16 MB).
MAX_JOINT_LABELS = 2_000_000


def brute_force(mrf: MRF, max_joint_labels: int = MAX_JOINT_LABELS) -> tuple[np.ndarray, float]:
    """Return ``(labels, energy)`` of a minimum-energy labelling.

    Args:
        mrf: the problem; ``linear_constraints`` are ignored (unconstrained
            minimum), like TRW-S.
        max_joint_labels: refuse problems with more joint labellings.

    Returns:
        labels: int64 ``[G]``; energy: ``mrf.evaluate(labels)`` (µs).

    Raises:
        ValueError: ``prod(K_g) > max_joint_labels``.
        InfeasibleError: every labelling has energy ``+inf``.
    """
    sizes = [int(k) for k in mrf.domain_sizes]
    total = math.prod(sizes)
    if total > max_joint_labels:
        raise ValueError(
            f"brute_force: {total} joint labellings exceed max_joint_labels={max_joint_labels}"
        )
    n = len(sizes)
    energy = np.full(sizes, float(mrf.constant), dtype=np.float64)
    for g in range(n):
        shape = [1] * n
        shape[g] = sizes[g]
        energy = energy + np.asarray(mrf.unary[g], dtype=np.float64).reshape(shape)
    for e in range(mrf.num_edges):
        u, v = (int(x) for x in mrf.edges[e])
        shape = [1] * n
        shape[u] = sizes[u]
        shape[v] = sizes[v]
        energy = energy + mrf.factor(e).dense().reshape(shape)
    flat = int(np.argmin(energy)) if energy.size else 0
    if energy.size and not np.isfinite(energy.flat[flat]):
        raise InfeasibleError("brute_force: every labelling has energy +inf")
    labels = np.array(np.unravel_index(flat, sizes), dtype=np.int64).reshape(n)
    return labels, mrf.evaluate(labels)
