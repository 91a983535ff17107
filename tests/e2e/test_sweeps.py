"""Sweeps: a Hydra multirun writes the Snakemake result layout and reuses what is on
disk (basic and joblib launchers), concurrent processes of one config produce one
artifact, a code change reruns its stage under Snakemake, and the SLURM profile and the
submitit launcher config parse.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fixtures import snakemake

from pipeline.config import (
    CONF_DIR,
    STAGES,
    load_resolved,
    register_configs,
    stage_dirs,
    sweep_overrides,
)
from pipeline.stages.runner import SENTINELS

ROOT = Path(__file__).resolve().parents[2]
SNAKEFILE = ROOT / "workflow" / "Snakefile"
SWEEP = ["lazy_costs=true,false", "mesh=8,2x4"]
RUN_STAGES = ("trace", "topology", "costs", "solve")


def python_env(root: Path = ROOT) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env.pop("PIPELINE_LOG_LEVEL", None)
    return env


def run(cwd: Path, *args: str, root: Path = ROOT,
        timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env=python_env(root), timeout=timeout)


def copy_checkout(dest: Path) -> Path:
    """The code and configs of this checkout, copied: runs of the copy do not see edits
    made to the checkout meanwhile (stage code hashes stay put)."""
    for part in ("pipeline", "conf", "workflow"):
        shutil.copytree(ROOT / part, dest / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> Path:
    return copy_checkout(tmp_path_factory.mktemp("checkout"))


def artifacts(root: Path) -> dict[str, int]:
    """Every file under ``root`` (relative path -> mtime in ns)."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns
            for p in sorted(root.rglob("*")) if p.is_file()}


def job_dirs(workdir: Path, job: list[str]):
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        return stage_dirs(load_resolved(["model=toy", *job]))
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, frozen):
    """``python -m pipeline -m model=toy lazy_costs=true,false mesh=8,2x4`` in a fresh
    directory: (workdir, completed process)."""
    workdir = tmp_path_factory.mktemp("sweep")
    proc = run(workdir, "-m", "pipeline", "-m", "model=toy", *SWEEP, root=frozen)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, proc


# --------------------------------------------------------------------------- multirun


@pytest.mark.slow
def test_multirun_writes_the_snakemake_layout(sweep):
    workdir, proc = sweep
    jobs = sweep_overrides(SWEEP)
    assert len(jobs) == 4
    runs = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("run.json"))
    expected = sorted(str(job_dirs(workdir, job).solve / "run.json") for job in jobs)
    assert runs == expected
    assert proc.stdout.count("run record: ") == 4
    for job in jobs:
        dirs = job_dirs(workdir, job)
        for stage in STAGES:
            assert (workdir / dirs.of(stage) / SENTINELS[stage]).is_file(), (job, stage)
    # one trace, a topology per mesh, a cost dir per mesh and mode, a solve dir per run
    res = workdir / "results" / "runs"
    assert len(list(res.glob("*/graph.parquet"))) == 1
    assert len(list(res.glob("*/*/topology.json"))) == 2
    assert len(list(res.glob("*/*/*/*/costs.json"))) == 4
    assert len(list(res.glob("*/*/*/eager/factors.npz"))) == 2
    # Hydra itself writes only multirun.yaml, under results/hydra/multirun/
    hydra_files = [p for p in (workdir / "results" / "hydra").rglob("*") if p.is_file()]
    assert [p.name for p in hydra_files] == ["multirun.yaml"]
    assert {p.name for p in workdir.iterdir()} - {".snakemake"} == {"results"}
    import pandas as pd

    report = pd.read_parquet(workdir / "results" / "report" / "runs.parquet")
    assert len(report) == 4
    assert sorted(report["cost_mode"]) == ["eager", "eager", "lazy", "lazy"]
    # eager and lazy costs give the same plan on each mesh
    assert report.groupby("mesh")["placement_hash"].nunique().tolist() == [1, 1]


@pytest.mark.slow
def test_multirun_reuses_traces_topologies_and_costs(sweep):
    _, proc = sweep
    log = proc.stderr
    assert len(re.findall(r"trace: running", log)) == 1
    assert len(re.findall(r"trace: reusing", log)) == 3
    assert len(re.findall(r"topology: running", log)) == 2
    assert len(re.findall(r"topology: reusing", log)) == 2
    assert len(re.findall(r"costs: running", log)) == 4


@pytest.mark.slow
def test_joblib_sweep_over_existing_results_reuses_everything(sweep, frozen, tmp_path):
    """The same sweep again, in parallel with the joblib launcher, on a copy of the
    results: every job finds every stage current and rewrites nothing but the report."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    workdir = tmp_path / "again"
    shutil.copytree(sweep[0], workdir)
    before = artifacts(workdir / "results" / "runs")
    proc = run(workdir, "-m", "pipeline", "-m", "hydra/launcher=joblib",
               "hydra.launcher.n_jobs=2", "model=toy", *SWEEP, root=frozen)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("run record: ") == 4
    assert artifacts(workdir / "results" / "runs") == before
    assert "Joblib.Parallel(n_jobs=2" in proc.stderr
    assert len(re.findall(r"solve: reusing", proc.stderr)) == 4
    assert "running in" not in proc.stderr.replace("report: running in", "")


@pytest.mark.slow
def test_snakemake_finds_a_sweep_run_up_to_date(sweep):
    """A sweep's run is the Snakemake run of the same config: nothing to do."""
    code, out, err = snakemake(sweep[0], "-n", "--config", "model=toy", "mesh=2x4",
                               "lazy_costs=false")
    assert code == 0, err
    assert "Nothing to be done" in out + err


# --------------------------------------------------------------------------- concurrency


@pytest.mark.slow
def test_two_processes_of_one_config_produce_one_artifact(tmp_path, frozen):
    args = ("-m", "pipeline", "model=toy", "mesh=8", "lazy_costs=true")
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda _: run(tmp_path, *args, root=frozen), range(2)))
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    dirs = job_dirs(tmp_path, ["mesh=8", "lazy_costs=true"])
    records = {p.stdout.split("run record: ")[1].split()[0] for p in procs}
    assert records == {str(dirs.solve / "run.json")}
    logs = procs[0].stderr + procs[1].stderr
    for stage in RUN_STAGES:  # each stage ran in exactly one process, the other reused it
        assert len(re.findall(rf"{stage}: running", logs)) == 1, stage
        assert len(re.findall(rf"{stage}: reusing", logs)) == 1, stage
    files = [f for f in artifacts(tmp_path) if not f.endswith((".lock", ".code"))]
    assert not [f for f in files if f.endswith(".tmp") or "/." in f]
    assert len([f for f in files if f.endswith("run.json")]) == 1
    assert len([f for f in files if f.endswith("graph.parquet")]) == 1
    import json

    record = json.loads((tmp_path / dirs.solve / "run.json").read_text())
    assert record["placement_hash"] and record["model"] == "toy"


# --------------------------------------------------------------------------- code changes


@pytest.mark.slow
def test_a_stage_code_change_reruns_that_stage(tmp_path):
    """In a copy of the checkout: outputs recorded by Snakemake (--touch), then an edit of
    a solver module makes `snakemake -n` plan solve (and the report), nothing earlier."""
    repo = copy_checkout(tmp_path / "repo")
    work = tmp_path / "work"
    work.mkdir()
    env = python_env(repo)
    cfg = ["--config", "model=toy", "mesh=8"]
    code = ("import os, sys; os.chdir(sys.argv[1]); "
            "from pipeline.config import load_resolved, stage_dirs, STAGES; "
            "from pipeline.stages.runner import SENTINELS; "
            "d = stage_dirs(load_resolved(['model=toy', 'mesh=8'])); "
            "ps = [d.of(s) / SENTINELS[s] for s in STAGES] + [d.report / 'placements.parquet', "
            "d.report / 'redistributions.parquet']; "
            "[(p.parent.mkdir(parents=True, exist_ok=True), p.write_text('x'), "
            "os.utime(p, (1e6 + i, 1e6 + i))) for i, p in enumerate(ps)]")
    # cwd: not the checkout, whose pipeline/ would shadow the copy's (sys.path[0])
    subprocess.run([sys.executable, "-c", code, str(work)], env=env, check=True, timeout=120,
                   cwd=work)

    def smk(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "snakemake", "--snakefile", str(repo / "workflow/Snakefile"),
             "--directory", str(work), *args], env=env, capture_output=True, text=True,
            timeout=300, cwd=work)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    smk("--touch", "--forceall", *cfg)
    assert "Nothing to be done" in smk("-n", *cfg)
    with open(repo / "pipeline" / "solvers" / "trws.py", "a") as fh:
        fh.write("\n# a code change\n")
    out = smk("-n", *cfg)
    jobs = {r: int(n) for r, n in re.findall(r"^(\w+)\s+(\d+)$", out, re.M)}
    jobs.pop("total", None)
    jobs.pop("all", None)
    assert jobs == {"solve": 1, "report": 1}
    assert re.search(r"params have changed since last execution:\s+solve", out)


# --------------------------------------------------------------------------- scaling out


def test_slurm_profile_parses():
    """`snakemake --profile workflow/profiles/slurm -n` (needs the executor plugin,
    extra [slurm]); the profile's resources reach the jobs."""
    pytest.importorskip("snakemake_executor_plugin_slurm")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        code, out, err = snakemake(Path(tmp), "--profile", str(ROOT / "workflow/profiles/slurm"),
                                   "-n", "--config", "model=toy", "mesh=8")
    assert code == 0, err
    text = out + err
    assert "workflow/profiles/slurm" in text
    assert re.search(r"rule solve:(.|\n)*?resources: .*mem_mb=24000.*runtime=480", text)
    assert re.search(r"rule trace:(.|\n)*?resources: .*mem_mb=16000", text)


def test_profile_executor_must_exist(tmp_path):
    """The parse test above means something: an unknown executor fails the dry run."""
    text = (ROOT / "workflow/profiles/slurm/config.yaml").read_text()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.yaml").write_text(text.replace("executor: slurm",
                                                               "executor: nosuchexecutor"))
    code, out, err = snakemake(tmp_path, "--profile", str(tmp_path / "bad"), "-n",
                               "--config", "model=toy", "mesh=8")
    assert code != 0 and "nosuchexecutor" in err


@pytest.mark.parametrize("launcher, target, keys", [
    ("slurm", "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
     {"timeout_min": 120, "cpus_per_task": 1, "mem_gb": 16, "array_parallelism": 64}),
    ("submitit_slurm",
     "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher", {}),
    ("joblib", "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
     {"n_jobs": 2}),
])
def test_hydra_launcher_configs_compose(launcher, target, keys):
    import importlib

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    module, _, cls = target.rpartition(".")
    pytest.importorskip(module)
    register_configs()
    GlobalHydra.instance().clear()
    extra = ["hydra.launcher.n_jobs=2"] if launcher == "joblib" else [
        "hydra.launcher.partition=cpu"]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", return_hydra_config=True,
                          overrides=[f"hydra/launcher={launcher}", *extra, "model=toy",
                                     "mesh=8"])
    finally:
        GlobalHydra.instance().clear()
    lc = cfg.hydra.launcher
    assert lc._target_ == target
    assert getattr(importlib.import_module(module), cls)
    for k, v in keys.items():
        assert lc[k] == v, k
    if launcher != "joblib":
        assert lc.partition == "cpu"
    # the job config is the one every other entry point composes
    assert cfg.model.name == "toy" and str(cfg.mesh) == "8"


def test_pipeline_validates_a_slurm_sweep_before_submitting(tmp_path):
    """`python -m pipeline -m hydra/launcher=slurm ...` with a bad value fails in one line,
    before any job is submitted (no sbatch is needed for that)."""
    proc = run(tmp_path, "-m", "pipeline", "-m", "hydra/launcher=slurm", "model=toy",
               "mesh=8,2x0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "mesh=2x0: allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)"]
    assert not (tmp_path / "results").exists()


# --------------------------------------------------------------------------- failed points


def test_the_summary_counts_planned_ok_and_failed_points(tmp_path):
    from pipeline.core.sweep import NO_OUTCOME, PointOutcome, read_outcomes, record_outcome
    from pipeline.core.sweep import summary_lines as summary

    record_outcome(tmp_path, 0, PointOutcome("mesh=8"))
    record_outcome(tmp_path, 1, PointOutcome("mesh=2", "constraints.device_memory=1: no"))
    outcomes = read_outcomes(tmp_path)
    assert summary(["mesh=8", "mesh=2", "mesh=2x4"], outcomes) == [
        "sweep: planned 3, ok 1, failed 2",
        "failed: mesh=2: constraints.device_memory=1: no",
        f"failed: mesh=2x4: {NO_OUTCOME}"]
    assert summary(["mesh=8"], outcomes, what="shapes") == ["shapes: planned 1, ok 1, failed 0"]
    assert read_outcomes(tmp_path / "absent") == {}


@pytest.mark.slow
@pytest.mark.toy_runs(("mesh=8",))
def test_a_point_that_fails_is_recorded_and_the_sweep_goes_on(tmp_path, toy_results):
    """300 MiB per device: mesh 2 has no plan (one line), the sweep still plans 8 and 2x4,
    the report holds those two runs, the summary names the failed point, exit 1."""
    import pandas as pd

    results = tmp_path / "results"
    toy_results.copy_run(results, "mesh=8", upto="trace")  # the trace only
    proc = run(tmp_path, "-m", "pipeline", "-m", "model=toy", "mesh=8,2,2x4",
               "constraints.device_memory=300MiB", f"results_dir={results}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-2] == "sweep: planned 3, ok 2, failed 1"
    assert lines[-1].startswith(
        f"failed: model=toy mesh=2 constraints.device_memory=300MiB results_dir={results}: "
        "constraints.device_memory=300MiB: infeasible, the smallest memory any plan "
        "reaches is ")
    assert proc.stdout.count("run record: ") == 2
    report = pd.read_parquet(results / "report" / "runs.parquet")
    assert sorted(report["mesh"]) == ["2x4", "8"]
    (kept,) = list((results / "hydra" / "sweeps").iterdir())  # the record of the failure
    assert sorted(p.name for p in kept.iterdir()) == ["0.json", "1.json", "2.json"]
