"""An exact solve stopped by its time limit returns a plan: its incumbent when that is a
plan, else the TRW-S plan of the pruning step (status ``Heuristic``, the better bound
and the gap), never a traceback (pipeline/solvers/ilp/fallback.py).

The backend's answer "time limit, incumbent that is no plan" and "time limit, no
incumbent" is made at the backend boundary (``solve_model``), so these run the same on a
fast or a slow machine; one real ``python -m pipeline`` run stops HiGHS by a tiny limit.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fixtures import child_env
from mrf_gen import loopy_mrf, optimum

import pipeline.solvers.ilp as ilp
from pipeline.solvers.ilp import BackendOutcome, build_model, solve_ilp
from pipeline.solvers.ilp.fallback import plan_problem
from pipeline.solvers.result import SolverResult, relative_gap
from pipeline.solvers.status import FEASIBLE_TIME_LIMIT, HEURISTIC, NOT_SOLVED


def _instance():
    """A loopy MRF with one binding row, a labelling of finite energy that violates it,
    and two plans (the optimum and a worse one)."""
    for seed in range(200):
        mrf = loopy_mrf(seed, rows=("upper",))
        if not math.isfinite(optimum(mrf)):
            continue
        plans, off_row = [], None
        for lab in itertools.product(*[range(int(k)) for k in mrf.domain_sizes]):
            lab = np.asarray(lab, dtype=np.int64)
            if not math.isfinite(mrf.evaluate(lab)):
                continue
            if plan_problem(mrf, lab) is None:
                plans.append(lab)
            elif off_row is None:
                off_row = lab
        energies = sorted({mrf.evaluate(p) for p in plans})
        if off_row is not None and len(energies) >= 2:
            worse = next(p for p in plans if mrf.evaluate(p) == energies[-1])
            return mrf, off_row, worse
    raise AssertionError("no instance with a violated row and two plan energies")


def _x_of(mrf, labels: np.ndarray) -> np.ndarray:
    """The program's column values of ``labels`` (x only; y are left 0)."""
    model = build_model(mrf, dominance=False)
    x = np.zeros(model.num_cols)
    for col, (g, k) in enumerate(zip(model.x_group, model.x_label, strict=True)):
        x[col] = float(labels[g] == k)
    return x


def _stopped(monkeypatch, status: str, col_value, dual_bound: float) -> None:
    """The backend stops at its time limit with ``status`` / ``col_value`` / bound."""
    def fake(model, backend, **kw):
        return BackendOutcome(status, col_value, math.inf, dual_bound, math.inf, 1.0, 0,
                              {"highs_model_status": "kTimeLimit"})

    monkeypatch.setattr(ilp, "solve_model", fake)
    monkeypatch.setattr(ilp, "build_model", lambda mrf: build_model(mrf, dominance=False))


def _trws_like(mrf, labels, bound: float) -> SolverResult:
    return SolverResult(labels=labels, objective=mrf.evaluate(labels), lower_bound=bound,
                        lower_bound_source="trws", status=HEURISTIC, iterations=3)


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_no_incumbent_gives_the_fallback_plan_heuristic_with_the_better_bound(
        monkeypatch, backend):
    mrf, _, worse = _instance()
    best = optimum(mrf)
    fallback = _trws_like(mrf, worse, best - 5.0)
    _stopped(monkeypatch, NOT_SOLVED, None, best - 1.0)  # the program proved more
    res = solve_ilp(mrf, backend=backend, time_limit_s=1.0, fallback=fallback)
    assert res.status == HEURISTIC
    assert np.array_equal(res.labels, worse)
    assert res.objective == mrf.evaluate(worse) and math.isfinite(res.objective)
    assert res.lower_bound == best - 1.0 and res.lower_bound_source == "ilp"
    assert res.objective >= res.lower_bound
    assert res.extra["exact_status"] == NOT_SOLVED and res.extra["fallback"] == "trws"
    assert res.extra["gap"] == relative_gap(res.objective, res.lower_bound)


def test_an_incumbent_that_violates_a_row_is_not_taken(monkeypatch):
    mrf, off_row, worse = _instance()
    _stopped(monkeypatch, FEASIBLE_TIME_LIMIT, _x_of(mrf, off_row), -math.inf)
    fallback = _trws_like(mrf, worse, optimum(mrf) - 2.0)
    res = solve_ilp(mrf, time_limit_s=1.0, fallback=fallback)
    assert res.status == HEURISTIC and np.array_equal(res.labels, worse)
    assert res.lower_bound == optimum(mrf) - 2.0 and res.lower_bound_source == "trws"
    assert res.extra["incumbent_rejected"].startswith("violates the rows row0")
    # without a fallback: no plan, no traceback (the stage turns it into one line)
    res = solve_ilp(mrf, time_limit_s=1.0)
    assert res.status == NOT_SOLVED and math.isinf(res.objective)
    assert (res.labels == -1).all()


def test_a_valid_incumbent_is_kept_and_a_bad_fallback_is_not_used(monkeypatch):
    mrf, off_row, worse = _instance()
    _stopped(monkeypatch, FEASIBLE_TIME_LIMIT, _x_of(mrf, worse), -math.inf)
    res = solve_ilp(mrf, time_limit_s=1.0, fallback=_trws_like(mrf, off_row, -math.inf))
    assert res.status == FEASIBLE_TIME_LIMIT and np.array_equal(res.labels, worse)
    _stopped(monkeypatch, NOT_SOLVED, None, -math.inf)
    res = solve_ilp(mrf, time_limit_s=1.0, fallback=_trws_like(mrf, off_row, -math.inf))
    assert res.status == NOT_SOLVED


@pytest.mark.slow
@pytest.mark.toy_runs(("mesh=2x4", "solver=ilp"))
def test_python_m_pipeline_stopped_by_the_time_limit_plans_heuristic(tmp_path, toy_results):
    """HiGHS stopped after 1 ms (presolve alone takes longer): exit 0, the TRW-S plan,
    status Heuristic, a finite objective >= the bound, no temp MPS file left."""
    import json

    results = tmp_path / "results"
    dirs = toy_results.copy_run(results, "mesh=2x4", "solver=ilp", upto="costs")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "model=toy", "mesh=2x4", "solver=ilp",
         "solver.time_limit_s=0.001", f"results_dir={results}"],
        cwd=tmp_path, capture_output=True, text=True, env=child_env("1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    solve = next(Path(results).glob("runs/**/ilp-*/run.json"))
    assert solve.parent.parent == Path(dirs.costs)
    record = json.loads(solve.read_text())
    assert record["status"] == HEURISTIC
    assert math.isfinite(record["objective"]) and math.isfinite(record["lower_bound"])
    assert record["objective"] >= record["lower_bound"] - 1e-9
    # the additive certificate is the additive solve's plan's (the step-time search may
    # choose another candidate: pipeline/stages/solve/objective.py)
    assert record["additive_plan_us"] >= record["lower_bound"] - 1e-9
    assert record["gap"] == relative_gap(record["additive_plan_us"], record["lower_bound"])
    assert record["additive_status"] == HEURISTIC
    assert record["solver_extra"]["exact_status"] == NOT_SOLVED
    assert record["solver_extra"]["highs_model_status"] == "kTimeLimit"
    # the program that was solved (an artifact of every ilp run) and no temp file
    assert sorted(p.name for p in results.rglob("*.mps")) == ["model.mps"]
    assert not list(results.rglob(".*.tmp"))


def test_the_stage_refuses_in_one_line_without_a_plan(tmp_path, monkeypatch):
    """No incumbent and no fallback (solver.prune=false): a PlanError of one line."""
    from pipeline.config import load_resolved
    from pipeline.core.errors import PlanError
    from pipeline.stages.solve import stage

    mrf, _, _ = _instance()
    _stopped(monkeypatch, NOT_SOLVED, None, -math.inf)
    cfg = load_resolved(["model=toy", "solver=ilp", "solver.prune=false",
                         "solver.time_limit_s=1"])
    with pytest.raises(PlanError) as err:
        stage._solve(cfg, mrf, tmp_path)
    assert str(err.value) == (
        "solver.time_limit_s=1.0: solver=ilp (highs) ended without a feasible plan "
        "(kTimeLimit) and no TRW-S plan to fall back on (solver.prune=false); allowed a "
        "larger solver.time_limit_s or null (no limit), or solver.prune=true")
