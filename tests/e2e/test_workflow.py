"""Snakemake workflow: the DAG of dry runs, what a config change reruns, one-line errors
for bad ``--config`` values, and ``snakemake --lint``.

Snakemake runs in this process (``snakemake.cli.main``) to keep the suite fast; one
test starts the real ``snakemake`` command-line interface.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bad_configs import BAD_CASES
from fixtures import SNAKEFILE, snakemake

from pipeline.config import STAGES, load_resolved, overrides_from_snakemake, stage_dirs
from pipeline.core.artifacts import stage_outputs
from pipeline.stages.runner import SENTINELS

ROOT = Path(__file__).resolve().parents[2]
#: The rules of a run. The costs stage has one rule per cost mode (with eager costs it
#: also writes factors.npz, and a rule's outputs cannot depend on a wildcard).
LAZY_RULES = {"trace", "topology", "costs_lazy", "solve", "report"}
RULES = {"trace", "topology", "costs_eager", "solve", "report"}  # BASE: ilp, eager costs


def planned_jobs(workdir: Path, *config: str) -> dict[str, int]:
    """Rule -> job count of a dry run (``rule all`` left out)."""
    code, out, err = snakemake(workdir, "-n", "--config", *config)
    assert code == 0, err
    jobs = {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", out, re.M)}
    jobs.pop("total", None)
    jobs.pop("all", None)
    return jobs


def touch_outputs(workdir: Path, config: dict) -> None:
    """Create the artifacts every stage of ``config`` declares, oldest first."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        cfg = load_resolved(overrides_from_snakemake(config))
        dirs = stage_dirs(cfg)
    finally:
        os.chdir(cwd)
    paths = [a.path(dirs.of(s)) for s in STAGES for a in stage_outputs(s, cfg.lazy_costs)]
    for i, rel in enumerate(paths):
        path = workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("fake")
        os.utime(path, (1_000_000 + i, 1_000_000 + i))


def test_dry_run_plans_the_five_stages(tmp_path):
    assert planned_jobs(tmp_path, "mesh=2,4,8") == dict.fromkeys(LAZY_RULES, 1)
    assert not (tmp_path / "results").exists()


def test_dry_run_paths_are_the_config_layer_paths(tmp_path):
    code, out, _ = snakemake(tmp_path, "-n", "--config", "model=toy", "mesh=2x4")
    dirs = stage_dirs(load_resolved(["model=toy", "mesh=2x4"]))
    assert code == 0
    for stage in STAGES:
        assert str(dirs.of(stage) / SENTINELS[stage]) in out
        assert str(dirs.of(stage) / f"benchmark-{stage}.tsv") in out


BASE = {"model": "toy", "mesh": "2,4,8", "solver": "ilp"}


@pytest.mark.parametrize("change, rerun", [
    ([], set()),
    (["solver=lp"], {"solve", "report"}),
    (["overrides=solver.time_limit_s=60 solver.threads=2"], {"solve", "report"}),
    (["optimality_check=true"], {"solve", "report"}),
    (["overrides=hardware.kernel_floor_us=5"], {"costs_eager", "solve", "report"}),
    (["mesh=2x4"], {"topology", "costs_eager", "solve", "report"}),
    (["mesh_names=[a,b,c]"], {"topology", "costs_eager", "solve", "report"}),
    (["repeated_layers=false"], {"topology", "costs_eager", "solve", "report"}),
    (["overrides=model.n_layers=3"], RULES),
    (["model=llama1b"], RULES),
    (["revision_label=v2"], set()),
])
def test_a_config_change_reruns_only_the_stages_keyed_by_it(tmp_path, change, rerun):
    touch_outputs(tmp_path, BASE)
    config = [f"{k}={v}" for k, v in BASE.items() if not any(c.startswith(k + "=")
                                                              for c in change)]
    jobs = planned_jobs(tmp_path, *config, *change)
    assert set(jobs) == rerun
    assert all(n == 1 for n in jobs.values())


def test_lazy_and_eager_costs_share_the_hardware_level(tmp_path):
    touch_outputs(tmp_path, {"model": "toy", "solver": "approx"})
    assert set(planned_jobs(tmp_path, "model=toy", "solver=approx", "lazy_costs=false")) == {
        "costs_eager", "solve", "report"}


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_config_is_one_line_and_writes_nothing(tmp_path, case):
    code, out, err = snakemake(tmp_path, "-n", "--config", *case[2])
    assert code == 2
    assert err.strip().splitlines()[-1] == case[3]
    assert "Traceback" not in err + out
    assert not (tmp_path / "results").exists()


def test_unknown_config_key(tmp_path):
    code, _, err = snakemake(tmp_path, "-n", "--config", "meshes=8")
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(
        "meshes=8: unknown --config key; allowed model, mesh, mesh_names, solver,")


def test_the_real_snakemake_command(tmp_path):
    """The installed CLI, without --cores (the default profile sets it), a bad mesh."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory",
         str(tmp_path), "--config", "mesh=2,0,8"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == ("mesh=2,0,8: allowed positive integers joined by ',' or 'x' "
                         "(e.g. 2,4,8 or 2x4x8 or 8)")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "results").exists()


def test_lint_reports_only_the_missing_conda_environments(tmp_path):
    """We deploy with pip (pyproject.toml), not per-rule conda environments; every other
    lint must be clean."""
    code, out, err = snakemake(tmp_path, "--lint")
    text = out + err
    lints = re.findall(r"^\s+\* (.+?):?$", text, re.M)
    assert code in (0, 1)
    assert set(lints) <= {"Specify a conda environment or container for each rule."}, lints
    if code == 1:
        assert lints


def test_a_pipelined_config_is_refused_by_the_workflow_in_one_line(tmp_path: Path) -> None:
    """A pp dim (the stage solve on the sub-mesh, then the pipelined solve) runs through
    python -m pipeline; the workflow refuses it before any job, in one line naming the
    mesh (before, the paper experiment's composition failed on pipeline.microbatches)."""
    code, out, err = snakemake(tmp_path, "-n", "--config", "model=toy", "mesh=2,2",
                               "mesh_names=[pp,dp]", "overrides=pipeline.microbatches=8",
                               f"results_dir={tmp_path / 'results'}")
    assert code == 2, out + err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("Using ")]
    assert lines == ["mesh=2,2 mesh_names=[pp,dp]: the Snakemake workflow does not run "
                     "pipelined configs (a pp dim) yet; allowed a mesh without a pp dim "
                     "here, or python -m pipeline with the same overrides"]
    assert not (tmp_path / "results").exists()
    # the same overrides without the pp dim are planned by the workflow (dry run)
    code, out, err = snakemake(tmp_path, "-n", "--config", "model=toy", "mesh=2,2",
                               f"results_dir={tmp_path / 'results'}")
    assert code == 0, out + err
