# Helpers shared by the rules: compose and validate the Hydra config from --config,
# and derive each stage's paths and params from it (all logic lives here and in
# pipeline.config; the rules stay thin).
#
# --config keys: model, mesh, mesh_names, solver, lazy_costs, hardware, experiment,
# repeated_subgraphs, optimality_check, results_dir, revision_label, and overrides
# (further space-separated Hydra overrides, e.g. overrides="solver.time_limit_s=60").
# A bad value prints one line on stderr and exits with status 2 before any job runs.

import shlex
import sys
from pathlib import Path

PROJECT_ROOT = Path(workflow.basedir).parent
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

from pipeline.cli import SENTINELS
from pipeline.config import (
    ConfigError,
    load_resolved,
    overrides_from_snakemake,
    stage_code_hash,
    stage_dirs,
    stage_overrides,
)

try:
    PLAN_CFG = load_resolved(overrides_from_snakemake(config, sys.argv))
except ConfigError as err:
    print(err, file=sys.stderr)
    sys.exit(2)
PLAN_DIRS = stage_dirs(PLAN_CFG)

# Jobs run `python -m pipeline.cli` with this interpreter and this checkout first on the
# import path, so they run the same code whether or not the package is installed.
# (The prefix is formatted like a shell command: literal braces are doubled.)
shell.prefix(
    "set -euo pipefail; "
    + f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"; "
    + f"export PYTHONPATH={shlex.quote(str(PROJECT_ROOT))}"
    + "${{PYTHONPATH:+:$PYTHONPATH}}; "
)


def stage_output(stage):
    """The sentinel artifact of a stage for the composed config."""
    return str(PLAN_DIRS.of(stage) / SENTINELS[stage])


def report_outputs():
    """The tables of the report stage."""
    return [str(PLAN_DIRS.report / name) for name in
            ("runs.parquet", "placements.parquet", "redistributions.parquet")]


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
