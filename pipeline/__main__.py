"""Run the whole pipeline in one process: ``python -m pipeline [hydra overrides...]``.

    python -m pipeline mesh=2x4x8 solver=approx
    python -m pipeline model=toy mesh='2,4,8' solver=ilp
    python -m pipeline -m lazy_costs=true,false mesh=8,2x4,2x4x8     # Hydra sweep

Stages trace -> topology -> costs -> solve run in order, each reusing its artifact
when it is current, then the report over all runs under ``results_dir`` (a sweep writes
it once, after its last job): :func:`pipeline.stages.runner.run_pipeline` and
:func:`~pipeline.stages.runner.report_once`; this module is the Hydra entry. Every
override of every job of a sweep is validated before anything runs: a bad value prints
one line on stderr and exits with 2.
Hydra writes nothing on a single run; a multirun writes only its ``multirun.yaml``
under ``<results_dir>/hydra/multirun/``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import hydra
from omegaconf import DictConfig

from pipeline.config import (
    CONF_DIR,
    ConfigError,
    load_resolved,
    normalise_overrides,
    register_configs,
    resolve,
    sweep_overrides,
)
from pipeline.stages.runner import (
    USER_ERRORS,
    configure_logging,
    preflight_trace,
    report_once,
    run_pipeline,
)


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def _hydra_task(cfg: DictConfig) -> None:
    configure_logging()  # again in the worker processes of the joblib/submitit launchers
    try:
        resolved = resolve(cfg)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    try:
        run_pipeline(resolved, report=not _is_multirun())
    except USER_ERRORS as err:
        print(str(err).splitlines()[0] if str(err) else type(err).__name__, file=sys.stderr)
        sys.exit(2)


def _prevalidate(argv: Sequence[str]) -> tuple[list[str], list[DictConfig]]:
    """Normalise the overrides in ``argv`` and validate every job they describe.

    Returns the argument list to hand to Hydra and, for a sweep, the resolved config of
    every job (empty otherwise: a single run writes its own report).

    Raises:
        ConfigError: one line, for the first bad value of any job.
    """
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(list(argv))
    fixed = dict(zip(args.overrides, normalise_overrides(args.overrides, args.multirun),
                     strict=True))
    new_argv = [fixed.get(a, a) for a in argv]
    overrides = [fixed[o] for o in args.overrides]
    informational = (args.help or args.hydra_help or args.cfg or args.shell_completion
                     or args.info is not None or args.config_name or args.config_dir
                     or args.config_path or args.experimental_rerun)
    jobs: list[DictConfig] = []
    if not informational:
        for job in (sweep_overrides(overrides) if args.multirun else [overrides]):
            cfg = load_resolved(job)
            preflight_trace(cfg)
            if args.multirun:
                jobs.append(cfg)
    return new_argv, jobs


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m pipeline``; exits 2 on a bad configuration."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        new_argv, sweep_jobs = _prevalidate(argv)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    register_configs()
    configure_logging()
    sys.argv = [sys.argv[0], *new_argv]
    try:
        _hydra_task()
    finally:  # also after a failed job: the report of the runs the sweep made
        if sweep_jobs and sys.exc_info()[0] is not KeyboardInterrupt:
            report_once(sweep_jobs)


if __name__ == "__main__":
    main()
