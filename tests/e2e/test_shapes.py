"""The mesh-shape sweep (pipeline/tools/shapes.py): the factorisations against hand-made lists
and a brute force, the dim names, bad input (one line, exit 2, nothing written), the
Snakemake rule (dry run) and, slow, the toy sweep over 8 devices end to end with its
table checked against runs made on their own."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest
from fixtures import SNAKEFILE, snakemake

from pipeline.config import load_resolved, stage_dirs
from pipeline.tools import shapes

# 64 = 2^6: a factorisation into k factors > 1 is a composition of the exponent 6 into k
# positive parts (a factor 2^a per part a), so there are C(5, k-1) of them:
# k=1: 1, k=2: 5, k=3: 10, k=4: 10. Written out by hand:
HAND_64 = {
    1: [(64,)],
    # exponents (1,5) (2,4) (3,3) (4,2) (5,1)
    2: [(2, 32), (4, 16), (8, 8), (16, 4), (32, 2)],
    # exponents (1,1,4) (1,2,3) (1,3,2) (1,4,1) (2,1,3) (2,2,2) (2,3,1) (3,1,2) (3,2,1) (4,1,1)
    3: [(2, 2, 16), (2, 4, 8), (2, 8, 4), (2, 16, 2), (4, 2, 8), (4, 4, 4), (4, 8, 2),
        (8, 2, 4), (8, 4, 2), (16, 2, 2)],
    # exponents (1,1,1,3) (1,1,2,2) (1,1,3,1) (1,2,1,2) (1,2,2,1) (1,3,1,1) (2,1,1,2)
    # (2,1,2,1) (2,2,1,1) (3,1,1,1)
    4: [(2, 2, 2, 8), (2, 2, 4, 4), (2, 2, 8, 2), (2, 4, 2, 4), (2, 4, 4, 2), (2, 8, 2, 2),
        (4, 2, 2, 4), (4, 2, 4, 2), (4, 4, 2, 2), (8, 2, 2, 2)],
}
# 8 = 2^3: k=1: (8); k=2: (2,4), (4,2); k=3: (2,2,2); no 4 factors > 1.
HAND_8 = [(8,), (2, 4), (4, 2), (2, 2, 2)]


def test_factorisations_of_64_are_the_hand_made_list() -> None:
    got = shapes.factorisations(64)
    assert got == HAND_64[1] + HAND_64[2] + HAND_64[3]
    assert len(got) == 1 + 5 + 10
    got4 = shapes.factorisations(64, max_dims=4)
    assert got4 == HAND_64[1] + HAND_64[2] + HAND_64[3] + HAND_64[4]
    assert len(got4) == 26
    assert [len([s for s in got4 if len(s) == k]) for k in (1, 2, 3, 4)] == [
        math.comb(5, k - 1) for k in (1, 2, 3, 4)]
    assert shapes.factorisations(8) == HAND_8
    assert shapes.factorisations(8, max_dims=1) == [(8,)]
    assert shapes.factorisations(7) == [(7,)]  # a prime has only its 1-D mesh


@pytest.mark.parametrize("world", [12, 30, 36, 48, 64, 97])
def test_factorisations_match_a_brute_force(world: int) -> None:
    """Every tuple of 1..4 numbers in 2..world whose product is world, none of size 1."""
    brute = {k: sorted(t for t in itertools.product(range(2, world + 1), repeat=k)
                       if math.prod(t) == world) for k in (1, 2, 3, 4)}
    got = shapes.factorisations(world, max_dims=4)
    assert got == [t for k in (1, 2, 3, 4) for t in brute[k]]
    assert all(d > 1 for t in got for d in t)


def test_dims_are_named_by_rank_tp_innermost() -> None:
    assert shapes.shape_overrides((64,)) == ["mesh=64", "mesh_names=[dp]"]
    assert shapes.shape_overrides((8, 8)) == ["mesh=8x8", "mesh_names=[dp,tp]"]
    assert shapes.shape_overrides((2, 4, 8)) == ["mesh=2x4x8", "mesh_names=[dp,cp,tp]"]
    assert shapes.shape_overrides((2, 2, 2, 8)) == ["mesh=2x2x2x8",
                                                     "mesh_names=[pp,dp,cp,tp]"]
    # the names of ranks 1-3 are the planner's defaults
    cfg = load_resolved(["model=toy", *shapes.shape_overrides((2, 4, 8))])
    assert list(cfg.mesh_names) == ["dp", "cp", "tp"]
    assert list(load_resolved(["model=toy", "mesh=2x4x8"]).mesh_names) == ["dp", "cp", "tp"]


def test_every_shape_shares_the_trace_and_names_one_sweep_directory(tmp_path: Path) -> None:
    sweep = shapes.prepare(8, 3, ["model=toy", f"results_dir={tmp_path}"])
    assert sweep.shapes == HAND_8
    dirs = [stage_dirs(c) for c in sweep.configs]
    assert len({d.trace for d in dirs}) == 1
    assert len({d.topology for d in dirs}) == 4
    assert {shapes.sweep_dir(c, 8, 3) for c in sweep.configs} == {sweep.out_dir}
    assert sweep.out_dir.parent.parent == tmp_path / "shapes"
    assert sweep.out_dir.name == "w8-d3"
    assert not any(tmp_path.iterdir())  # preparing writes nothing


@pytest.mark.parametrize(("args", "message"), [
    (["world=1"], "world=1: allowed an integer >= 2"),
    (["world=abc"], "world=abc: allowed an integer >= 2"),
    (["world=8", "max_dims=5"], "max_dims=5: allowed an integer from 1 to 4"),
    (["world=8", "max_dims=0"], "max_dims=0: allowed an integer from 1 to 4"),
    (["world=8", "mesh=2x4"], "mesh=2x4: the shape sweep sets mesh and mesh_names itself"),
    (["model=toy"], "world: missing; allowed world=<integer >= 2>"),
    (["world=8", "solver=foo"], "solver=foo: allowed"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path: Path, capsys, args,
                                                      message) -> None:
    code = shapes.main([*args, f"results_dir={tmp_path / 'results'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(message), err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()


def test_markdown_table_and_order() -> None:
    table = pd.DataFrame([
        {"rank": 1, "mesh": "2x4", "mesh_names": "dp,tp", "dims": 2, "objective": 1234.5,
         "compute_us": 1.0, "comm_us": 2.0, "transition_us": 3.0, "status": "Optimal",
         "gap": 0.0, "placement_hash": "h", "run_id": "r", "solve_dir": "d"}])
    md = shapes.markdown_table(table)
    assert md.splitlines()[0] == ("| rank | mesh | mesh_names | dims | objective | compute_us "
                                  "| comm_us | transition_us | status | gap | run_id |")
    assert ("| 1 | 2x4 | dp,tp | 2 | 1,234.500 | 1.000 | 2.000 | 3.000 | Optimal | 0.0000 | r |"
            in md)


def test_snakemake_rule_is_one_job_and_refuses_a_bad_world(tmp_path: Path) -> None:
    code, out, err = snakemake(tmp_path, "-n", "shapes", "--config", "world=8", "model=toy")
    assert code == 0, err
    assert "shapes        1" in out
    assert "results/shapes/toy-" in out and "/w8-d3/shapes.parquet" in out
    code, out, err = snakemake(tmp_path, "-n", "shapes", "--config", "world=1", "model=toy")
    assert code == 2
    assert "world=1: allowed an integer >= 2" in err
    assert not (tmp_path / "results").exists()


# --------------------------------------------------------------------------- end to end

#: The toy sweep over 8 devices, by Snakemake in its own directory (a background job).
OWN_JOBS = {"shapes-toy-8": ("test_toy_sweep_end_to_end",)}


def own_job_argv(key: str, base: Path) -> tuple[list[str], str]:
    assert key == "shapes-toy-8"
    return ([sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE),
             "--directory", str(base), "shapes", "--cores", "1", "--config", "world=8",
             "model=toy"], "1")


@pytest.mark.slow
@pytest.mark.toy_runs(("mesh=8", "lazy_costs=true"), ("mesh=2x4", "lazy_costs=true"))
def test_toy_sweep_end_to_end(jobs, toy_results, tmp_path_factory) -> None:
    from fixtures import own_jobs_dir

    jobs.result("shapes-toy-8")
    base = own_jobs_dir(tmp_path_factory, __name__)
    results = base / "results"
    (out,) = list((results / "shapes").glob("toy-*/w8-d3"))
    table = pd.read_parquet(out / "shapes.parquet")
    assert sorted(table["mesh"]) == sorted(["8", "2x4", "4x2", "2x2x2"])
    # by simulated step time; a rank is shared only by a tie within 2 % (the default
    # costs.step_time_uncertainty) of the class's first step time
    steps, ranks = list(table["step_time_us"]), list(table["rank"])
    assert steps == sorted(steps) and ranks[0] == 1
    for i in range(1, 4):
        if ranks[i] != i + 1:
            assert ranks[i] == ranks[i - 1] and table["tie"][i] and table["tie"][i - 1]
            assert steps[i] - steps[ranks[i] - 1] <= 0.02 * steps[ranks[i] - 1]
    assert dict(zip(table["mesh"], table["mesh_names"], strict=True)) == {
        "8": "dp", "2x4": "dp,tp", "4x2": "dp,tp", "2x2x2": "dp,cp,tp"}
    csv = pd.read_csv(out / "shapes.csv")
    assert list(csv["mesh"]) == list(table["mesh"])
    md = (out / "shapes.md").read_text()
    assert all(f"| {m} |" in md for m in table["mesh"])
    assert (out / "shapes.png").stat().st_size > 10_000
    # each row is its run's record
    for _, row in table.iterrows():
        solve = base / row["solve_dir"]  # relative to the working directory, as results_dir
        rec = json.loads((solve / "run.json").read_text())
        assert rec["objective"] == row["objective"]
        assert rec["mesh"] == row["mesh"]
        assert (solve / "plan.png").exists()
    # one trace for all four shapes
    assert len(list((results / "runs").glob("*/graph.parquet"))) == 1
    # the same configs planned on their own (the session's shared runs, another results
    # directory) give the same objectives and plans
    by_mesh = table.set_index("mesh")
    for mesh in ("8", "2x4"):
        run = toy_results.run(f"mesh={mesh}", "lazy_costs=true")
        assert by_mesh.loc[mesh, "objective"] == pytest.approx(run.record["objective"],
                                                               rel=1e-12)
        assert by_mesh.loc[mesh, "placement_hash"] == run.record["placement_hash"]


@pytest.mark.slow
@pytest.mark.toy_runs(("mesh=8", "lazy_costs=true"))
def test_a_shape_the_planner_refuses_is_a_not_applicable_row(toy_results, tmp_path: Path,
                                                             capsys) -> None:
    """32 devices on one dim: the default input placement S(0) would shard the toy batch
    of 16 over 32 devices: the row is 'not applicable' and says why (naming
    model.batch_size); the sweep completes and, as no shape planned, exits 1."""
    results = tmp_path / "results"
    toy_results.copy_run(results, "mesh=8", "lazy_costs=true", upto="trace")  # the trace
    assert shapes.main(["world=32", "max_dims=1", "model=toy", f"results_dir={results}"]) == 1
    out, err = capsys.readouterr()
    assert "1 shapes, 1 not planned, none planned" in out
    assert err.splitlines()[-2:] == ["shapes: planned 0, ok 0, failed 0",
                                     "shapes: none of the 1 shapes planned"]
    (out,) = list((results / "shapes").glob("toy-*/w32-d1"))
    table = pd.read_parquet(out / "shapes.parquet")
    assert list(table["mesh"]) == ["32"] and list(table["status"]) == ["not applicable"]
    assert table["objective"].isna().all()
    assert table["error"][0].startswith(
        "model.batch_size=16: the inputs are sharded on mesh dims dp (32)")
    assert "| 32 | dp | 1 |" in (out / "shapes.md").read_text()
    assert (out / "shapes.png").exists()


def test_table_puts_planned_shapes_first_and_failed_ones_last(tmp_path: Path) -> None:
    dirs = []
    for mesh, names, objective in (("2x4", ["dp", "tp"], 20.0), ("8", ["dp"], 10.0)):
        d = tmp_path / mesh
        d.mkdir()
        (d / "run.json").write_text(json.dumps({
            "mesh": mesh, "mesh_names": names, "objective": objective, "status": "Optimal",
            "gap": 0.0, "run_id": mesh, "placement_hash": "h", "compute_us": 1.0,
            "comm_us": 2.0, "transition_us": 3.0}))
        dirs.append(d)
    table = shapes.shape_table(dirs, {(2, 2, 2): "no plan | fits"})
    assert list(table["mesh"]) == ["8", "2x4", "2x2x2"]
    assert list(table["rank"]) == [1, 2, 3]
    assert list(table["status"]) == ["Optimal", "Optimal", "failed"]
    assert list(table["error"])[2] == "no plan | fits"
    assert "step_time_us" not in table.columns
    md = shapes.markdown_table(table)
    assert "| 3 | 2x2x2 | dp,cp,tp | 3 |  |  |  |  | failed |  |  | no plan \\| fits |" in md
    # a run record with the step time gives the column
    rec = json.loads((dirs[0] / "run.json").read_text())
    (dirs[0] / "run.json").write_text(json.dumps({**rec, "step_time_us": 25.0}))
    table = shapes.shape_table(dirs)
    # ordered by step time: the run without one after it, whatever the objectives
    assert list(table["mesh"]) == ["2x4", "8"]
    assert table["step_time_us"].isna().tolist() == [False, True]
    assert table["step_time_us"][0] == 25.0 and list(table["rank"]) == [1, 2]
    # both with step times: 25.4 is within 2 % of 25 (a tie, one rank) but not within 1 %
    rec = json.loads((dirs[1] / "run.json").read_text())
    (dirs[1] / "run.json").write_text(json.dumps({**rec, "step_time_us": 25.4,
                                                  "step_time_gap": 0.5}))
    table = shapes.shape_table(dirs, uncertainty=0.02)
    assert list(table["mesh"]) == ["2x4", "8"] and list(table["rank"]) == [1, 1]
    assert list(table["tie"]) == [True, True] and table["step_time_gap"][1] == 0.5
    assert "| 1 | 8 | dp | 1 | 25.400 | tie | 0.5000 |" in shapes.markdown_table(table)
    table = shapes.shape_table(dirs, uncertainty=0.01)
    assert list(table["rank"]) == [1, 2] and list(table["tie"]) == [False, False]


def test_a_shape_whose_inputs_cannot_be_sharded_does_not_stop_the_sweep(tmp_path: Path) -> None:
    """toy's batch of 16 cannot be split over a first mesh dim of 64 or 32: those two
    shapes are failed rows of the sweep, the other 14 of world=64 are planned (the
    sweep's check of the model runs on a shape that fits)."""
    from pipeline.tools.shapes import _inputs_fit, prepare

    sweep = prepare(64, 3, ["model=toy", f"results_dir={tmp_path}"])
    assert len(sweep.configs) == 16
    unfit = sorted(tuple(int(d) for d in c.mesh) for c in sweep.configs if not _inputs_fit(c))
    assert unfit == [(32, 2), (64,)]
