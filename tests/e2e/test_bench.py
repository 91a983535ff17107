"""Benchmark runner (pipeline/tools/bench/): the ``smoke`` suite end to end in fresh
processes, ``--dry-run``, one-line usage errors, and a failing case recorded as ``Error``
without stopping the suite.

The smoke suite runs six toy-model cases, each a fresh ``python -m pipeline`` process
(about a minute on an idle 2-core machine; ``slow``), as a background job of the session
queued at its start.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures import SEED, own_jobs_dir

from pipeline.tools import bench

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_COLUMNS = {
    "model", "n_layers", "mesh", "solver", "backend", "cost_mode", "nodes", "groups",
    "group_strategies", "factors_materialised", "trace", "topology", "cost_build",
    "factor_build", "solve", "search_total", "wall", "cpu", "peak_rss_mib", "objective",
    "lower_bound", "gap", "status", "additive_status", "step_time_us",
    "step_time_lower_bound_us", "step_time_gap", "placement_hash", "time_limit_s", "case", "error",
    "exit_code", "reused", "code", "revision",
}


def run_bench(cwd: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    return subprocess.run([sys.executable, "-m", "pipeline.tools.bench", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


#: The smoke suite runs as a background job of the session (tests/support/fixtures.py).
OWN_JOBS = {"bench-smoke": ("test_smoke_suite_fresh",)}


def own_job_argv(key: str, base: Path) -> tuple[list[str], str]:
    """``python -m pipeline.tools.bench --suite smoke --fresh`` into ``base/bench``."""
    assert key == "bench-smoke", key
    return [sys.executable, "-m", "pipeline.tools.bench", "--suite", "smoke", "--fresh", "--out",
            str(base / "bench")], SEED


@pytest.mark.slow
def test_smoke_suite_fresh(jobs, tmp_path_factory):
    out = own_jobs_dir(tmp_path_factory, __name__) / "bench"
    proc = jobs.result("bench-smoke")  # exit 0, or AssertionError with its stderr
    n = len(bench.SUITES["smoke"].cases)
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("[")]
    assert len(progress) == n  # one progress line per case

    table = pq.read_table(out / "smoke.parquet")
    assert EXPECTED_COLUMNS <= set(table.column_names)
    meta = json.loads(table.schema.metadata[b"pipeline"])
    assert meta["complete"] and meta["fresh"] and meta["suite"] == "smoke"
    assert meta["machine"]["cpu_model"] and meta["machine"]["cpu_count"] >= 1
    rows = table.to_pylist()
    assert len(rows) == n
    for r in rows:
        assert r["status"] in ("Optimal", "Heuristic"), r
        assert r["exit_code"] == 0 and r["error"] is None
        assert r["model"] == "toy" and r["n_layers"] == 2
        assert not r["reused"]  # --fresh: every stage ran in the measured process
        assert r["wall"] > 0 and r["cpu"] > 0 and r["peak_rss_mib"] > 50
        assert r["trace"] > 0 and r["search_total"] >= r["trace"]
        assert r["nodes"] > 0 and r["groups"] > 0 and r["group_strategies"] >= r["groups"]
        assert len(r["placement_hash"]) == 64
        assert len(r["code"]) == 12 and r["revision"]
        assert math.isfinite(r["objective"]) and r["lower_bound"] <= r["objective"] + 1e-6
        assert Path(r["run_record"]).is_relative_to(out / "fresh" / "smoke")

    for mesh in ("8", "2x4"):
        approx = {r["cost_mode"]: r for r in rows
                  if r["mesh"] == mesh and r["solver"] == "approx"}
        assert set(approx) == {"lazy", "eager"}
        assert approx["lazy"]["objective"] == approx["eager"]["objective"]
        assert approx["lazy"]["placement_hash"] == approx["eager"]["placement_hash"]
        assert approx["lazy"]["factor_build"] > 0
        (ilp,) = [r for r in rows if r["mesh"] == mesh and r["solver"] == "ilp"]
        assert ilp["additive_status"] == "Optimal" and ilp["backend"] == "highs"
        # the additive certificate: the ILP's bound is the additive optimum; no plan
        # steps faster than either run's step-time bound
        assert ilp["lower_bound"] <= approx["lazy"]["objective"] * (1 + 1e-9)
        for r in (ilp, approx["lazy"], approx["eager"]):
            assert r["step_time_lower_bound_us"] <= min(
                ilp["step_time_us"], approx["lazy"]["step_time_us"]) * (1 + 1e-9)
        if approx["lazy"]["additive_status"] == "Optimal":
            assert math.isclose(ilp["lower_bound"], approx["lazy"]["lower_bound"],
                                rel_tol=1e-6)

    md = (out / "smoke.md").read_text()
    assert md.startswith("# Benchmark `smoke`")
    assert meta["machine"]["cpu_model"] in md
    header = next(ln for ln in md.splitlines() if ln.startswith("| # |"))
    for name in ("trace s", "factor_build s", "search_total s", "wall s", "peak RSS MiB",
                 "objective", "placement hash", "time limit s"):
        assert name in header
    assert sum(ln.startswith("| ") for ln in md.splitlines()) == n + 1


def test_dry_run_lists_cases_and_runs_nothing(tmp_path):
    proc = run_bench(tmp_path, "--suite", "smoke", "--dry-run", "--out", "b",
                     timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    cases = bench.SUITES["smoke"].cases
    assert len(lines) == len(cases)
    for line, case in zip(lines, cases, strict=True):
        assert f"python -m pipeline {case.label} results_dir=" in line
    assert not (tmp_path / "b").exists()


def test_only_selects_by_regex_with_trailing_space():
    suite = bench.SUITES["search"]
    picked = [c.label for c in suite.cases if "mesh=8 " in c.label + " "]
    assert picked and all(" mesh=8 " in c for c in picked)
    assert len(suite.cases) == 11  # 3 meshes x lazy/eager + depths 2, 4, 8, 32, 64


@pytest.mark.parametrize("args, message", [
    (["--suite", "nope"], "--suite=nope: allowed search, solvers, big, smoke, models"),
    (["--suite", "smoke", "--only", "mesh=3x3"],
     "--only=mesh=3x3: matches none of the 6 cases of suite smoke"),
    (["--only", "("], "--only=(: not a regular expression"),
])
def test_bad_usage_is_one_line(tmp_path, capsys, args, message):
    assert bench.main([*args, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(message)
    assert not (tmp_path / "b").exists()


def test_bad_suite_through_the_command_line(tmp_path):
    proc = run_bench(tmp_path, "--suite", "nope", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "--suite=nope: allowed search, solvers, big, smoke, models"


def test_failing_cases_are_recorded_and_the_suite_goes_on(tmp_path, monkeypatch, capsys):
    broken = bench.Suite("broken", "two failing cases", (
        bench.Case(("model=toy", "mesh=0")),
        bench.Case(("model=toy", "mesh=8", "model.n_heads=7")),
    ))
    monkeypatch.setitem(bench.SUITES, "broken", broken)
    out = tmp_path / "b"
    assert bench.main(["--suite", "broken", "--out", str(out)]) == 1
    rows = pq.read_table(out / "broken.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["Error", "Error"]
    assert all(r["exit_code"] == 2 for r in rows)
    assert rows[0]["error"].startswith("exit 2: mesh=0: allowed positive integers")
    assert "\n" not in rows[1]["error"] and "n_heads" in rows[1]["error"]
    assert rows[1]["model"] is None  # the config does not resolve: nothing to report
    md = (out / "broken.md").read_text()
    assert "| Error |" in md and "mesh=0: allowed" in md
    err = capsys.readouterr().err
    assert err.count("Error (") == 2


def test_timeout_kills_the_case_and_records_it(tmp_path, monkeypatch):
    slow = bench.Suite("slow", "one case longer than the timeout",
                       (bench.Case(("model=toy", "mesh=8")),))
    monkeypatch.setitem(bench.SUITES, "slow", slow)
    out = tmp_path / "b"
    assert bench.main(["--suite", "slow", "--out", str(out), "--timeout", "1"]) == 1
    (row,) = pq.read_table(out / "slow.parquet").to_pylist()
    assert row["status"] == "Error" and row["error"].startswith("timeout after 1 s")
    assert row["exit_code"] == -9 and row["wall"] < 30
    assert row["model"] == "toy"  # the config resolves; the run record is never read
