"""Exact label pruning (pipeline/solvers/pruning.py): the per-label bounds are
checked against brute-force enumeration on small random MRFs with loops,
forbidden labels/pairs and ties, with TRW-S messages and with arbitrary ones,
with and without a parameter-memory-like row; pruning never changes the optimum.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mrf_gen import feasible_labellings, loopy_mrf, min_marginals

from pipeline.solvers.lagrangian import solve_with_row, solve_with_rows
from pipeline.solvers.pruning import label_bounds, prune
from pipeline.solvers.trws import solve_trws


def _assert_valid(bounds, mm):
    for g, (b, m) in enumerate(zip(bounds, mm)):
        finite = np.isfinite(m)
        # a bound never exceeds the true min-marginal (1e-9: float noise of the sums)
        assert (b[finite] <= m[finite] + 1e-9).all(), (g, b, m)


@pytest.mark.parametrize("seed", range(48))
def test_trws_label_bounds_are_valid(seed):
    mrf = loopy_mrf(seed, 6, integer_costs=seed % 2 == 0, inf_frac=0.05, unary_inf_frac=0.05)
    mm = min_marginals(mrf)
    if not any(np.isfinite(m).any() for m in mm):
        pytest.skip("infeasible instance")
    res = solve_trws(mrf, label_bounds=True)
    _assert_valid(res.label_bounds, mm)
    # the incumbent's own labels are never pruned, and neither is any optimum
    opt = min(e for _, e in feasible_labellings(mrf))
    reduced, stats = prune(mrf, res.label_bounds, res.objective)
    assert stats.labels_after <= stats.labels_before
    assert all(math.isfinite(reduced.unary[g][k]) for g, k in enumerate(res.labels))
    assert min(e for _, e in feasible_labellings(reduced)) == pytest.approx(opt, abs=1e-9)
    for lab, e in feasible_labellings(mrf):
        if e <= opt + 1e-12:
            assert math.isfinite(reduced.evaluate(lab))


@pytest.mark.parametrize("seed", range(26))
def test_bounds_hold_for_arbitrary_messages(seed):
    """Any finite (or +inf, taken as 0) vectors give an exact reparametrisation."""
    rng = np.random.default_rng(1000 + seed)
    mrf = loopy_mrf(seed, 5, inf_frac=0.05, unary_inf_frac=0.05)
    mm = min_marginals(mrf)
    if not any(np.isfinite(m).any() for m in mm):
        pytest.skip("infeasible instance")
    facs = [mrf.factor(e) for e in range(mrf.num_edges)]
    rows = [rng.normal(0, 5, f.table.shape[0]) for f in facs]
    cols = [rng.normal(0, 5, f.table.shape[1]) for f in facs]
    if rows:
        rows[0][0] = math.inf
    b = label_bounds(mrf.unary, mrf.edges, [f.row_cls for f in facs],
                     [f.col_cls for f in facs], [f.table for f in facs], rows, cols,
                     mrf.constant)
    _assert_valid(b, mm)


def test_bounds_are_tight_on_a_chain_at_convergence():
    """On a chain TRW-S is exact; the bound of the optimum's labels is the optimum,
    worked out here by hand: E = u0 + u1 + T with u0 = (0, 3), u1 = (2, 0),
    T = [[5, 0], [0, 5]] -> E(0,0)=7, E(0,1)=0, E(1,0)=5, E(1,1)=8."""
    from pipeline.solvers.mrf import MRF, PairwiseFactor, eager_factors

    f = PairwiseFactor(np.array([0, 1], np.int32), np.array([0, 1], np.int32),
                       np.array([[5.0, 0.0], [0.0, 5.0]]))
    mrf = MRF(np.array([2, 2]), [np.array([0.0, 3.0]), np.array([2.0, 0.0])],
              np.array([[0, 1]]), eager_factors([f]))
    res = solve_trws(mrf, label_bounds=True)
    assert res.objective == 0.0 and list(res.labels) == [0, 1]
    # on a single edge the star bound (**) is the exact min-marginal
    b0, b1 = res.label_bounds
    assert list(b0) == pytest.approx([0.0, 5.0]) and list(b1) == pytest.approx([5.0, 0.0])
    _, stats = prune(mrf, res.label_bounds, 4.0)  # an incumbent of 4 drops both 5s
    assert (stats.labels_before, stats.labels_after) == (4, 2)
    _, stats = prune(mrf, res.label_bounds, 5.0)
    assert stats.labels_after == 4


@pytest.mark.parametrize("seed", range(32))
def test_lagrangian_bounds_are_valid_for_feasible_labellings(seed):
    mrf = loopy_mrf(seed, 5, rows=("upper",), inf_frac=0.05, unary_inf_frac=0.05)
    mm = min_marginals(mrf)
    if not any(np.isfinite(m).any() for m in mm):
        pytest.skip("infeasible instance")
    (row,) = mrf.linear_constraints
    try:
        res = solve_with_row(mrf, row, lambda m: solve_trws(m, label_bounds=True))
    except Exception as exc:  # noqa: BLE001 - only the no-plan case is acceptable
        assert "no labelling" in str(exc)
        return
    _assert_valid(res.label_bounds, mm)
    opt = min(e for _, e in feasible_labellings(mrf))
    reduced, _ = prune(mrf, res.label_bounds, res.objective)
    assert min(e for _, e in feasible_labellings(reduced)) == pytest.approx(opt, abs=1e-9)


@pytest.mark.parametrize("seed", range(16))
def test_two_row_lagrangian_bounds_are_valid_for_feasible_labellings(seed):
    """Label bounds of the multi-row search (several multipliers, each solve shifted by
    its own offset) are valid for every labelling satisfying both rows."""
    mrf = loopy_mrf(seed, 5, rows=("upper", "upper"), inf_frac=0.05, unary_inf_frac=0.05)
    mm = min_marginals(mrf)
    if not any(np.isfinite(m).any() for m in mm):
        pytest.skip("infeasible instance")
    res = solve_with_rows(mrf, mrf.linear_constraints,
                          lambda m: solve_trws(m, label_bounds=True))
    _assert_valid(res.label_bounds, mm)
    opt = min(e for _, e in feasible_labellings(mrf))
    assert res.lower_bound <= opt + 1e-9 <= res.objective + 2e-9
    reduced, _ = prune(mrf, res.label_bounds, res.objective)
    assert min(e for _, e in feasible_labellings(reduced)) == pytest.approx(opt, abs=1e-9)


def test_prune_rejects_bad_input():
    mrf = loopy_mrf(0)
    with pytest.raises(ValueError, match="finite"):
        prune(mrf, [np.zeros(int(k)) for k in mrf.domain_sizes], math.inf)
    with pytest.raises(ValueError, match="bound vectors"):
        prune(mrf, [], 1.0)
