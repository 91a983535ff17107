"""The paper (pipeline/tools/paper/, workflow/rules/paper.smk): experiments compose into run
sets, the eager-vs-lazy table and the figures from a synthetic runs table with known
numbers, provenance of every artifact, the Snakemake DAG of `snakemake paper`, and one
small end-to-end paper from two real toy runs.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from fixtures import ToyResults, snakemake
from paper_runs import GIT, synthetic_runs

from pipeline.config import ConfigError, config_hash, load_resolved, stage_dirs
from pipeline.tools import paper

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy_experiment() -> paper.Experiment:
    """paper_toy as `snakemake paper` composes it (results_dir relative: chdir first)."""
    return paper.load_experiment([])


#: A one-mesh experiment: eager and lazy toy runs on mesh 8 make every run set.
SMALL = ["paper.runs.eager_vs_lazy=['mesh=8','lazy_costs=true,false']",
         "paper.runs.solvers=['mesh=8']", "paper.runs.depth=['mesh=8']",
         "paper.runs.scale=['mesh=8']", "paper.table_mesh=null"]


# --------------------------------------------------------------------------- experiments


def test_paper_toy_is_the_default_and_defines_the_run_sets(toy_experiment):
    exp = toy_experiment
    assert exp.name == "paper_toy" and exp.cfg.experiment == "paper_toy"
    assert exp.overrides[0] == "experiment=paper_toy"
    sets = exp.sets
    assert set(sets) == set(paper.RUN_SETS)
    evl = [(tuple(r.cfg.mesh), r.cfg.lazy_costs, r.cfg.solver.name) for r in sets["eager_vs_lazy"]]
    assert sorted(evl) == sorted((m, lazy, "approx") for m in ((8,), (2, 4), (2, 4, 8))
                                 for lazy in (True, False))
    assert {(tuple(r.cfg.mesh), r.cfg.solver.name) for r in sets["solvers"]} == {
        (m, solver) for m in ((8,), (2, 4), (2, 4, 8)) for solver in ("approx", "ilp")}
    assert [r.cfg.model.n_layers for r in sets["depth"]] == [2, 4, 8]
    assert all(r.cfg.model.name == "toy" for r in exp.runs())
    assert [(tuple(r.cfg.mesh), r.cfg.recipe) for r in sets["scale"]] == [
        ((2, 4), recipe) for recipe in (None, "ddp", "fsdp", "hsdp", "fsdp_tp")]
    # runs shared between sets are one run: 6 + 3 ilp + 2 deeper models + 4 recipes
    assert len(exp.runs()) == 15
    assert exp.table_mesh == "2x4x8"


def test_full_paper_experiment_composes():
    exp = paper.load_experiment(["experiment=paper"])
    assert exp.name == "paper" and exp.table_mesh == "2x4x8"
    assert {r.cfg.model.name for r in exp.runs() if r not in exp.sets["scale"]} == {"llama1b"}
    scale = {(r.cfg.model.name, "x".join(map(str, r.cfg.mesh)), r.cfg.model.batch_size,
              r.cfg.recipe) for r in exp.sets["scale"]}
    # local batch 2 x 8192 on every mesh: the planner and each recipe the mesh allows
    assert {(m, mesh, b) for m, mesh, b, _ in scale} == {
        ("llama8b", "8", 16), ("llama8b", "8x8", 128), ("llama8b", "16x8", 256),
        ("llama70b", "32x8", 512)}
    assert {r for m, mesh, _, r in scale if mesh == "8"} == {None, "ddp", "fsdp"}
    assert {r for m, mesh, _, r in scale if mesh == "32x8"} == {
        None, "ddp", "fsdp", "hsdp", "fsdp_tp"}
    assert all(r.cfg.model.seq_len == 8192 for r in exp.sets["scale"])
    assert sorted(r.cfg.model.n_layers for r in exp.sets["depth"]) == [2, 4, 8, 16]


def test_user_overrides_apply_to_every_run(tmp_path):
    exp = paper.load_experiment(["experiment=paper_toy", *SMALL, "hardware.kernel_floor_us=5",
                                 f"results_dir={tmp_path}"])
    assert len(exp.runs()) == 2 and exp.table_mesh == "8"
    assert {r.cfg.hardware.kernel_floor_us for r in exp.runs()} == {5.0}
    assert all(str(stage_dirs(r.cfg).solve).startswith(str(tmp_path)) for r in exp.runs())


def test_an_experiment_without_run_sets_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^experiment=null: paper.runs lacks the run "
                       r"set\(s\) eager_vs_lazy, solvers, depth, scale;"):
        paper.load_experiment(["experiment=null"])
    with pytest.raises(ConfigError, match=r"^paper.table_mesh=4: allowed a mesh of run set "
                       r"eager_vs_lazy \(8\)$"):
        paper.load_experiment([*SMALL, "paper.table_mesh=4"])
    with pytest.raises(ConfigError, match=r"^mesh=0: allowed positive integers"):
        paper.load_experiment([*SMALL, "paper.runs.depth=['mesh=0']"])


def test_run_key_is_independent_of_results_dir():
    a = stage_dirs(load_resolved(["model=toy", "results_dir=/x/results"])).solve
    b = stage_dirs(load_resolved(["model=toy", "results_dir=elsewhere"])).solve
    assert paper.run_key(a) == paper.run_key(b) and paper.run_key(a).count("/") == 4
    with pytest.raises(paper.PaperError):
        paper.run_key("results/report")


# --------------------------------------------------------------------------- table


def test_eager_vs_lazy_table_numbers(toy_experiment):
    runs = synthetic_runs(toy_experiment)
    pair = runs[(runs["mesh"] == "2x4x8") & (runs["solver"] == "approx")
                & (runs["model"] == "toy")]
    pair = pair[[json.loads(c)["model"]["n_layers"] == 2 for c in pair["config_json"]]]
    table = paper.eager_vs_lazy_table(pair).set_index("mode")
    # eager: topology 1 + cost_build 6; lazy: 1 + 0.5
    assert table.loc["eager", "optimizer_init_s"] == 7.0
    assert table.loc["lazy", "optimizer_init_s"] == 1.5
    assert table.loc["eager", "factor_build_s"] == 0.0
    assert table.loc["lazy", "factor_build_s"] == 3.0
    assert table.loc["eager", "trws_solve_s"] == table.loc["lazy", "trws_solve_s"] == 2.0
    assert table.loc["eager", "search_total_s"] == 4 + 1 + 6 + 0 + 2
    assert table.loc["lazy", "search_total_s"] == 4 + 1 + 0.5 + 3 + 2
    assert table.loc["eager", "peak_rss_mib"] == 1000 and table.loc["lazy", "peak_rss_mib"] == 400
    # the delta row: lazy - eager, and percent of eager (n/a where eager is 0)
    delta, pct = table.loc["delta"], table.loc["delta_pct"]
    assert delta["optimizer_init_s"] == -5.5
    assert pct["optimizer_init_s"] == pytest.approx(-5.5 / 7 * 100)
    assert delta["factor_build_s"] == 3.0 and math.isnan(pct["factor_build_s"])
    assert delta["trws_solve_s"] == 0.0 and pct["trws_solve_s"] == 0.0
    assert delta["search_total_s"] == -2.5
    assert pct["search_total_s"] == pytest.approx(-2.5 / 13 * 100)
    assert delta["peak_rss_mib"] == -600 and pct["peak_rss_mib"] == pytest.approx(-60.0)
    assert list(table.index) == ["eager", "lazy", "delta", "delta_pct"]
    assert table.loc["eager", "run_id"] != table.loc["lazy", "run_id"]

    md = paper.table_markdown(table.reset_index(), "Eager vs lazy", "footer")
    lines = md.splitlines()
    assert lines[2] == ("| Mode | Optimizer init (s) | Factor build (s) | TRW-S solve (s) | "
                        "Search total (s) | Peak RSS (MiB) |")
    assert "| eager | 7.00 | 0.00 | 2.00 | 13.00 | 1000 |" in lines
    assert "| lazy | 1.50 | 3.00 | 2.00 | 10.50 | 400 |" in lines
    assert ("| Δ lazy − eager | −5.50 s (−78.6 %) | +3.00 s (n/a) | ±0.00 s (±0.0 %) | "
            "−2.50 s (−19.2 %) | −600 MiB (−60.0 %) |") in lines


def test_table_needs_one_eager_and_one_lazy_run(toy_experiment):
    runs = synthetic_runs(toy_experiment)
    lazy_only = runs[runs["cost_mode"] == "lazy"].head(1)
    with pytest.raises(paper.PaperError, match="need one eager run, got 0"):
        paper.eager_vs_lazy_table(lazy_only)


def test_a_missing_run_is_one_line(toy_experiment):
    runs = synthetic_runs(toy_experiment).iloc[1:]
    runs = runs.assign(run_key=[paper.run_key(d) for d in runs["solve_dir"]])
    with pytest.raises(paper.PaperError) as err:
        paper.build_paper(runs, toy_experiment)
    assert "\n" not in str(err.value) and "not in runs.parquet" in str(err.value)
    assert not toy_experiment.out_dir.exists()  # nothing written, not even the folder


# --------------------------------------------------------------------------- build + provenance


def test_build_paper_from_a_synthetic_table(toy_experiment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exp = toy_experiment
    runs_path = tmp_path / "runs.parquet"
    synthetic_runs(exp).to_parquet(runs_path)
    written = paper.build_paper(paper.read_runs(runs_path), exp, runs_path)
    expected = paper.output_files(exp.cfg.results_dir, exp.name)
    assert all(Path(f).is_file() for f in expected)
    assert {str(p) for p in written} <= set(expected)

    from PIL import Image

    for name in ("fig_phases", "fig_peak_rss", "fig_depth", "fig_solvers"):
        png = exp.out_dir / f"{name}.png"
        with Image.open(png) as img:
            assert img.format == "PNG" and img.size[0] >= 1000 and img.size[1] >= 600
            described = json.loads(img.info["Description"])
        prov = json.loads((exp.out_dir / f"{name}.provenance.json").read_text())
        assert described["run_ids"] == prov["run_ids"]
        assert prov["git_revisions"] == [GIT] and prov["experiment"] == "paper_toy"
        assert prov["source"]["runs_parquet"] == str(runs_path)
        assert len(prov["source"]["runs_parquet_sha256"]) == 64
        assert prov["built_by"]["code_hash"] == paper.stage_code_hash("paper")
        for run in prov["runs"]:
            assert run["config_hash"] == config_hash(json.loads(
                synthetic_runs(exp).set_index("run_id").loc[run["run_id"], "config_json"]))
    figs = {n: json.loads((exp.out_dir / f"{n}.provenance.json").read_text())
            for n in ("fig_phases", "fig_depth", "fig_solvers")}
    assert len(figs["fig_phases"]["run_ids"]) == 6
    assert [r["n_layers"] for r in figs["fig_depth"]["runs"]] == [2, 4, 8]
    assert {r["solver"] for r in figs["fig_solvers"]["runs"]} == {"approx", "ilp"}

    # the table: Parquet with provenance in its metadata, Markdown with a sidecar
    t = pq.read_table(exp.out_dir / "eager_vs_lazy.parquet")
    meta = json.loads(t.schema.metadata[b"pipeline"])
    df = t.to_pandas().set_index("mode")
    assert df.loc["delta", "optimizer_init_s"] == -5.5
    assert set(meta["run_ids"]) == {df.loc["eager", "run_id"], df.loc["lazy", "run_id"]}
    assert meta["config_hashes"] and meta["git_revisions"] == [GIT]
    md = (exp.out_dir / "eager_vs_lazy.md").read_text()
    assert "mesh 2x4x8 (dp,cp,tp)" in md and df.loc["eager", "run_id"] in md
    side = json.loads((exp.out_dir / "eager_vs_lazy.provenance.json").read_text())
    assert side["run_ids"] == meta["run_ids"]
    summary = json.loads((exp.out_dir / "provenance.json").read_text())
    assert len(summary["run_ids"]) == 15 and summary["table_mesh"] == "2x4x8"
    assert set(summary["run_sets"]) == set(paper.RUN_SETS)


def test_figure_footer_names_the_configs(toy_experiment):
    runs = synthetic_runs(toy_experiment)
    runs = runs.assign(run_key=[paper.run_key(d) for d in runs["solve_dir"]])
    depth = paper.select_runs(runs, [r.key for r in toy_experiment.sets["depth"]], "depth")
    text = paper.describe_runs(depth)
    assert text.startswith("model toy (2 layers, dim 256), toy (4 layers, dim 256), "
                           "toy (8 layers, dim 256); hardware h100; mesh 2x4x8; solver approx; "
                           "costs lazy")
    assert all(rid in text for rid in depth["run_id"]) and GIT[:8] in text


# --------------------------------------------------------------------------- Snakemake


def jobs_of(out: str) -> dict[str, int]:
    jobs = {r: int(n) for r, n in re.findall(r"^(\w+)\s+(\d+)$", out, re.M)}
    jobs.pop("total", None)
    return jobs


def outputs_of(out: str) -> set[str]:
    """The output files of every job of a dry run (a job lists its outputs joined by ", ")."""
    return {path for line in re.findall(r"^\s+output: (.+)$", out, re.M)
            for path in line.split(", ")}


def test_snakemake_paper_plans_every_run_once(tmp_path):
    code, out, err = snakemake(tmp_path, "-n", "paper")
    assert code == 0, err
    # 3 traces (2, 4, 8 layers), 9 topologies (4 of them recipes), 12 cost dirs (9 lazy,
    # 3 eager), 15 runs, 1 paper: the stage rules of the --config run make the
    # experiment's runs too (wildcard paths)
    assert jobs_of(out) == {"trace": 3, "topology": 9, "costs_lazy": 9, "costs_eager": 3,
                            "solve": 15, "paper": 1}
    assert "results/paper/paper_toy/eager_vs_lazy.md" in out
    exp = paper.load_experiment([])
    solves = {str(stage_dirs(r.cfg).solve / "run.json") for r in exp.runs()}
    assert solves <= outputs_of(out) and len(solves) == 15
    assert not (tmp_path / "results").exists()


def test_snakemake_paper_makes_the_config_run_once(tmp_path):
    """Where a paper run is the --config run, it is one job, not two: the same jobs as
    without --config."""
    code, out, err = snakemake(tmp_path, "-n", "paper", "--config", "model=toy", "mesh=8")
    assert code == 0, err
    assert jobs_of(out) == {"trace": 3, "topology": 9, "costs_lazy": 9, "costs_eager": 3,
                            "solve": 15, "paper": 1}
    config_run = stage_dirs(load_resolved(["model=toy", "mesh=8"])).solve / "run.json"
    assert str(config_run) in outputs_of(out)
    code, plain, err = snakemake(tmp_path, "-n", "paper")
    assert code == 0, err
    assert outputs_of(out) == outputs_of(plain)


def test_snakemake_paper_bad_experiment_is_one_line(tmp_path):
    code, out, err = snakemake(tmp_path, "-n", "paper", "--config", "experiment=nope")
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("experiment=nope: allowed ")


# --------------------------------------------------------------------------- end to end


def test_python_m_pipeline_paper_bad_experiment_is_one_line(tmp_path):
    """The real ``python -m pipeline.tools.paper`` (the package's ``__main__``): exit 2, one
    line on stderr, nothing written."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    proc = subprocess.run([sys.executable, "-m", "pipeline.tools.paper", "--no-run",
                           "experiment=nope"], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["experiment=nope: allowed paper, paper_toy"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.toy_runs(("mesh=8", "lazy_costs=true"), ("mesh=8", "lazy_costs=false"))
def test_paper_end_to_end_from_two_real_runs(tmp_path, monkeypatch, capsys,
                                             toy_results: ToyResults):
    """A tiny experiment (toy, mesh 8, eager + lazy) through the CLI: --no-run refuses
    the missing runs in one line; without it the runs are made, then every artifact is
    built from runs.parquet with the runs' real ids and revision. The runs' trace,
    topology and costs are copied from the shared toy results: the paper makes the
    solves."""
    monkeypatch.chdir(tmp_path)
    small = [*SMALL, "paper.table_mesh=8"]
    for lazy in ("true", "false"):
        toy_results.copy_run(tmp_path / "results", "mesh=8", f"lazy_costs={lazy}",
                             upto="costs")
    for run in paper.load_experiment(small).runs():  # the copies are the paper's runs
        dirs = stage_dirs(run.cfg)
        assert (dirs.costs / "costs.json").is_file() and not dirs.solve.exists(), dirs.solve
    assert paper.main(["--no-run", *small]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not in runs.parquet" in err

    assert paper.main(small) == 0
    runs = pd.read_parquet(tmp_path / "results" / "report" / "runs.parquet")
    assert len(runs) == 2 and set(runs["cost_mode"]) == {"eager", "lazy"}
    assert len(set(runs["placement_hash"])) == 1  # eager and lazy: the same plan
    out = tmp_path / "results" / "paper" / "paper_toy"
    assert all(Path(f).is_file() for f in paper.output_files("results", "paper_toy"))
    table = pd.read_parquet(out / "eager_vs_lazy.parquet").set_index("mode")
    eager = runs.set_index("cost_mode").loc["eager"]
    assert table.loc["eager", "search_total_s"] == pytest.approx(eager["phases.search_total"])
    assert table.loc["eager", "run_id"] == eager["run_id"]
    prov = json.loads((out / "fig_phases.provenance.json").read_text())
    assert sorted(prov["run_ids"]) == sorted(runs["run_id"])
    assert prov["git_revisions"] == sorted(set(runs["git.revision"]))
