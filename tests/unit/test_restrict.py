"""A domain restriction of an MRF, compacted (pipeline/solvers/restrict.py): checked
against brute force on small random MRFs with loops, forbidden labels and pairs, and a
linear row: every labelling of the restricted MRF has the energy and row value of its
expansion, and its optimum is the original's optimum over the kept labels."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from mrf_gen import loopy_mrf, optimum, random_rows

from pipeline.solvers.mrf import row_holds, row_value
from pipeline.solvers.restrict import restrict


def _keep(rng, mrf):
    keep = {}
    for g, k in enumerate(mrf.domain_sizes.tolist()):
        if rng.random() < 0.6:
            n = int(rng.integers(1, k + 1))
            keep[g] = sorted(rng.choice(k, size=n, replace=False).tolist())
    return keep


@pytest.mark.parametrize("seed", range(24))
def test_restriction_is_the_original_on_the_kept_labels(seed):
    rng = np.random.default_rng(seed)
    mrf = loopy_mrf(seed, 5, inf_frac=0.1, unary_inf_frac=0.1)
    if seed % 2:
        mrf.linear_constraints = random_rows(rng, mrf.domain_sizes, ["upper"])
    keep = _keep(rng, mrf)
    r = restrict(mrf, keep)
    sub = r.mrf
    # the groups left one label are conditioned out
    sizes = [len(keep.get(g, range(k))) for g, k in enumerate(mrf.domain_sizes.tolist())]
    assert sub.domain_sizes.tolist() == [n for n in sizes if n > 1] or (
        max(sizes) == 1 and sub.domain_sizes.tolist() == [1])
    # every restricted labelling: same energy and row values as its expansion
    best = math.inf
    for lab in itertools.product(*[range(int(k)) for k in sub.domain_sizes]):
        y = np.asarray(lab, dtype=np.int64)
        x = r.expand(y)
        assert all(x[g] in keep[g] for g in keep)
        e_sub, e = sub.evaluate(y), mrf.evaluate(x)
        assert e_sub == pytest.approx(e, rel=1e-12) or (math.isinf(e_sub) and math.isinf(e))
        for rs, ro in zip(sub.linear_constraints, mrf.linear_constraints):
            # the fixed groups' part moved into the bounds
            assert row_value(rs, y) - rs.high == pytest.approx(row_value(ro, x) - ro.high,
                                                              abs=1e-9)
        if all(row_holds(ro, row_value(ro, x)) for ro in mrf.linear_constraints):
            best = min(best, e)
    # the restricted optimum (brute force) is the original's over the kept labels
    assert optimum(sub) == pytest.approx(best, rel=1e-12) or math.isinf(best)
    # ... which is never below the unrestricted optimum
    assert optimum(mrf) <= best


def test_restrict_refuses_an_empty_or_foreign_label_set():
    mrf = loopy_mrf(0, 4)
    with pytest.raises(ValueError, match="group 1"):
        restrict(mrf, {1: []})
    with pytest.raises(ValueError, match="group 0"):
        restrict(mrf, {0: [int(mrf.domain_sizes[0])]})
