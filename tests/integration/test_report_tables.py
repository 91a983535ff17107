"""The report stage over several runs: ``report/runs.parquet`` and
``report/placements.parquet`` have one row per run and per (run, node), with the run
record's fields (objective and its parts, bound, status, placement hash, counts, phases,
peak RSS). The report covers copies of the session's shared toy runs at meshes 8 and
2x4 with lazy and eager costs, and (slow) those at 2x4x8 too."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pyarrow.parquet as pq
import pytest
from fixtures import ToyResults
from toy_plans import ALL_MESHES, MESHES, MODES, get_run, rel_close, run_marks, toy_overrides

REPORT_FIELDS = ["objective", "compute_us", "comm_us", "transition_us", "lower_bound",
                 "lower_bound_source", "lower_bound_problem", "gap", "status",
                 "placement_hash", "counts.nodes", "counts.edges", "counts.groups",
                 "counts.strategies", "counts.factors_materialised.total",
                 "phases.trace", "phases.topology", "phases.cost_build", "phases.factor_build",
                 "phases.solve", "phases.search_total", "phases.wall",
                 "peak_rss_bytes.self", "peak_rss_bytes.children", "peak_rss_bytes.max",
                 "environment.python", "environment.torch", "environment.pulp",
                 "environment.snakemake", "environment.cpu_model", "environment.cpu_count",
                 "git.revision", "git.dirty"]


#: The runs a report covers: those of the quick meshes, or (slow) every toy run.
REPORT_RUNS: dict[str, list[tuple[str, str]]] = {
    "quick": [(m, md) for m in MESHES for md in MODES],
    "all": [(m, md) for m in ALL_MESHES for md in MODES],
}


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=run_marks(*runs)) for name, runs in REPORT_RUNS.items()])
def report(request: pytest.FixtureRequest, toy_results: ToyResults,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The report over exactly the toy runs of ``REPORT_RUNS[param]``: the shared runs,
    copied into a results directory of their own, then the report stage there (the
    shared directory has no report). A row's ``solve_dir`` is the one its run record
    names: where the run was solved."""
    from pipeline.config import stage_dirs
    from pipeline.stages.runner import run_stage

    wanted = REPORT_RUNS[request.param]
    root = tmp_path_factory.mktemp(f"report-{request.param}") / "results"
    runs = [get_run(toy_results, mesh, mode) for mesh, mode in wanted]
    for mesh, mode in wanted:
        toy_results.copy_run(root, *toy_overrides(mesh, mode))
    cfg = toy_results.cfg(results_dir=root)
    dirs = stage_dirs(cfg)
    assert run_stage("report", cfg, dirs)
    return {"runs": runs, "expected": len(wanted),
            "table": pq.read_table(dirs.report / "runs.parquet").to_pylist(),
            "placements": pq.read_table(dirs.report / "placements.parquet")}


def test_report_runs_parquet(report: dict[str, Any]) -> None:
    runs, table = report["runs"], report["table"]
    assert len(table) == len(runs) == report["expected"]
    # approx runs without recipe or revision label: no column is null in every row
    # (recipe, backend and revision_label are absent, not null)
    assert not [c for c in table[0] if all(row.get(c) is None for row in table)]
    by_dir = {row["solve_dir"]: row for row in table}
    assert len(by_dir) == len(table)
    for run in runs:
        row = by_dir[str(run.dirs.solve)]
        missing = [f for f in REPORT_FIELDS if f not in row]
        assert not missing, f"runs.parquet lacks {missing}"
        rec = run.record
        for f in ("objective", "lower_bound", "gap", "status", "placement_hash"):
            assert row[f] == rec[f], f
        assert row["phases.solve"] == rec["phases"]["solve"]
        assert row["environment.torch"] == rec["environment"]["torch"]
        assert row["model"] == "toy" and row["mesh"] == run.mesh
        assert row["cost_mode"] == run.mode
        assert row["status"] in ("Optimal", "Heuristic")
        # Optimal only where the step-time bound closes the gap
        assert (row["status"] == "Optimal") == (row["step_time_gap"] <= 1e-9)
        assert row["additive_status"] == "Optimal" or row["gap"] > 0
        rev = row["git.revision"]
        assert (isinstance(rev, str) and len(rev) == 40) or row.get("revision_label"), rev
        for k in ("trace", "topology", "cost_build", "factor_build", "solve", "wall"):
            assert row[f"phases.{k}"] >= 0, k
        total = sum(row[f"phases.{k}"] for k in
                    ("trace", "topology", "cost_build", "factor_build", "solve"))
        assert rel_close(row["phases.search_total"], total, 1e-6), (row["phases.search_total"],
                                                                    total)
        assert row["peak_rss_bytes.max"] >= row["peak_rss_bytes.self"] > 0


def test_report_phase_names_complete(report: dict[str, Any]) -> None:
    for row in report["table"]:
        missing = [k for k in ("trace", "topology", "cost_build", "factor_build", "solve",
                               "report", "search_total", "wall") if f"phases.{k}" not in row]
        assert not missing, f"runs.parquet lacks phases {missing}"


def test_report_placements_parquet(report: dict[str, Any]) -> None:
    runs, placements = report["runs"], report["placements"]
    assert placements.num_rows == sum(len(r.plan) for r in runs)
    nodes = {len(r.plan) for r in runs}
    assert len(nodes) == 1
    assert placements.num_rows == nodes.pop() * len(runs)
    per_run = Counter(placements.column("run_id").to_pylist())
    assert per_run == {r.record["run_id"]: len(r.plan) for r in runs}
    # the rows are the runs' plans
    rows = placements.select(["run_id", "name", "output_placement"]).to_pylist()
    got = defaultdict(list)
    for row in rows:
        got[row["run_id"]].append((row["name"], row["output_placement"]))
    for r in runs:
        assert sorted(got[r.record["run_id"]]) == sorted(
            (p["name"], p["output_placement"]) for p in r.plan)
