"""Tests of the exact ILP / LP-relaxation solver (pipeline.solvers.ilp).

Its build and solve times on the step-sized synthetic MRF are a benchmark, not a test:
``python benchmarks/solvers_large.py ilp-highs ilp-cbc``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mrf_gen import loopy_mrf, optimum, step_sized_mrf

from pipeline.solvers.errors import FractionalRelaxationError, InfeasibleError
from pipeline.solvers.ilp import (
    BACKENDS,
    build_model,
    lp_lower_bound,
    parse_cbc_log,
    solve_ilp,
)
from pipeline.solvers.mrf import MRF, LinearConstraint, PairwiseFactor, eager_factors
from pipeline.solvers.options import IlpOptions, LpOptions
from pipeline.solvers.registry import get_solver
from pipeline.solvers.result import relative_gap
from pipeline.solvers.status import (
    FEASIBLE_TIME_LIMIT,
    INFEASIBLE,
    NOT_SOLVED,
    OPTIMAL,
    STATUSES,
    map_highs_status,
    map_pulp_status,
)

#: Seeds of the brute-force comparisons (40 instances: as many infeasible, binding-row
#: and tied ones as the 24 of the former generator, or more).
SEEDS = range(40)


# ----------------------------------------------------------------------------- helpers


def _rows(lincon: bool) -> tuple[str, ...]:
    """One upper row (a memory-like budget) or none."""
    return ("upper",) if lincon else ()


def chain_or_cycle(n: int, table: np.ndarray, unary: list[np.ndarray], cycle: bool) -> MRF:
    edges = [(g, g + 1) for g in range(n - 1)] + ([(0, n - 1)] if cycle else [])
    k = table.shape[0]
    ident = np.arange(k, dtype=np.int32)
    factors = [PairwiseFactor(ident, ident, table) for _ in edges]
    return MRF(
        np.full(n, k, dtype=np.int64),
        unary,
        np.asarray(edges, dtype=np.int64),
        eager_factors(factors),
    )


# ----------------------------------------------------------------- exactness vs brute force


@pytest.mark.parametrize("seed", SEEDS)
def test_ilp_equals_brute_force(seed):
    mrf = loopy_mrf(seed, rows=_rows(seed % 2 == 0))
    best = optimum(mrf)
    if not math.isfinite(best):
        with pytest.raises(InfeasibleError):
            solve_ilp(mrf)
        return
    res = solve_ilp(mrf)
    assert res.status == OPTIMAL
    assert res.objective == pytest.approx(best, abs=1e-9)
    assert res.objective == mrf.evaluate(res.labels)
    assert res.lower_bound == res.objective and res.lower_bound_source == "ilp"
    assert res.labels.dtype == np.int64 and res.labels.shape == (mrf.num_groups,)
    for key in (
        "backend",
        "variables",
        "constraints",
        "backend_seconds",
        "build_seconds",
        "mip_gap",
    ):
        assert key in res.extra


def test_random_instances_cover_the_interesting_cases():
    """The seeds above include infeasible ones, binding constraints and ties."""
    infeasible = binding = 0
    for seed in SEEDS:
        mrf = loopy_mrf(seed, rows=_rows(seed % 2 == 0))
        best = optimum(mrf)
        infeasible += not math.isfinite(best)
        if mrf.linear_constraints and math.isfinite(best):
            free = MRF(mrf.domain_sizes, mrf.unary, mrf.edges, mrf.factor, mrf.constant)
            binding += optimum(free) < best
    assert infeasible >= 1 and binding >= 1


@pytest.mark.parametrize("seed", range(16))
def test_cbc_and_highs_agree_and_lp_bounds_ilp(seed):
    mrf = loopy_mrf(seed + 100, 6, inf_frac=0.05, rows=_rows(seed % 3 == 0))
    try:
        res = {b: solve_ilp(mrf, backend=b) for b in BACKENDS}
    except InfeasibleError:
        assert not math.isfinite(optimum(mrf))
        return
    assert res["highs"].objective == pytest.approx(res["cbc"].objective, abs=1e-9)
    assert res["cbc"].status == OPTIMAL and res["cbc"].extra["pulp_status"] == (1, 1)
    lps = [lp_lower_bound(mrf, b).lower_bound for b in BACKENDS]
    assert lps[0] == pytest.approx(lps[1], abs=1e-6)
    assert max(lps) <= res["highs"].objective + 1e-6


def test_ties_through_shared_classes():
    """All labels in one class: every labelling of equal class costs the same."""
    unary = [np.zeros(4), np.zeros(3)]
    f = PairwiseFactor(
        np.array([0, 0, 1, 1], np.int32),
        np.array([0, 1, 1], np.int32),
        np.array([[1.0, 5.0], [np.inf, 1.0]]),
    )
    mrf = MRF(np.array([4, 3]), unary, np.array([[0, 1]]), eager_factors([f]), 1.0)
    for b in BACKENDS:
        res = solve_ilp(mrf, backend=b)
        assert res.objective == 2.0
        assert build_model(mrf).num_y == 3  # the +inf class pair has no variable


def test_infeasible_cases_raise():
    # every label of a group forbidden
    mrf = MRF(
        np.array([2]), [np.array([np.inf, np.inf])], np.zeros((0, 2), np.int64), eager_factors([])
    )
    with pytest.raises(InfeasibleError):
        solve_ilp(mrf)
    # every pair forbidden on an edge, and an unsatisfiable linear constraint
    f = PairwiseFactor(
        np.array([0, 1], np.int32),
        np.array([0, 1], np.int32),
        np.array([[np.inf, 0.0], [0.0, np.inf]]),
    )
    lc = LinearConstraint("impossible", {0: np.array([1.0, 1.0])}, 3.0, math.inf)
    mrf = MRF(
        np.array([2, 2]),
        [np.zeros(2), np.array([0.0, np.inf])],
        np.array([[0, 1]]),
        eager_factors([f]),
        0.0,
        [lc],
    )
    for b in BACKENDS:
        with pytest.raises(InfeasibleError):
            solve_ilp(mrf, backend=b)
        with pytest.raises(InfeasibleError):
            lp_lower_bound(mrf, b)


def test_bad_input_raises_value_error():
    mrf = loopy_mrf(3)
    with pytest.raises(ValueError):
        solve_ilp(mrf, backend="gurobi")
    mrf.unary[0] = mrf.unary[0].copy()
    mrf.unary[0][0] = np.nan
    with pytest.raises(ValueError):
        solve_ilp(mrf)


def test_registry_ilp_and_lp_equal_solve_ilp():
    """The protocol entries ``ilp`` and ``lp`` are solve_ilp with the same options."""
    mrf = loopy_mrf(8, 6, rows=_rows(True))
    for b in BACKENDS:
        ref = solve_ilp(mrf, backend=b)
        res = get_solver("ilp").solve(mrf, IlpOptions(backend=b))
        assert res.objective == ref.objective and res.labels.tolist() == ref.labels.tolist()
        assert res.status == OPTIMAL and res.extra["backend"] == b
    tree = chain_or_cycle(4, np.array([[0.0, 2.0], [1.0, 0.0]]),
                          [np.array([0.0, 1.0]), np.array([1.0, 0.0])] * 2, cycle=False)
    lp = get_solver("lp").solve(tree, LpOptions())
    assert lp.lower_bound_source == "lp" and lp.objective == optimum(tree)
    cycle = chain_or_cycle(3, np.eye(2), [np.zeros(2)] * 3, cycle=True)
    with pytest.raises(FractionalRelaxationError):
        get_solver("lp").solve(cycle, LpOptions())
    bound = get_solver("lp").solve(cycle, LpOptions(accept_fractional=True))
    assert bound.lower_bound == pytest.approx(0.0, abs=1e-9) and bound.objective == math.inf


# ----------------------------------------------------------------------- LP relaxation


def test_relax_refuses_frustrated_odd_cycle():
    """3-cycle, 2 labels, equal labels cost 1: LP optimum 0 at x = 1/2, ILP 1."""
    penalty = np.array([[1.0, 0.0], [0.0, 1.0]])
    mrf = chain_or_cycle(3, penalty, [np.zeros(2) for _ in range(3)], cycle=True)
    for b in BACKENDS:
        with pytest.raises(FractionalRelaxationError) as err:
            solve_ilp(mrf, backend=b, relax=True)
        msg = str(err.value)
        assert msg.startswith("LP relaxation is fractional (max distance to integral = 0.5")
        assert msg.endswith("; use solver=ilp") and "\n" not in msg
        lp = lp_lower_bound(mrf, b)
        assert lp.lower_bound == pytest.approx(0.0, abs=1e-9)
        assert lp.status == OPTIMAL and lp.objective == math.inf  # fractional: no labels
        assert (lp.labels == -1).all()
        assert solve_ilp(mrf, backend=b).objective == 1.0


def test_relax_accepts_tree():
    rng = np.random.default_rng(7)
    table = rng.random((3, 3))
    table[0, 2] = np.inf
    mrf = chain_or_cycle(6, table, [rng.random(3) for _ in range(6)], cycle=False)
    exact = optimum(mrf)
    for b in BACKENDS:
        res = solve_ilp(mrf, backend=b, relax=True)
        assert res.status == OPTIMAL and res.lower_bound_source == "lp"
        assert res.objective == pytest.approx(exact, abs=1e-9)
        assert res.lower_bound == pytest.approx(exact, abs=1e-7)
        assert res.extra["max_fractionality"] <= 1e-6
        lp = lp_lower_bound(mrf, b)  # an integral LP: the bound result carries the labels
        assert lp.status == OPTIMAL and lp.labels.tolist() == res.labels.tolist()
        assert lp.lower_bound == pytest.approx(exact, abs=1e-7)
        assert lp.objective == pytest.approx(exact, abs=1e-9)


# -------------------------------------------------------------------------------- MPS


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("relax", [False, True])
def test_mps_resolve_gives_same_objective(tmp_path, relax, backend):
    import highspy

    mrf = loopy_mrf(4, 6, inf_frac=0.05, rows=_rows(True), integer_costs=False)
    path = tmp_path / "model.mps"
    if relax:
        lp = lp_lower_bound(mrf).lower_bound
        try:
            solve_ilp(mrf, backend=backend, relax=True, mps_path=path)
        except FractionalRelaxationError:
            pass
        target = lp
    else:
        target = solve_ilp(mrf, backend=backend, mps_path=path).objective
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.readModel(str(path))
    h.run()
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    assert h.getInfo().objective_function_value == pytest.approx(target, abs=1e-6)
    lp_obj = h.getLp()
    assert lp_obj.col_names_[0] == "x0_" + str(int(build_model(mrf).x_label[0]))


# ---------------------------------------------------------------------- status mapping


PULP_TABLE = [
    # (status, sol_status) -> ours; PuLP 3.3.2 gives (1, 2) for a time-limited CBC run
    ((1, 1), OPTIMAL),
    ((1, 2), FEASIBLE_TIME_LIMIT),
    ((0, 2), FEASIBLE_TIME_LIMIT),
    ((1, 0), NOT_SOLVED),
    ((0, 0), NOT_SOLVED),
    ((-1, -1), INFEASIBLE),
    ((-1, 0), INFEASIBLE),  # CBC "Integer infeasible"
    ((-2, -2), NOT_SOLVED),
    ((-3, -1), NOT_SOLVED),
    ((-3, 0), NOT_SOLVED),
]


@pytest.mark.parametrize("pair,expected", PULP_TABLE)
def test_map_pulp_status(pair, expected):
    assert map_pulp_status(*pair) == expected


HIGHS_TABLE = {
    "kOptimal": (OPTIMAL, NOT_SOLVED),
    "kInfeasible": (INFEASIBLE, INFEASIBLE),
    "kUnboundedOrInfeasible": (INFEASIBLE, INFEASIBLE),
    "kTimeLimit": (FEASIBLE_TIME_LIMIT, NOT_SOLVED),
    "kIterationLimit": (FEASIBLE_TIME_LIMIT, NOT_SOLVED),
    "kSolutionLimit": (FEASIBLE_TIME_LIMIT, NOT_SOLVED),
    "kInterrupt": (FEASIBLE_TIME_LIMIT, NOT_SOLVED),
    "kHighsInterrupt": (FEASIBLE_TIME_LIMIT, NOT_SOLVED),
    "kMemoryLimit": (FEASIBLE_TIME_LIMIT, NOT_SOLVED),
    "kObjectiveBound": (FEASIBLE_TIME_LIMIT, NOT_SOLVED),
    "kObjectiveTarget": (FEASIBLE_TIME_LIMIT, NOT_SOLVED),
    "kUnknown": (FEASIBLE_TIME_LIMIT, NOT_SOLVED),
    "kNotset": (NOT_SOLVED, NOT_SOLVED),
    "kLoadError": (NOT_SOLVED, NOT_SOLVED),
    "kModelError": (NOT_SOLVED, NOT_SOLVED),
    "kPresolveError": (NOT_SOLVED, NOT_SOLVED),
    "kSolveError": (NOT_SOLVED, NOT_SOLVED),
    "kPostsolveError": (NOT_SOLVED, NOT_SOLVED),
    "kModelEmpty": (NOT_SOLVED, NOT_SOLVED),
    "kUnbounded": (NOT_SOLVED, NOT_SOLVED),
}


def test_highs_table_covers_every_highs_status():
    import highspy

    assert set(HIGHS_TABLE) == set(highspy.HighsModelStatus.__members__)


@pytest.mark.parametrize("name", sorted(HIGHS_TABLE))
def test_map_highs_status(name):
    import highspy

    with_sol, without_sol = HIGHS_TABLE[name]
    member = highspy.HighsModelStatus.__members__[name]
    assert map_highs_status(member, True) == with_sol
    assert map_highs_status(member, False) == without_sol
    assert map_highs_status(name, True) == with_sol  # names work too
    assert with_sol in STATUSES and without_sol in STATUSES


def test_map_highs_status_unknown_name():
    assert map_highs_status("kSomethingNew", True) == NOT_SOLVED


def test_parse_cbc_log_time_limit():
    log = """Result - Stopped on time limit

Objective value:                126125.42903012
Lower bound:                    36826.442
Gap:                            2.42
Enumerated nodes:               0
Total iterations:               0
Time (CPU seconds):             22.26
Time (Wallclock seconds):       45.14

Total time (CPU seconds):       22.28   (Wallclock seconds):       45.27
"""
    out = parse_cbc_log(log)
    assert out == {
        "result": "Stopped on time limit",
        "objective": 126125.42903012,
        "lower_bound": 36826.442,
        "lower_bound_rounding": 0.0005,
        "gap": 2.42,
        "nodes": 0,
        "iterations": 0,
        "cpu_seconds": 22.28,
        "wall_seconds": 45.27,
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_time_limited_run_is_honest(backend):
    """A hard instance stopped after 1 s (here: incumbent, no proof; PuLP says
    status 1 = "Optimal" with sol_status 2 for CBC). Never "Optimal" unless proven."""
    mrf = step_sized_mrf(60, 180, (10, 20), (5, 8), seed=3)
    res = solve_ilp(mrf, backend=backend, time_limit_s=1.0)
    assert res.status in (OPTIMAL, FEASIBLE_TIME_LIMIT, NOT_SOLVED)
    if res.status == FEASIBLE_TIME_LIMIT:
        assert res.lower_bound < res.objective == mrf.evaluate(res.labels)
        assert res.lower_bound_source == "ilp" and res.extra["mip_gap"] > 0
        if backend == "highs":
            assert res.extra["highs_model_status"] == "kTimeLimit"
        else:
            assert res.extra["pulp_status"] == (1, 2)
    elif res.status == NOT_SOLVED:
        assert (res.labels == -1).all() and res.objective == math.inf


def test_dominated_labels_are_dropped_exactly():
    """Labels with equal classes on every edge (and equal constraint coefs):
    only the cheapest survives; the optimum is unchanged."""
    f = PairwiseFactor(
        np.array([0, 0, 1, 1], np.int32),
        np.array([0, 1], np.int32),
        np.array([[0.0, 4.0], [4.0, 0.0]]),
    )
    unary = [np.array([3.0, 1.0, 2.0, 2.0]), np.array([0.0, 0.5])]
    mrf = MRF(np.array([4, 2]), unary, np.array([[0, 1]]), eager_factors([f]))
    model = build_model(mrf)
    assert model.x_label[: model.x_start[1]].tolist() == [1, 2]  # 0 dominated by 1, 3 by 2
    assert model.labels_dominated == 2 + 0
    assert build_model(mrf, dominance=False).num_y == model.num_y
    # a linear constraint that tells labels 2 and 3 apart keeps both
    lc = LinearConstraint("mem", {0: np.array([1.0, 1.0, 5.0, 0.0])}, -math.inf, 1.0)
    mrf_c = MRF(mrf.domain_sizes, unary, mrf.edges, mrf.factor, 0.0, [lc])
    assert build_model(mrf_c).x_label[:3].tolist() == [1, 2, 3]
    for m in (mrf, mrf_c):
        for b in BACKENDS:
            assert solve_ilp(m, backend=b).objective == optimum(m)


@pytest.mark.parametrize("seed", range(10))
def test_dominance_keeps_ilp_and_only_raises_lp(seed):
    from pipeline.solvers.ilp import solve_model as _solve_model

    mrf = loopy_mrf(seed + 50, 6, kmin=3, kmax=6, max_classes=2, inf_frac=0.05,
                    rows=_rows(bool(seed % 2)))
    outs = []
    for dominance in (False, True):
        model = build_model(mrf, dominance=dominance)
        kw = dict(time_limit_s=None, mip_gap=0.0, threads=1, msg=False, mps_path=None)
        ilp = _solve_model(model, "highs", relax=False, **kw)
        lp = _solve_model(model, "highs", relax=True, **kw)
        outs.append((ilp.status, ilp.backend_objective, lp.dual_bound))
    (s0, ilp0, lp0), (s1, ilp1, lp1) = outs
    assert s0 == s1
    if s0 == OPTIMAL:
        assert ilp0 == pytest.approx(ilp1, abs=1e-9)
        assert lp0 <= lp1 + 1e-9 and lp1 <= ilp1 + 1e-9


@pytest.mark.parametrize("backend", BACKENDS)
def test_positive_mip_gap_reports_the_dual_bound(backend):
    """ "Optimal (within gap tolerance)" must not claim bound == objective."""
    mrf = step_sized_mrf(30, 90, (8, 14), (4, 7), seed=3)
    res = solve_ilp(mrf, backend=backend, mip_gap=0.2, time_limit_s=3.0)
    assert res.status in (OPTIMAL, FEASIBLE_TIME_LIMIT)
    assert res.lower_bound <= res.objective == mrf.evaluate(res.labels)
    if res.status == OPTIMAL:
        assert res.objective - res.lower_bound <= 0.2 * abs(res.objective) + 1e-6
    if backend == "cbc":  # CBC stops at the root here, "within gap tolerance"
        assert res.lower_bound < res.objective
        # the reported gap has the denominator of relative_gap, like every other gap
        assert res.extra["mip_gap"] == pytest.approx(
            relative_gap(res.objective, res.lower_bound), rel=1e-9)
        assert res.lower_bound >= lp_lower_bound(mrf).lower_bound - 1e-3  # cuts only raise it
