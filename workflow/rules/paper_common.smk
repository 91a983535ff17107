# Helpers of the paper rules (workflow/rules/paper.smk), after common.smk: the paper
# experiment's overrides, its runs' stage directories (composed only when a paper job
# needs them) and the paths and params of the paper rules.

import functools

from pipeline.paper import (
    experiment_name,
    experiment_overrides,
    load_experiment,
    output_files,
)

PAPER_OVERRIDES = experiment_overrides(overrides_from_snakemake(config, sys.argv))


@functools.cache
def paper_registry():
    """{stage: {stage directory: resolved config}} over every run of the experiment,
    composed on first use; a bad experiment stops the workflow with one line."""
    try:
        exp = load_experiment(PAPER_OVERRIDES)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    registry = {s: {} for s in ("trace", "topology", "costs", "solve")}
    for run in exp.runs():
        dirs = stage_dirs(run.cfg)
        for stage, table in registry.items():
            table.setdefault(str(dirs.of(stage)), run.cfg)
    return registry


def paper_run_path(pattern):
    """A path below <results_dir>/runs/ (with wildcards)."""
    return str(Path(PLAN_CFG.results_dir) / "runs" / pattern)


def paper_run_records(wildcards):
    """Input of the paper rule: the run record of every run of the experiment."""
    return [str(Path(d) / SENTINELS["solve"]) for d in paper_registry()["solve"]]


def paper_log():
    """Log of the paper rule, <results_dir>/paper/<experiment>.log."""
    return str(Path(PLAN_CFG.results_dir) / "paper" / f"{experiment_name(PAPER_OVERRIDES)}.log")


def paper_stage_params(stage):
    """params.overrides of a paper stage rule: the Hydra overrides of the config of the
    stage directory its output is in (as stage_params does for the main rules)."""

    def overrides(wildcards, output):
        directory = str(Path(output[0]).parent)
        cfg = paper_registry()[stage].get(directory)
        if cfg is None:
            raise ValueError(f"{directory}: not a {stage} directory of experiment "
                             f"{experiment_name(PAPER_OVERRIDES)}")
        return stage_overrides(cfg, stage)

    return overrides
