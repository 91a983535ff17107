"""Live SLURM: a Snakemake sweep with ``--profile workflow/profiles/slurm`` and a Hydra
multirun with ``hydra/launcher=slurm`` (submitit) on a real cluster, every job through
``sbatch`` (``sacct`` lists it), the same placement hashes as local runs.

The cluster is the one-node cluster of ``tests/support/slurm/start-cluster.sh`` (``.ci/run``
starts it before the tests and stops it after them). Without a cluster the tests fail,
with the reason; ``PLANNER_SKIP_SLURM=1`` skips them (a developer's machine). Both sweeps
are toy, mesh 8, solvers approx and ilp (one lazy and one eager cost directory, so every
stage rule runs), into fresh results directories; they run at the same time, so the
cluster's two CPUs are never idle while one of them waits for its status checks. (Mesh
2x4 as well doubled the test's time, about 200 s on CI, and added no rule and no
launcher path.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
from toy_sweep import NAME, SOLVERS, checkout_with_sweep

from pipeline.config import load_resolved, stage_dirs

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SKIP_ENV = "PLANNER_SKIP_SLURM"
#: The log .ci/run keeps of tests/support/slurm/start-cluster.sh (its last line is the reason).
START_LOG_ENV = "PLANNER_SLURM_START_LOG"
TIMEOUT_S = 900

#: The sweep: toy at mesh 8 with each solver of the shared toy sweep (tests/support/toy_sweep.py).
MESHES = ("8",)
#: The runs, in Hydra's job order (the last swept key varies fastest).
CONFIGS = [(f"mesh={m}", f"solver={s}") for m in MESHES for s in SOLVERS]
#: Jobs of the Snakemake sweep per rule, by hand: one trace; one topology; lazy costs
#: (approx) and eager costs (ilp); a solve per run.
SNAKEMAKE_JOBS = {"trace": 1, "topology": 1, "costs_lazy": 1, "costs_eager": 1, "solve": 2}

#: Small requests: the toy stages need well under 1 GB and a minute.
RESOURCES = ["--default-resources", "mem_mb=1000", "runtime=10",
             "--set-resources", "trace:mem_mb=1000", "solve:mem_mb=1000", "solve:runtime=10",
             "paper:mem_mb=1000", "--slurm-init-seconds-before-status-checks", "2"]


def _cluster_problem() -> str | None:
    """Why the cluster cannot run the tests, or None."""
    for tool in ("sbatch", "sinfo", "sacct"):
        if shutil.which(tool) is None:
            return f"{tool} not on PATH"
    info = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                          timeout=30)
    states = info.stdout.split()
    if info.returncode != 0 or not {"idle", "mix", "alloc"} & set(states):
        return (f"no idle SLURM node (sinfo exit {info.returncode}, states {states}, "
                f"{info.stderr.strip()[-300:]!r})")
    acct = subprocess.run(["sacct", "-n", "-X", "-S", "now-3600"], capture_output=True,
                          text=True, timeout=30)
    if acct.returncode != 0:
        return f"sacct cannot list jobs: {acct.stderr.strip()[-300:]!r}"
    return None


@pytest.fixture(scope="module")
def cluster() -> None:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: live SLURM tests skipped")
    problem = _cluster_problem()
    if problem:
        log = os.environ.get(START_LOG_ENV)
        if log and Path(log).is_file():
            lines = Path(log).read_text().strip().splitlines()
            problem += f"; start-cluster.sh said: {lines[-1] if lines else '(nothing)'}"
        pytest.fail(f"live SLURM test: {problem}. Start a cluster with "
                    f"tests/support/slurm/start-cluster.sh (root), or set {SKIP_ENV}=1 to skip",
                    pytrace=False)


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env.pop("PIPELINE_PROGRESS", None)
    return env


def _run_json(results: Path, config: tuple[str, ...]) -> Path:
    cfg = load_resolved(["model=toy", *config, f"results_dir={results}"])
    return Path(stage_dirs(cfg).solve) / "run.json"


def _sacct(*args: str) -> list[dict[str, str]]:
    fields = ["JobID", "JobName", "Comment", "State"]
    proc = subprocess.run(["sacct", "-X", "--parsable2", "--noheader",
                           f"--format={','.join(fields)}", *args],
                          capture_output=True, text=True, timeout=60, check=True)
    return [dict(zip(fields, line.split("|"))) for line in proc.stdout.splitlines() if line]


@pytest.fixture(scope="module")
def sweeps(cluster, tmp_path_factory) -> dict:
    """Both sweeps, started together: {'snakemake': ..., 'hydra': ...}, each with its
    results directory and completed process."""
    base = tmp_path_factory.mktemp("slurm")
    checkout = checkout_with_sweep(base / "checkout")
    smk_dir, hydra_dir = base / "snakemake", base / "hydra"
    smk_dir.mkdir()
    hydra_dir.mkdir()
    smk_results, hydra_results = smk_dir / "results", hydra_dir / "results"
    targets = [str(_run_json(smk_results, c)) for c in CONFIGS]
    hydra_name = f"planner-test-{uuid.uuid4().hex[:8]}"
    commands = {
        "snakemake": ([sys.executable, "-m", "snakemake",
                       "--snakefile", str(checkout / "workflow" / "Snakefile"),
                       "--profile", str(checkout / "workflow" / "profiles" / "slurm"),
                       *RESOURCES, *targets, "--config", f"experiment={NAME}",
                       f"results_dir={smk_results}"], smk_dir),
        "hydra": ([sys.executable, "-m", "pipeline", "-m", "hydra/launcher=slurm",
                   f"hydra.launcher.name={hydra_name}", "hydra.launcher.mem_gb=1",
                   "hydra.launcher.timeout_min=10", "model=toy", f"mesh={','.join(MESHES)}",
                   f"solver={','.join(SOLVERS)}", f"results_dir={hydra_results}"], hydra_dir),
    }
    procs = {k: subprocess.Popen(argv, cwd=cwd, env=_env(checkout), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
             for k, (argv, cwd) in commands.items()}
    out = {}
    try:
        for key, proc in procs.items():
            text, _ = proc.communicate(timeout=TIMEOUT_S)
            out[key] = {"proc": proc, "log": text}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    out["snakemake"]["results"] = smk_results
    out["hydra"]["results"] = hydra_results
    out["hydra"]["name"] = hydra_name
    return out


def _check_ok(run: dict) -> str:
    assert run["proc"].returncode == 0, run["log"][-4000:]
    return run["log"]


@pytest.mark.toy_runs(*CONFIGS)
def test_snakemake_slurm_profile_sweep(sweeps, toy_results):
    run = sweeps["snakemake"]
    log = _check_ok(run)
    job_ids = re.findall(r"has been submitted with SLURM jobid (\d+)", log)
    total = sum(SNAKEMAKE_JOBS.values())
    assert len(job_ids) == total, log[-4000:]
    assert f"{total} of {total} steps (100%) done" in log
    rows = _sacct("-j", ",".join(job_ids))
    assert sorted(r["JobID"] for r in rows) == sorted(job_ids)
    assert {r["State"] for r in rows} == {"COMPLETED"}
    assert len({r["JobName"] for r in rows}) == 1  # the plugin names jobs by its run id
    rules = Counter(re.match(r"rule_(\w+?)(_wildcards_|$)", r["Comment"]).group(1)
                    for r in rows)
    assert rules == SNAKEMAKE_JOBS
    for config in CONFIGS:
        record = _read(_run_json(run["results"], config))
        assert record["placement_hash"] == toy_results.run(*config).record["placement_hash"]


@pytest.mark.toy_runs(*CONFIGS)
def test_hydra_submitit_sweep(sweeps, toy_results):
    run = sweeps["hydra"]
    _check_ok(run)
    rows = _sacct("--name", run["name"], "-S", "now-3600")
    # one job array, a task per sweep job
    assert sorted(r["JobID"].split("_")[1] for r in rows) == ["0", "1"]  # approx, ilp
    assert len({r["JobID"].split("_")[0] for r in rows}) == 1
    assert {r["State"] for r in rows} == {"COMPLETED"}
    logs = {r["JobID"]: _task_log(run["results"], r["JobID"]) for r in rows}
    for task, config in enumerate(CONFIGS):  # Hydra's job order: the last key varies fastest
        path = _run_json(run["results"], config)
        job = next(j for j in logs if j.endswith(f"_{task}"))
        assert f"run record: {path}" in logs[job], (job, config)  # made in that job
        record = _read(path)
        assert record["placement_hash"] == toy_results.run(*config).record["placement_hash"]


def _task_log(results: Path, job_id: str) -> str:
    """stdout of array task ``job_id`` (submitit's <sweep dir>/.submitit/<id>/)."""
    paths = list((results / "hydra" / "multirun").glob(f"*/.submitit/{job_id}/*_log.out"))
    assert len(paths) == 1, (job_id, paths)
    return paths[0].read_text()


def _read(path: Path) -> dict:
    import json

    assert path.is_file(), path
    return json.loads(path.read_text())
