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
A point of a sweep that fails at run time prints its one line and the sweep goes on;
the sweep ends with a summary and exits 1 if any point failed (docs/sweeps.md).
Hydra writes nothing on a single run; a multirun writes only its ``multirun.yaml``
under ``<results_dir>/hydra/multirun/``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import hydra
from omegaconf import DictConfig

from pipeline.config import (
    CONF_DIR,
    ConfigError,
    check_environment,
    load_resolved,
    normalise_overrides,
    register_configs,
    resolve,
    sweep_overrides,
)
from pipeline.core import sweep
from pipeline.core.interrupts import Interrupted, handled
from pipeline.stages.runner import (
    USER_ERRORS,
    configure_logging,
    preflight_trace,
    report_once,
    run_pipeline,
)

log = logging.getLogger("pipeline")


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def _hydra_task(cfg: DictConfig) -> None:
    configure_logging()  # again in the worker processes of the joblib/submitit launchers
    if _is_multirun():
        _sweep_point(cfg)
        return
    try:
        resolved = resolve(cfg)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    try:
        run_pipeline(resolved, report=True)
    except USER_ERRORS as err:
        print(str(err).splitlines()[0] if str(err) else type(err).__name__, file=sys.stderr)
        sys.exit(2)


def _sweep_point(cfg: DictConfig) -> None:
    """One point of a sweep (no report: the sweep writes one at its end). Its outcome is
    recorded (:mod:`pipeline.core.sweep`) and the sweep goes on: a user error prints its
    one line and the point returns; any other error is recorded with its type and raised,
    for Hydra to report after the sweep's other points."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    where = os.environ.get(sweep.ENV_VAR)
    point = " ".join(hydra_cfg.overrides.task)

    def record(reason: str | None) -> None:
        if where:
            sweep.record_outcome(where, int(hydra_cfg.job.num),
                                 sweep.PointOutcome(point, reason))

    try:
        run_pipeline(resolve(cfg), report=False)
    except (ConfigError, *USER_ERRORS) as err:
        print(sweep.one_line(err), file=sys.stderr)
        record(sweep.one_line(err))
        return
    except Exception as err:
        record(sweep.one_line(err, with_type=True))
        raise
    record(None)


def _prevalidate(argv: Sequence[str]) -> tuple[list[str], list[DictConfig], list[str]]:
    """Normalise the overrides in ``argv`` and validate every job they describe.

    Returns the argument list to hand to Hydra and, for a sweep, the resolved config of
    every job and its overrides as text, in the sweep's order (both empty otherwise: a
    single run writes its own report).

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
    points: list[str] = []
    if not informational:
        for job in (sweep_overrides(overrides) if args.multirun else [overrides]):
            cfg = load_resolved(job)
            preflight_trace(cfg)
            if args.multirun:
                jobs.append(cfg)
                points.append(" ".join(job))
    return new_argv, jobs, points


def _outcome_dir(jobs: Sequence[DictConfig]) -> Path:
    """Where the points of a sweep record their outcomes:
    ``<results_dir of the first job>/hydra/sweeps/<time>-<pid>/`` (absolute: a SLURM job
    of the submitit launcher may start elsewhere; the results tree is shared)."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    return Path(str(jobs[0].results_dir)).resolve() / "hydra" / "sweeps" / f"{stamp}-{os.getpid()}"


def _end_of_sweep(points: Sequence[str], outcomes: Path) -> int:
    """Print the sweep's summary (:func:`pipeline.core.sweep.summary_lines`) on stderr;
    the exit status: 0 when every point planned, else 1. The outcome files stay as the
    record of the failures; when every point planned they are removed."""
    lines = sweep.summary_lines(points, sweep.read_outcomes(outcomes))
    if len(lines) == 1:
        shutil.rmtree(outcomes, ignore_errors=True)
        with contextlib.suppress(OSError):  # the parent too, unless other sweeps use it
            outcomes.parent.rmdir()
    else:
        log.info("sweep: the outcome of each point is in %s", outcomes)
    for line in lines:
        print(line, file=sys.stderr)
    return 0 if len(lines) == 1 else 1


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m pipeline``; exits 2 on a bad configuration, and a sweep
    whose points did not all plan exits 1 after its report and summary. SIGINT (Ctrl-C)
    or SIGTERM ends the run with one line and exit 130 / 143
    (:mod:`pipeline.core.interrupts`): the stage cut short removes its partial output, the
    finished stages stay and are reused by the same command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_environment()
        new_argv, sweep_jobs, points = _prevalidate(argv)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    register_configs()
    configure_logging()
    sys.argv = [sys.argv[0], *new_argv]
    outcomes = _outcome_dir(sweep_jobs) if sweep_jobs else None
    if outcomes is not None:
        os.environ[sweep.ENV_VAR] = str(outcomes)  # the points' processes inherit it
    try:
        with handled():  # SIGINT / SIGTERM: one line, exit 130 / 143 (below)
            _hydra_task()
    except Interrupted as err:
        print(f"python -m pipeline: {err}; the finished stages are kept, the interrupted "
              "stage left nothing behind; the same command goes on from there", file=sys.stderr)
        sys.exit(err.exit_code)
    finally:  # also after a failed job: the report of the runs the sweep made
        if outcomes is not None and sys.exc_info()[0] not in (KeyboardInterrupt, Interrupted):
            report_once(sweep_jobs)
            code = _end_of_sweep(points, outcomes)
            if code:
                sys.exit(code)


if __name__ == "__main__":
    main()
