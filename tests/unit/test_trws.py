"""Tests of TRW-S (pipeline.solvers.trws), local search and the brute-force oracle.

Oracles: brute-force enumeration for optimality and bound validity, a
straightforward dense sequential TRW-S written below (one message at a time,
Kolmogorov 2006) for the level-batched implementation, and hand-worked
numbers for a 2-group example and a frustrated triangle.

Its timings on the ~3000-group step-sized instance (tests/support/mrf_gen.py) are a
benchmark, not a test: ``python benchmarks/solvers_large.py trws``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from mrf_gen import (
    chain_edges,
    graph_like_edges,
    loopy_mrf,
    optimum,
    random_edges,
    random_mrf,
    tree_edges,
)

from pipeline.solvers import registry
from pipeline.solvers.brute import brute_force, energy_tensor
from pipeline.solvers.compiled import CompiledMRF, conditional_sweep, interleaved_order
from pipeline.solvers.errors import InfeasibleError, NoFeasibleLabelingError
from pipeline.solvers.lagrangian import solve_with_row, solve_with_rows
from pipeline.solvers.local_search import coordinate_descent
from pipeline.solvers.mrf import (
    MRF,
    LinearConstraint,
    PairwiseFactor,
    eager_factors,
    row_holds,
    row_value,
)
from pipeline.solvers.options import LagrangianOptions, TrwsOptions
from pipeline.solvers.result import SolverResult, is_certified, relative_gap
from pipeline.solvers.status import HEURISTIC, OPTIMAL
from pipeline.solvers.trws import solve_trws

RTOL = 1e-9


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(1.0, abs(a), abs(b))


def _monotone(history: list[float]) -> bool:
    h = np.asarray(history)
    return bool(np.all(h[1:] >= h[:-1] - RTOL * np.maximum(1.0, np.abs(h[1:]))))


def _mrf(sizes, unary, edges, factors, constant=0.0) -> MRF:
    return MRF(
        domain_sizes=np.asarray(sizes, dtype=np.int64),
        unary=[np.asarray(u, dtype=np.float64) for u in unary],
        edges=np.asarray(edges, dtype=np.int64).reshape(-1, 2),
        factor=eager_factors(factors),
        constant=constant,
    )


def _factor(row_cls, col_cls, table) -> PairwiseFactor:
    return PairwiseFactor(
        np.asarray(row_cls, dtype=np.int32),
        np.asarray(col_cls, dtype=np.int32),
        np.asarray(table, dtype=np.float64),
    )


# ------------------------------------------------------------------ reference TRW-S


def reference_trws_bounds(mrf: MRF, iters: int) -> list[float]:
    """Plain sequential TRW-S with dense matrices, group order; bound after each iteration.

    Messages ``M[(s, t)]`` (from s into t) are label-space vectors; dead labels
    (``theta_hat = +inf``) get ``h = +inf``. The bound is the backward-pass sum
    of message normalisation constants plus ``(1 - n_in/n_s) min theta_hat_s``.
    """
    n = mrf.num_groups
    dense = {}
    nbrs: list[list[int]] = [[] for _ in range(n)]
    for e, (u, v) in enumerate(mrf.edges.tolist()):
        d = mrf.factor(e).dense()
        dense[(u, v)] = d
        dense[(v, u)] = d.T
        nbrs[u].append(v)
        nbrs[v].append(u)
    n_in = [sum(t < s for t in nbrs[s]) for s in range(n)]
    n_out = [sum(t > s for t in nbrs[s]) for s in range(n)]
    chains = [max(1, n_in[s], n_out[s]) for s in range(n)]
    msg = {(s, t): np.zeros(int(mrf.domain_sizes[t])) for s in range(n) for t in nbrs[s]}

    def theta_hat(s):
        th = np.array(mrf.unary[s], dtype=np.float64)
        for t in nbrs[s]:
            th = th + msg[(t, s)]
        return th

    def send(s, t, th):
        h = np.where(np.isinf(th), np.inf, th / chains[s] - np.where(np.isinf(th), 0, msg[(t, s)]))
        m = (h[:, None] + dense[(s, t)]).min(axis=0)
        c = m.min()
        assert np.isfinite(c)
        msg[(s, t)] = m - c
        return c

    history = []
    for _ in range(iters):
        for s in range(n):
            th = theta_hat(s)
            for t in nbrs[s]:
                if t > s:
                    send(s, t, th)
        bound = float(mrf.constant)
        for s in reversed(range(n)):
            th = theta_hat(s)
            for t in nbrs[s]:
                if t < s:
                    bound += send(s, t, th)
            coef = 1.0 - n_in[s] / chains[s]
            if coef > 0:
                bound += coef * th.min()
        history.append(bound)
    return history


def reference_icm_sweep(mrf: MRF, labels: np.ndarray, rtol: float = 1e-12) -> np.ndarray:
    """One sequential ICM sweep in group order, label kept unless strictly improved."""
    labels = labels.copy()
    inc: list[list[tuple[int, int]]] = [[] for _ in range(mrf.num_groups)]
    for e, (u, v) in enumerate(mrf.edges.tolist()):
        inc[u].append((e, v))
        inc[v].append((e, u))
    for s in range(mrf.num_groups):
        cost = np.array(mrf.unary[s], dtype=np.float64)
        for e, t in inc[s]:
            d = mrf.factor(e).dense()
            cost = cost + (d[:, labels[t]] if int(mrf.edges[e, 0]) == s else d[labels[t], :])
        best = int(np.argmin(cost))
        cur = cost[labels[s]]
        with np.errstate(invalid="ignore"):
            if cur - cost[best] > rtol * max(1.0, abs(cost[best])):
                labels[s] = best
    return labels


# ------------------------------------------------------------------ hand-worked


def test_two_groups_hand_worked():
    """2 groups, classes, a forbidden pair; numbers worked out by hand.

    Group 0: K=3, unary [1, 0, 4], row classes [0, 0, 1].
    Group 1: K=2, unary [0, 3], column classes [0, 1].
    Table [[0, inf], [2, 1]], constant 2.5. Energies (x0, x1):
    (0,0)=1, (1,0)=0, (2,0)=6, (2,1)=8, (0,1)=(1,1)=inf -> optimum 2.5 at (1, 0).
    gamma_0 = gamma_1 = 1. Forward: class minima of theta_0 = [0, 4]; M_01 =
    [min(0+0, 4+2), min(0+inf, 4+1)] = [0, 5], c = 0. Backward: theta_hat_1 =
    [0, 8]; h = [0, 3]; M_10 (classes) = [min(0+0, 3+inf), min(0+2, 3+1)] = [0, 2],
    c = 0. Bound = 2.5 + 0 + min([1, 0, 4] + [0, 0, 2]) = 2.5.
    """
    mrf = _mrf(
        [3, 2],
        [[1.0, 0.0, 4.0], [0.0, 3.0]],
        [[0, 1]],
        [_factor([0, 0, 1], [0, 1], [[0.0, np.inf], [2.0, 1.0]])],
        constant=2.5,
    )
    res = solve_trws(mrf)
    assert isinstance(res, SolverResult)
    assert res.labels.dtype == np.int64
    assert res.labels.tolist() == [1, 0]
    assert res.objective == 2.5
    assert res.bound_history[0] == 2.5
    assert res.lower_bound == 2.5
    assert res.lower_bound_source == "trws"
    assert res.status == "Optimal"
    assert res.iterations == 1
    assert res.extra["stop_reason"] == "certified"
    exact = brute_force(mrf)
    assert exact.labels.tolist() == [1, 0] and exact.objective == 2.5


def test_frustrated_triangle_is_heuristic():
    """Binary triangle, cost 1 when the two ends agree, 0 otherwise.

    Every labelling has an agreeing edge, so min E = 1, while the LP relaxation
    (all marginals 1/2, mass only on disagreeing pairs) is 0. TRW-S converges
    to that bound: LB = 0 < 1, so the result must be "Heuristic".
    """
    f = _factor([0, 1], [0, 1], [[1.0, 0.0], [0.0, 1.0]])
    mrf = _mrf([2, 2, 2], [[0.0, 0.0]] * 3, [[0, 1], [0, 2], [1, 2]], [f, f, f])
    res = solve_trws(mrf)
    assert res.objective == 1.0
    assert res.lower_bound == pytest.approx(0.0, abs=1e-12)
    assert res.status == "Heuristic"
    assert relative_gap(res.objective, res.lower_bound) == pytest.approx(1.0)


# ------------------------------------------------------------------ versus brute force


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_trees_match_brute_force(kind):
    for seed in range(80):
        rng = np.random.default_rng(1000 * (kind == "tree") + seed)
        n = int(rng.integers(1, 8))
        edges = chain_edges(n) if kind == "chain" else tree_edges(rng, n)
        mrf = random_mrf(rng, n, edges, inf_frac=0.25 if seed % 2 else 0.0, constant=seed)
        opt = brute_force(mrf).objective
        # TRW-S alone is exact on trees (and certifies it); the polish must not hurt.
        bare = solve_trws(mrf, local_search_rounds=0, order="index")
        assert _close(bare.objective, opt), (seed, bare.objective, opt)
        assert bare.status == "Optimal", seed
        assert bare.lower_bound <= opt + RTOL * max(1.0, abs(opt))
        res = solve_trws(mrf)
        assert _close(res.objective, opt)
        assert res.objective == mrf.evaluate(res.labels)


def test_loopy_bound_valid_and_monotone():
    certified = 0
    for seed in range(150):
        rng = np.random.default_rng(5000 + seed)
        n = int(rng.integers(3, 8))
        m = int(rng.integers(n, n * (n - 1) // 2 + 1))
        mrf = random_mrf(rng, n, random_edges(rng, n, m), inf_frac=0.2 if seed % 3 == 0 else 0.0)
        opt = brute_force(mrf).objective
        order = "index" if seed % 2 else rng.permutation(n)
        res = solve_trws(mrf, max_iters=200, tol=0.0, order=order)
        tol = RTOL * max(1.0, abs(opt))
        assert max(res.bound_history) <= opt + tol, seed
        assert res.lower_bound <= opt + tol
        assert _monotone(res.bound_history), (seed, res.bound_history[:10])
        assert res.objective >= opt - tol
        if res.status == "Optimal":
            certified += 1
            assert _close(res.objective, opt)
            assert res.objective - res.lower_bound <= RTOL * max(1.0, abs(res.objective))
        else:
            assert res.status == "Heuristic"
            assert res.objective - res.lower_bound > RTOL * max(1.0, abs(res.objective))
    assert certified > 0  # the certificate path is exercised


def test_matches_reference_sequential_trws():
    """Level batching reproduces the plain sequential sweep bound by bound."""
    for seed in range(25):
        rng = np.random.default_rng(9000 + seed)
        n = int(rng.integers(3, 12))
        edges = graph_like_edges(rng, n, min(2 * n, n * (n - 1) // 2), window=4)
        mrf = random_mrf(rng, n, edges, kmax=6, inf_frac=0.1 if seed % 2 else 0.0)
        try:
            ref = reference_trws_bounds(mrf, 8)
        except AssertionError:  # reference found the instance infeasible
            with pytest.raises(InfeasibleError):
                solve_trws(mrf, max_iters=8, tol=0.0, order="index")
            continue
        res = solve_trws(mrf, max_iters=8, tol=0.0, order="index", local_search_rounds=0)
        got = res.bound_history
        assert len(got) <= 8
        for a, b in zip(got, ref, strict=False):
            assert _close(a, b), (seed, got, ref)


def test_batched_icm_equals_sequential_icm():
    for seed in range(30):
        rng = np.random.default_rng(12000 + seed)
        n = int(rng.integers(2, 15))
        edges = graph_like_edges(rng, n, min(2 * n, n * (n - 1) // 2), window=5)
        mrf = random_mrf(rng, n, edges, kmax=6, inf_frac=0.1)
        cm = CompiledMRF(mrf)
        buf = cm.new_buffer()
        labels = np.array([rng.integers(0, k) for k in mrf.domain_sizes], dtype=np.int64)
        expect = reference_icm_sweep(mrf, labels)
        got = labels.copy()
        conditional_sweep(cm, buf, got, cm.icm_batches, improve_only=True)
        assert got.tolist() == expect.tolist(), seed


# ------------------------------------------------------------------ behaviour


def test_deterministic():
    rng = np.random.default_rng(7)
    n = 60
    mrf = random_mrf(rng, n, graph_like_edges(rng, n, 140, window=10), kmax=12, inf_frac=0.05)
    a = solve_trws(mrf, max_iters=40, max_levels=8)
    b = solve_trws(mrf, max_iters=40, max_levels=8)
    assert a.extra["order"].startswith("interleaved")
    assert a.labels.tolist() == b.labels.tolist()
    assert a.bound_history == b.bound_history
    assert a.objective == b.objective


def test_orders_agree_on_validity():
    rng = np.random.default_rng(11)
    n = 40
    mrf = random_mrf(rng, n, graph_like_edges(rng, n, 90, window=8), kmax=8)
    results = [
        solve_trws(mrf, max_iters=60, order="index"),
        solve_trws(mrf, max_iters=60, order="auto", max_levels=5),
        solve_trws(mrf, max_iters=60, order=rng.permutation(n)),
    ]
    assert [r.extra["order"] for r in results] == ["index", "interleaved(8)", "custom"]
    best_energy = min(r.objective for r in results)
    for r in results:
        assert max(r.bound_history) <= best_energy + RTOL * abs(best_energy)
        assert _monotone(r.bound_history)
        assert r.objective == mrf.evaluate(r.labels)


def test_interleaved_order_is_permutation():
    for n, p in [(0, 3), (1, 1), (10, 3), (10, 20), (3000, 24)]:
        order = interleaved_order(n, p)
        assert sorted(order.tolist()) == list(range(n))
    assert interleaved_order(7, 3).tolist() == [0, 3, 6, 1, 4, 2, 5]


def test_infeasible_raises():
    # Every pair is forbidden.
    f = _factor([0, 1], [0, 1], np.full((2, 2), np.inf))
    with pytest.raises(InfeasibleError):
        solve_trws(_mrf([2, 2], [[0, 0], [0, 0]], [[0, 1]], [f]))
    # Only (0, 1) and (1, 0) allowed, but unaries forbid label 1 on both sides.
    g = _factor([0, 1], [0, 1], [[np.inf, 0.0], [0.0, np.inf]])
    with pytest.raises(InfeasibleError):
        solve_trws(_mrf([2, 2], [[0, np.inf], [0, np.inf]], [[0, 1]], [g]))
    # Under a permuted order the error still names the real groups of the edge.
    ok = _factor([0, 1], [0, 1], np.zeros((2, 2)))
    tri = _mrf([2, 2, 2], [[0, np.inf], [0, 0], [0, np.inf]], [[0, 1], [0, 2], [1, 2]], [ok, g, ok])
    with pytest.raises(InfeasibleError, match=r"edge 1 \(0, 2\)"):
        solve_trws(tri, order="index")
    # A group with every label forbidden.
    with pytest.raises(InfeasibleError):
        solve_trws(_mrf([2], [[np.inf, np.inf]], [], []))
    # Random infeasible trees: arc consistency is complete on trees.
    seen = 0
    for seed in range(200):
        rng = np.random.default_rng(20000 + seed)
        n = int(rng.integers(2, 7))
        mrf = random_mrf(rng, n, tree_edges(rng, n), inf_frac=0.6, feasible=False)
        try:
            brute_force(mrf)
        except InfeasibleError:
            seen += 1
            with pytest.raises(InfeasibleError):
                solve_trws(mrf)
    assert seen > 10


def test_no_nan_with_many_forbidden_entries():
    for seed in range(40):
        rng = np.random.default_rng(30000 + seed)
        n = int(rng.integers(3, 9))
        mrf = random_mrf(rng, n, random_edges(rng, n, 2 * n), inf_frac=0.5, kmax=6)
        with np.errstate(invalid="raise"):
            try:
                res = solve_trws(mrf, max_iters=30)
            except (InfeasibleError, NoFeasibleLabelingError):
                continue
        assert np.isfinite(res.objective)
        assert all(np.isfinite(res.bound_history))


def test_degenerate_shapes():
    # Domain size 1, isolated groups, constant.
    f = _factor([0], [0, 1, 1], [[3.0, 1.0]])
    mrf = _mrf(
        [1, 3, 2, 1],
        [[5.0], [0.0, 2.0, 0.5], [4.0, -1.0], [7.0]],
        [[0, 1]],
        [f],
        constant=-2.0,
    )
    res = solve_trws(mrf)
    # Group 1: label 0 costs 0 + 3, label 1 costs 2 + 1, label 2 costs 0.5 + 1 -> label 2.
    assert res.labels.tolist() == [0, 2, 1, 0]
    assert res.objective == pytest.approx(-2.0 + 5.0 + 0.5 + 1.0 - 1.0 + 7.0)
    assert res.status == "Optimal"
    # No edges at all.
    res = solve_trws(_mrf([2, 3], [[1.0, 0.0], [2.0, 3.0, 1.0]], [], [], constant=1.0))
    assert res.labels.tolist() == [1, 2]
    assert res.objective == res.lower_bound == 2.0
    assert res.status == "Optimal" and res.extra["stop_reason"] == "no_edges"
    # No groups.
    res = solve_trws(_mrf([], [], [], [], constant=4.0))
    assert res.labels.shape == (0,) and res.objective == 4.0


def test_linear_constraints_are_ignored():
    rng = np.random.default_rng(3)
    mrf = random_mrf(rng, 5, chain_edges(5))
    free = solve_trws(mrf)
    mrf.linear_constraints = [
        LinearConstraint("mem", {0: np.ones(int(mrf.domain_sizes[0]))}, -np.inf, 0.5)
    ]
    res = solve_trws(mrf)
    assert res.labels.tolist() == free.labels.tolist()


def test_progress_iterations_and_time_limit():
    rng = np.random.default_rng(5)
    n = 30
    mrf = random_mrf(rng, n, random_edges(rng, n, 80), kmax=5)
    calls = []
    res = solve_trws(mrf, max_iters=7, tol=0.0, progress=lambda *a: calls.append(a))
    assert [c[0] for c in calls] == list(range(1, res.iterations + 1))
    assert res.iterations == len(res.bound_history) <= 7
    assert all(c[1] == b for c, b in zip(calls, res.bound_history, strict=True))
    res = solve_trws(mrf, max_iters=500, tol=0.0, time_limit_s=0.0)
    assert res.iterations == 1 and res.extra["stop_reason"] in ("time_limit", "certified")


def test_bad_input():
    f = _factor([0, 1], [0, 1], np.zeros((2, 2)))
    with pytest.raises(ValueError, match="u < v"):
        solve_trws(_mrf([2, 2], [[0, 0], [0, 0]], [[1, 0]], [f]))
    with pytest.raises(ValueError, match="NaN"):
        solve_trws(_mrf([2, 2], [[0, np.nan], [0, 0]], [[0, 1]], [f]))
    with pytest.raises(ValueError, match="shape"):
        solve_trws(_mrf([3, 2], [[0, 0], [0, 0]], [[0, 1]], [f]))
    with pytest.raises(ValueError, match="max_iters"):
        solve_trws(_mrf([2], [[0, 0]], [], []), max_iters=0)
    with pytest.raises(ValueError, match="order"):
        solve_trws(_mrf([2], [[0, 0]], [], []), order="random")


# ------------------------------------------------------------------ local search


def test_pairwise_move_escapes_forbidden_pair():
    """(0,0) costs 5; (1,1) costs 0; mixed pairs are forbidden: ICM alone is stuck."""
    f = _factor([0, 1], [0, 1], [[5.0, np.inf], [np.inf, 0.0]])
    mrf = _mrf([2, 2], [[0, 0], [0, 0]], [[0, 1]], [f])
    start = np.array([0, 0])
    assert coordinate_descent(mrf, start, 10, pairwise=False).tolist() == [0, 0]
    assert coordinate_descent(mrf, start, 10).tolist() == [1, 1]
    assert start.tolist() == [0, 0]


def test_coordinate_descent_reaches_local_minimum():
    for seed in range(20):
        rng = np.random.default_rng(40000 + seed)
        n = int(rng.integers(2, 9))
        mrf = random_mrf(rng, n, random_edges(rng, n, 2 * n), kmax=5)
        start = np.array([rng.integers(0, k) for k in mrf.domain_sizes])
        out = coordinate_descent(mrf, start, 100)
        e_out = mrf.evaluate(out)
        assert e_out <= mrf.evaluate(start)
        for g, k in enumerate(mrf.domain_sizes):  # no single-group improvement left
            for x in range(int(k)):
                trial = out.copy()
                trial[g] = x
                assert mrf.evaluate(trial) >= e_out - 1e-9


def test_coordinate_descent_rejects_bad_labels():
    mrf = _mrf([2, 2], [[0, 0], [0, 0]], [[0, 1]], [_factor([0, 1], [0, 1], np.zeros((2, 2)))])
    with pytest.raises(ValueError):
        coordinate_descent(mrf, np.array([0, 2]), 5)
    with pytest.raises(ValueError):
        coordinate_descent(mrf, np.array([0]), 5)


# ------------------------------------------------------------------ brute force


def test_brute_force_matches_enumeration():
    rng = np.random.default_rng(1)
    mrf = random_mrf(rng, 4, random_edges(rng, 4, 5), inf_frac=0.2)
    res = brute_force(mrf)
    labels, energy = res.labels, res.objective
    best = min(mrf.evaluate(np.array(x)) for x in itertools.product(*map(range, mrf.domain_sizes)))
    assert energy == best == mrf.evaluate(labels)
    assert isinstance(res, SolverResult) and res.status == "Optimal"
    assert res.lower_bound == energy and res.lower_bound_source == "brute_force"


def test_brute_force_honours_rows():
    """Hand-worked: 2 groups of 3 labels, unaries [0, 1, 2] and [0, 2, 4], no edge.
    Row 0: x0 + x1 >= 2 (labels as coefficients); row 1: 2 x0 + x1 <= 3.
    Row 0 leaves (0, 2), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2); row 1 then
    leaves (0, 2) with E = 4 and (1, 1) with E = 3: the optimum is (1, 1)."""
    lab = np.arange(3, dtype=np.float64)
    rows = [LinearConstraint("sum", {0: lab, 1: lab}, 2.0, np.inf),
            LinearConstraint("weighted", {0: 2 * lab, 1: lab}, -np.inf, 3.0)]
    mrf = _mrf([3, 3], [[0.0, 1.0, 2.0], [0.0, 2.0, 4.0]], [], [])
    assert brute_force(mrf).labels.tolist() == [0, 0]  # no rows: the free minimum
    mrf.linear_constraints = rows
    res = brute_force(mrf)
    assert res.labels.tolist() == [1, 1] and res.objective == 3.0
    assert res.extra["feasible_labellings"] == 2
    mrf.linear_constraints = rows + [LinearConstraint("none", {0: lab}, 5.0, np.inf)]
    with pytest.raises(InfeasibleError, match="linear constraint"):
        brute_force(mrf)


def test_brute_force_refuses_large():
    mrf = _mrf([2000, 2000], [np.zeros(2000)] * 2, [], [])
    with pytest.raises(ValueError, match="max_joint_labels"):
        brute_force(mrf)


# ------------------------------------------------------------------ Lagrangian (rows)


def _dual_value(mrf: MRF, mult: list[float]) -> float:
    """Exact Lagrangian dual function (brute force over every labelling, rows dropped):
    ``min_x E(x) + sum_i mu_i (g_i(x) - T_i)`` with ``T_i = H_i`` for ``mu_i > 0``,
    ``L_i`` for ``mu_i < 0``."""
    n = mrf.num_groups
    total = energy_tensor(mrf)
    for row, mu in zip(mrf.linear_constraints, mult):
        if mu == 0.0:
            continue
        value = np.zeros(total.shape)
        for g, c in row.coef.items():
            shape = [1] * n
            shape[g] = c.size
            value = value + c.reshape(shape)
        total = total + mu * (value - (row.high if mu > 0 else row.low))
    return float(total.min())


def test_lagrangian_two_rows_against_brute_force():
    """Two rows (upper+upper or upper+lower) on random loopy MRFs: every returned
    labelling satisfies both rows, the bound is valid for the constrained problem and
    never above the exact dual function at its own multipliers, the status is honest."""
    counts = {"solved": 0, "binding": 0, "both_priced": 0, "optimal": 0, "infeasible": 0}
    for seed in range(40):
        sides = ("upper", "upper") if seed % 2 else ("upper", "lower")
        mrf = loopy_mrf(seed, 6, inf_frac=0.05, unary_inf_frac=0.0, integer_costs=False,
                        rows=sides)
        opt = optimum(mrf)

        def inner(m: MRF) -> SolverResult:
            return solve_trws(m, max_iters=100)

        if not np.isfinite(opt):
            counts["infeasible"] += 1
            with pytest.raises((InfeasibleError, NoFeasibleLabelingError)):
                solve_with_rows(mrf, mrf.linear_constraints, inner)
            continue
        res = solve_with_rows(mrf, mrf.linear_constraints, inner)
        counts["solved"] += 1
        tol = RTOL * max(1.0, abs(opt))
        assert all(row_holds(r, row_value(r, res.labels)) for r in mrf.linear_constraints)
        assert res.objective == mrf.evaluate(res.labels) >= opt - tol, seed
        assert res.lower_bound <= opt + tol, seed
        assert not res.extra["tight_row"]  # bounds = sum of mean coefficients: never tight
        dual = _dual_value(mrf, res.extra["bound_multipliers"])
        assert res.lower_bound <= dual + tol and dual <= opt + tol, seed
        assert res.status == (OPTIMAL if is_certified(res.objective, res.lower_bound)
                              else HEURISTIC)
        if res.status == OPTIMAL:
            assert _close(res.objective, opt)
        free = optimum(MRF(mrf.domain_sizes, mrf.unary, mrf.edges, mrf.factor, mrf.constant))
        counts["binding"] += opt > free + tol
        counts["both_priced"] += all(m != 0.0 for m in res.extra["multipliers"])
        counts["optimal"] += _close(res.objective, opt)
    # the instances exercise infeasibility, binding rows and two active multipliers,
    # and the heuristic finds the constrained optimum on most of them
    assert counts["infeasible"] >= 3 and counts["binding"] >= 15, counts
    assert counts["both_priced"] >= 5 and counts["optimal"] >= 0.75 * counts["solved"], counts


def test_lagrangian_one_row_is_the_single_row_search():
    """One row: solve_with_rows is the single-row search (one round, no other start)."""
    mrf = loopy_mrf(21, 6, inf_frac=0.0, unary_inf_frac=0.0, integer_costs=False,
                    rows=("upper",))
    (row,) = mrf.linear_constraints
    a = solve_with_row(mrf, row, lambda m: solve_trws(m, max_iters=100))
    b = solve_with_rows(mrf, [row], lambda m: solve_trws(m, max_iters=100), max_rounds=10)
    assert a.labels.tolist() == b.labels.tolist() and a.lower_bound == b.lower_bound
    assert a.extra["inner_solves"] == b.extra["inner_solves"] > 1
    assert a.extra["multipliers"] == [a.extra["multiplier"]]
    # no row: one inner solve, nothing priced
    none = solve_with_rows(mrf, [], lambda m: solve_trws(m, max_iters=100))
    assert none.labels.tolist() == solve_trws(mrf, max_iters=100).labels.tolist()
    assert none.extra["inner_solves"] == 1 and none.extra["multipliers"] == []


# ------------------------------------------------------------------ solver protocol


def test_registry_dispatches_every_solver_with_one_protocol():
    """Every registered solver is solve(mrf, options) -> SolverResult; on a small MRF
    with one binding row, the exact ones agree with brute force and the Lagrangian
    wrapper (registry.solve wraps approx because approx ignores rows) is feasible."""
    mrf = loopy_mrf(6, 5, inf_frac=0.0, unary_inf_frac=0.0, rows=("upper",))
    (row,) = mrf.linear_constraints
    opt = optimum(mrf)
    free = optimum(MRF(mrf.domain_sizes, mrf.unary, mrf.edges, mrf.factor, mrf.constant))
    assert free < opt  # the row binds
    assert set(registry.SOLVERS) == {"approx", "ilp", "lp", "brute_force", "lagrangian"}
    for name in ("brute_force", "ilp"):
        res = registry.get_solver(name).solve(mrf)
        assert isinstance(res, SolverResult) and res.status == OPTIMAL
        assert _close(res.objective, opt)
    approx = registry.get_solver("approx")
    assert not approx.honours_rows
    assert _close(approx.solve(mrf).objective, free)  # rows ignored by TRW-S itself
    wrapped = registry.solve("approx", mrf, TrwsOptions(max_iters=100))
    assert row_holds(row, row_value(row, wrapped.labels))
    assert opt - 1e-9 <= wrapped.objective and wrapped.lower_bound <= opt + 1e-9
    direct = registry.get_solver("lagrangian").solve(
        mrf, LagrangianOptions(inner=registry.bind("approx", TrwsOptions(max_iters=100))))
    assert direct.labels.tolist() == wrapped.labels.tolist()
    with pytest.raises(ValueError, match="allowed approx, ilp, lp, brute_force, lagrangian"):
        registry.get_solver("gurobi")
    with pytest.raises(ValueError, match="options.inner"):
        registry.get_solver("lagrangian").solve(mrf)


def test_options_from_the_solver_config():
    """Options read their fields from any object shaped like pipeline.config.SolverConfig."""
    from types import SimpleNamespace as SolverConfig

    cfg = SolverConfig(name="approx", max_iters=7, tol=0.5, local_search_rounds=3,
                       time_limit_s=9.0, backend="cbc", mip_gap=0.25, threads=2, prune=True)
    trws = registry.get_solver("approx").options(cfg, label_bounds=True)
    assert (trws.max_iters, trws.tol, trws.local_search_rounds, trws.time_limit_s,
            trws.label_bounds) == (7, 0.5, 3, 9.0, True)
    ilp = registry.get_solver("ilp").options(cfg, mps_path="m.mps")
    assert (ilp.backend, ilp.mip_gap, ilp.threads, ilp.time_limit_s, ilp.mps_path) == (
        "cbc", 0.25, 2, 9.0, "m.mps")
    lp = registry.get_solver("lp").options(cfg)
    assert (lp.backend, lp.threads, lp.accept_fractional) == ("cbc", 2, False)
    with pytest.raises(ValueError, match="unknown ILP backend 'gurobi'"):
        registry.get_solver("ilp").options(SolverConfig(backend="gurobi", time_limit_s=None,
                                                        mip_gap=0.0, threads=1))


@pytest.mark.parametrize("big_table, chunk", [(1, 1), (1, 7), (9, 1 << 21)])
def test_big_tables_send_the_same_messages(monkeypatch, big_table, chunk):
    """Messages straight from a big table (batches.big_edge_messages, in row chunks)
    equal the gathered per-pair path bit for bit: the same bounds at every iteration,
    the same labels and objective, with and without forbidden entries and with unused
    (compacted) classes. ``big_table=1`` sends every edge that way, 9 a mix."""
    import pipeline.solvers.batches as batches

    for seed in range(6):
        rng = np.random.default_rng(4100 + seed)
        n = 40
        mrf = random_mrf(rng, n, graph_like_edges(rng, n, 90, window=8), kmax=9,
                         inf_frac=0.1 if seed % 2 else 0.0)
        kwargs = dict(max_iters=15, tol=0.0, max_levels=6 if seed % 3 else 128)
        try:
            ref = solve_trws(mrf, **kwargs)
        except InfeasibleError as err:
            monkeypatch.setattr(batches, "BIG_TABLE", big_table)
            monkeypatch.setattr(batches, "BIG_CHUNK", chunk)
            with pytest.raises(InfeasibleError, match=str(err).split(":")[0]):
                solve_trws(mrf, **kwargs)
            monkeypatch.undo()
            continue
        monkeypatch.setattr(batches, "BIG_TABLE", big_table)
        monkeypatch.setattr(batches, "BIG_CHUNK", chunk)
        cm = CompiledMRF(mrf)
        assert any(b.big for b in cm.fwd_batches + cm.bwd_batches)
        got = solve_trws(mrf, **kwargs)
        monkeypatch.undo()
        assert got.bound_history == ref.bound_history
        assert got.labels.tolist() == ref.labels.tolist()
        assert got.objective == ref.objective


def test_compiled_tables_are_one_store():
    """The compiled tables are views of the first buffer (one copy per solve), equal to
    the factors' tables on the classes in use; a second buffer is a copy with zero
    messages."""
    rng = np.random.default_rng(77)
    mrf = random_mrf(rng, 12, graph_like_edges(rng, 12, 20, window=4), kmax=7)
    cm = CompiledMRF(mrf, interleaved_order(12, 3))
    buf = cm.new_buffer()
    for e in range(cm.num_edges):
        assert np.shares_memory(cm.tables[e], buf)
    for e in range(mrf.num_edges):  # external edge e, internal edge by endpoints
        f = mrf.factor(e)
        u, v = (int(cm.pos[x]) for x in mrf.edges[e])
        k = next(i for i in range(cm.num_edges)
                 if {int(cm.edges[i, 0]), int(cm.edges[i, 1])} == {u, v})
        dense = f.table[np.ix_(f.row_cls, f.col_cls)]  # [K_u, K_v] of the external edge
        if u > v:
            dense = dense.T
        got = cm.tables[k][np.ix_(cm.rcls[k], cm.ccls[k])]
        assert np.array_equal(got, dense)
    buf[: cm.msg_size] = 5.0
    other = cm.new_buffer()
    assert not np.shares_memory(other, buf)
    assert not other[: cm.msg_size].any()
    assert np.array_equal(other[cm.msg_size:], buf[cm.msg_size:])
