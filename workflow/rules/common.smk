# Helpers shared by the rules: compose and validate the Hydra config from --config,
# and derive each stage's paths and params from it (all logic lives here and in
# pipeline.config; the rules stay thin).
#
# The stage rules of a run (trace, topology, costs, solve) have wildcard paths below
# <results_dir>/runs/, so one set of rules makes the --config run and every run of the
# paper experiment (rule paper); a job's params are the overrides of the config whose
# stage directory its output is in (run_config), so a run shared by several run sets, or
# a trace shared by several runs, is one job.
#
# --config keys: model, mesh, mesh_names, solver, lazy_costs, hardware, experiment,
# repeated_layers, optimality_check, results_dir, revision_label, and overrides
# (further space-separated Hydra overrides, e.g. overrides="solver.time_limit_s=60").
# A bad value prints one line on stderr and exits with status 2 before any job runs.

import functools
import os
import shlex
import sys
from pathlib import Path

PROJECT_ROOT = Path(workflow.basedir).parent

# The software environment of every rule (relative to workflow/rules/, where the rules
# are), used with --use-conda; see workflow/envs/pipeline.yaml.
CONDA_ENV = "../envs/pipeline.yaml"
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

from pipeline.core.artifacts import SENTINELS, stage_outputs as _stage_artifacts
from pipeline.stages.runner import preflight_trace
from pipeline.config import (
    ConfigError,
    load_resolved,
    overrides_from_snakemake,
    stage_code_hash,
    stage_dirs,
    stage_overrides,
)
from pipeline.config.snakemake import (
    check_cluster_config,
    check_not_pipelined,
    check_workflow_paths,
)
from pipeline.tools.paper import experiment_name, experiment_overrides, load_experiment, output_files

# Every path and value reaches a job's shell quoted ({x:q} in the rules' shell commands),
# so results_dir may hold spaces, quotes, ; $ ` or non-ASCII (docs/reliability.md); the
# config layer refuses what no path can hold (NUL, a line break), check_workflow_paths
# the braces of Snakemake's wildcards.
try:
    PLAN_CFG = load_resolved(overrides_from_snakemake(config, sys.argv))
    check_workflow_paths(PLAN_CFG)
    check_not_pipelined(PLAN_CFG)  # a pp dim: python -m pipeline (docs/pipelining.md)
    preflight_trace(PLAN_CFG)  # model checks needing imports / a forward on meta
except ConfigError as err:
    print(err, file=sys.stderr)
    sys.exit(2)
PLAN_DIRS = stage_dirs(PLAN_CFG)


# A cluster executor hands the --config entries to each job through a shell, quoted by
# Snakemake (and by the slurm executor's sbatch --wrap="..."): an entry that would not
# arrive as typed is refused before any job is submitted (known only once the executor
# is, hence onstart; a dry run submits nothing).
onstart:
    if not workflow.local_exec:
        _executor = str(workflow.executor_plugin.name)
        _wrapped = _executor == "slurm" and not getattr(
            workflow.executor_settings, "pass_command_as_script", False)
        try:
            check_cluster_config(sys.argv, _executor, _wrapped)
        except ConfigError as err:
            print(err, file=sys.stderr)
            sys.exit(2)

# The paper experiment's overrides: the --config ones, and experiment=paper_toy if none.
PAPER_OVERRIDES = experiment_overrides(overrides_from_snakemake(config, sys.argv))

# Jobs run `python -m pipeline.cli` with this interpreter and this checkout first on the
# import path, so they run the same code whether or not the package is installed.
# A job's stderr goes to its log; fd 3 keeps Snakemake's stderr, where the stage prints
# its one-line error too (PIPELINE_ERROR_FD, pipeline/stages/runner.py).
# (The prefix is formatted like a shell command: literal braces are doubled.)
# Under --use-conda the job's own environment (CONDA_ENV) is active instead: a
# CONDA_PREFIX other than Snakemake's own leaves PATH alone.
shell.prefix(
    "set -euo pipefail; exec 3>&2; export PIPELINE_ERROR_FD=3; "
    + f"if [ \"${{{{CONDA_PREFIX:-}}}}\" = {shlex.quote(os.environ.get('CONDA_PREFIX', ''))} ]; "
    + f"then export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"; fi; "
    + f"export PYTHONPATH={shlex.quote(str(PROJECT_ROOT))}"
    + "${{PYTHONPATH:+:$PYTHONPATH}}; "
)


def stage_output(stage):
    """The sentinel artifact of a stage for the composed config (pipeline/core/artifacts.py)."""
    return str(PLAN_DIRS.of(stage) / SENTINELS[stage])


def stage_outputs(stage):
    """Every artifact a stage writes for the composed config, sentinel last (with eager
    costs the costs stage also writes factors.npz)."""
    return [str(a.path(PLAN_DIRS.of(stage)))
            for a in _stage_artifacts(stage, bool(PLAN_CFG.lazy_costs))]


def report_outputs():
    """The tables of the report stage."""
    return stage_outputs("report")


def verify_output():
    """verify.json of the verify rule, beside the run's plan.json."""
    return str(PLAN_DIRS.solve / "verify.json")


def stage_params(stage):
    """Hydra overrides of exactly the config the stage depends on (a list of str)."""
    return stage_overrides(PLAN_CFG, stage)


def stage_code(stage):
    """Hash of the stage's source files: a code change reruns the stage."""
    return stage_code_hash(stage)


def stage_log(stage):
    return str(PLAN_DIRS.of(stage) / f"{stage}.log")


def stage_benchmark(stage):
    return str(PLAN_DIRS.of(stage) / f"benchmark-{stage}.tsv")


# --------------------------------------------------------------------------- run stages

#: Directory of each stage of a run below <results_dir>/runs/, as wildcards.
RUN_DIR_PATTERNS = {
    "trace": "{trace}",
    "topology": "{trace}/{topology}",
    "costs": "{trace}/{topology}/{hardware}/{cost_mode}",
    "solve": "{trace}/{topology}/{hardware}/{cost_mode}/{solver}",
}


wildcard_constraints:
    trace=r"[^/]+",
    topology=r"[^/]+",
    hardware=r"[^/]+",
    cost_mode=r"lazy|eager",
    solver=r"[^/]+",


@functools.cache
def experiment_runs():
    """{stage: {stage directory: resolved config}} over every run of the paper
    experiment, composed on first use; a bad experiment stops the workflow with one line."""
    try:
        exp = load_experiment(PAPER_OVERRIDES)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    registry = {s: {} for s in RUN_DIR_PATTERNS}
    for run in exp.runs():
        dirs = stage_dirs(run.cfg)
        for stage, table in registry.items():
            table.setdefault(str(dirs.of(stage)), run.cfg)
    return registry


def run_config(stage, directory):
    """The resolved config whose ``stage`` directory is ``directory``: the --config run's,
    else a paper run's (the experiment is composed only when a job needs it)."""
    if directory == str(PLAN_DIRS.of(stage)):
        return PLAN_CFG
    cfg = experiment_runs()[stage].get(directory)
    if cfg is None:
        raise ValueError(f"{directory}: not a {stage} directory of the --config run or of "
                         f"experiment {experiment_name(PAPER_OVERRIDES)}")
    return cfg


def run_path(stage, name):
    """<results_dir>/runs/<the stage's directory, with wildcards>/<name>."""
    return str(Path(PLAN_CFG.results_dir) / "runs" / RUN_DIR_PATTERNS[stage] / name)


def run_output(stage):
    """The sentinel artifact of a run stage (with wildcards)."""
    return run_path(stage, SENTINELS[stage])


def run_outputs(stage, cost_mode=None):
    """Every artifact a run stage writes (with wildcards), sentinel last. The costs stage
    writes factors.npz only with eager costs, so its rules name the cost mode."""
    lazy = cost_mode != "eager"
    return [_in_mode(run_path(stage, a.name), cost_mode)
            for a in _stage_artifacts(stage, lazy)]


def costs_outputs(wildcards):
    """The solve job's input: every artifact of the costs stage in the job's cost mode."""
    return [p.format(**wildcards) for p in run_outputs("costs", wildcards.cost_mode)]


def run_params(stage):
    """params.overrides of a run stage: the Hydra overrides of exactly the config the stage
    depends on, for the run whose stage directory the job's output is in."""

    def overrides(wildcards, output):
        return stage_overrides(run_config(stage, str(Path(output[0]).parent)), stage)

    return overrides


def _in_mode(path, cost_mode):
    return path if cost_mode is None else path.replace("{cost_mode}", cost_mode)


def run_log(stage, cost_mode=None):
    return _in_mode(run_path(stage, f"{stage}.log"), cost_mode)


def run_benchmark(stage, cost_mode=None):
    return _in_mode(run_path(stage, f"benchmark-{stage}.tsv"), cost_mode)


# --------------------------------------------------------------------------- paper


def paper_run_records(wildcards):
    """Input of the paper rule: the run record of every run of the experiment."""
    return [str(Path(d) / SENTINELS["solve"]) for d in experiment_runs()["solve"]]


def paper_outputs():
    """Every file the paper writes for the experiment."""
    return output_files(PLAN_CFG.results_dir, experiment_name(PAPER_OVERRIDES))


def paper_log():
    """Log of the paper rule, <results_dir>/paper/<experiment>.log."""
    return str(Path(PLAN_CFG.results_dir) / "paper" / f"{experiment_name(PAPER_OVERRIDES)}.log")
