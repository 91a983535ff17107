"""The stage contracts of pipeline/core/artifacts.py: names, writers and readers that exist,
the Snakemake outputs per cost mode, schema versions, and the ``factors.npz`` format
(pipeline/stages/costs/factors_file.py: the complete MRF, constraint rows included) read
back bit for bit."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipeline.core import artifacts
from pipeline.core.errors import PlanError
from pipeline.solvers.mrf import MRF, LinearConstraint, PairwiseFactor
from pipeline.stages.costs.factors_file import load_factors, save_factors


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("artifact", artifacts.ARTIFACTS, ids=lambda a: f"{a.stage}/{a.name}")
def test_writer_and_reader_exist(artifact: artifacts.Artifact) -> None:
    assert callable(_resolve(artifact.writer))
    if artifact.reader is not None:
        assert callable(_resolve(artifact.reader))


def test_names_are_unique_per_stage_directory() -> None:
    seen = [(a.stage, a.name) for a in artifacts.ARTIFACTS]
    assert len(seen) == len(set(seen))


def test_sentinels_are_the_records_each_stage_writes_last() -> None:
    from pipeline.stages import runner as cli
    from pipeline.tools import bench

    assert artifacts.SENTINELS == {"trace": "graph.parquet", "topology": "topology.json",
                                   "costs": "costs.json", "solve": "run.json",
                                   "report": "runs.parquet"}
    assert cli.SENTINELS is artifacts.SENTINELS
    assert bench._SENTINELS == {k: v for k, v in artifacts.SENTINELS.items() if k != "report"}


def test_stage_outputs_by_cost_mode() -> None:
    names = {lazy: [a.name for a in artifacts.stage_outputs("costs", lazy)]
             for lazy in (True, False)}
    assert names[True] == ["costs.json"]
    assert names[False] == ["factors.npz", "costs.json"]  # sentinel last
    assert [a.name for a in artifacts.stage_outputs("solve", True)] == [
        "solution.parquet", "redistributions.parquet", "plan.json", "run.json"]  # no model.mps
    assert [a.name for a in artifacts.stage_outputs("topology", True)] == [
        "nodes.parquet", "strategies.parquet", "edges.parquet", "topology.json"]
    assert [a.name for a in artifacts.stage_outputs("report", False)] == [
        "placements.parquet", "redistributions.parquet", "runs.parquet"]


def test_json_artifact_carries_and_checks_its_version(tmp_path: Path) -> None:
    path = artifacts.write_json(artifacts.COSTS, tmp_path, {"mode": "lazy"})
    assert json.loads(path.read_text()) == {"mode": "lazy", "schema_version": 1}
    assert artifacts.read_json(artifacts.COSTS, tmp_path)["mode"] == "lazy"
    path.write_text(json.dumps({"mode": "lazy", "schema_version": 7}))
    with pytest.raises(PlanError, match=r"costs.json: schema_version=7, this code reads 1; "
                                        r"rerun the costs stage"):
        artifacts.read_json(artifacts.COSTS, tmp_path)


def test_table_metadata_is_read_from_the_footer(tmp_path: Path) -> None:
    artifacts.write_table(artifacts.SOLUTION, tmp_path, pa.table({"x": [1, 2]}),
                          metadata={"run_id": "abc"})
    assert artifacts.table_metadata(artifacts.SOLUTION, tmp_path) == {
        "run_id": "abc", "schema_version": 1}


def _mrf_with_rows() -> tuple[MRF, list[PairwiseFactor]]:
    factors = [PairwiseFactor(np.array([0, 1, 1], np.int32), np.array([0, 0], np.int32),
                              np.array([[0.0, np.inf], [1.5, 2.25]])[:, :1].copy()),
               PairwiseFactor(np.array([0, 0], np.int32), np.array([1, 0, 1, 0], np.int32),
                              np.array([[0.1, 0.2]]))]
    rows = [LinearConstraint("param_memory", {2: np.array([0.5, 0.125, 1.0, 0.25]),
                                              0: np.array([1.0, 1 / 3, 0.0])},
                             low=0.375, high=1.0 / 7),
            LinearConstraint("other", {1: np.array([2.0, 3.0])}, low=-np.inf, high=4.0)]
    mrf = MRF(domain_sizes=np.array([3, 2, 4]),
              unary=[np.array([1.0, np.inf, 0.1]), np.array([0.0, 2.0]),
                     np.array([3.0, 0.3, 1e-300, 7.0])],
              edges=np.array([[0, 1], [1, 2]]), factor=factors.__getitem__, constant=0.5,
              linear_constraints=rows)
    return mrf, factors


def test_factors_npz_round_trip_keeps_rows_and_values(tmp_path: Path) -> None:
    mrf, factors = _mrf_with_rows()
    path = tmp_path / artifacts.FACTORS_FILE
    save_factors(path, mrf, factors)
    back = load_factors(path)
    assert back.constant == 0.5
    assert np.array_equal(back.domain_sizes, mrf.domain_sizes)
    assert np.array_equal(back.edges, mrf.edges)
    for u, v in zip(back.unary, mrf.unary):
        assert np.array_equal(u, v)
    for e, f in enumerate(factors):
        g = back.factor(e)
        assert np.array_equal(g.row_cls, f.row_cls) and np.array_equal(g.col_cls, f.col_cls)
        assert np.array_equal(g.table, f.table)
    assert [r.name for r in back.linear_constraints] == ["param_memory", "other"]
    for r, s in zip(back.linear_constraints, mrf.linear_constraints):
        assert (r.low, r.high) == (s.low, s.high)
        assert list(r.coef) == list(s.coef)  # insertion order kept (2 before 0)
        for g in s.coef:
            assert np.array_equal(r.coef[g], s.coef[g])
    # the same plan has the same energy
    labels = np.array([2, 1, 3])
    assert back.evaluate(labels) == mrf.evaluate(labels)


def test_factors_npz_without_rows(tmp_path: Path) -> None:
    mrf, factors = _mrf_with_rows()
    mrf.linear_constraints = []
    path = tmp_path / artifacts.FACTORS_FILE
    save_factors(path, mrf, factors)
    assert load_factors(path).linear_constraints == []


def test_factors_npz_of_other_code_is_refused(tmp_path: Path) -> None:
    mrf, factors = _mrf_with_rows()
    path = tmp_path / artifacts.FACTORS_FILE
    save_factors(path, mrf, factors)
    with np.load(path) as npz:
        z = {k: npz[k] for k in npz.files}
    del z["schema_version"]  # as written before versioning
    with open(path, "wb") as fh:
        np.savez(fh, **z)
    with pytest.raises(PlanError, match="schema_version=None, this code reads 1"):
        load_factors(path)


@pytest.mark.toy_runs(("mesh=8", "lazy_costs=false"))
@pytest.mark.parametrize("stage, name", [("solve", "plan.json"), ("costs", "factors.npz")])
def test_a_missing_artifact_reruns_its_stage(tmp_path: Path, toy_results, stage: str,
                                             name: str) -> None:
    """A stage is reused only when every artifact it writes is there: a deleted
    ``plan.json`` (solve) or ``factors.npz`` (eager costs) is made again by
    ``python -m pipeline``, with the same plan."""
    import json
    import subprocess
    import sys

    from fixtures import child_env

    overrides = ("mesh=8", "lazy_costs=false")
    dirs = toy_results.copy_run(tmp_path / "results", *overrides)
    before = json.loads((dirs.solve / "run.json").read_text())["placement_hash"]
    (dirs.of(stage) / name).unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "model=toy", *overrides,
         f"results_dir={tmp_path / 'results'}"], cwd=tmp_path, capture_output=True,
        text=True, timeout=900, env=child_env("1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{stage}: " in proc.stderr and "is missing; rerunning" in proc.stderr
    assert (dirs.of(stage) / name).is_file()
    assert json.loads((dirs.solve / "run.json").read_text())["placement_hash"] == before
