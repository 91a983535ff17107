"""Run one stage: ``python -m pipeline.cli <stage> [hydra overrides...]``.

``<stage>`` is one of trace, topology, costs, solve, report. The overrides are the
same as for ``python -m pipeline`` (``model=toy mesh=2x4x8 solver=ilp``); the
Snakemake rules call this CLI with the overrides of exactly the config the stage
depends on (:func:`pipeline.config.stage_overrides`).

Exit codes: 0 done (or reused), 2 bad configuration or usage (one line on stderr,
nothing written), 1 a stage failed (traceback).

This module also holds what every entry point shares (``python -m pipeline``,
:mod:`pipeline.api`, the tools): :func:`run_stage`, which runs a stage under a lock on
``<stage dir>/.lock`` and reuses an existing artifact, judged by the stage's sentinel
(:data:`pipeline.core.artifacts.SENTINELS`, re-exported here), and the composition of
the stages, :func:`run_pipeline` (every stage in order) and :func:`report_once` (the
report of a sweep).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.config import (
    STAGES,
    ConfigError,
    StageDirs,
    load_resolved,
    stage_code_hash,
    stage_dirs,
)
from pipeline.config.readers import workers_config
from pipeline.core import artifacts
from pipeline.core.artifacts import CODE_STAMP, LOCK_FILE, SENTINELS, stage_outputs
from pipeline.core.runtime import PhaseTimer

log = logging.getLogger(__name__)

#: Phase name under which each stage is timed by ``python -m pipeline``. The phase names
#: are the same everywhere (run record, Parquet, benchmark, paper table): ``trace``,
#: ``topology``, ``cost_build``, ``factor_build`` (pairwise group factors, see
#: pipeline/stages/costs/stage.py), ``solve``, ``report``; ``search_total`` = trace through solve,
#: ``wall`` = the whole process.
PHASES: dict[str, str] = {
    "trace": "trace",
    "topology": "topology",
    "costs": "cost_build",
    "solve": "solve",
    "report": "report",
}

_UPSTREAM: dict[str, str] = {"topology": "trace", "costs": "topology", "solve": "costs"}
_USAGE = f"usage: python -m pipeline.cli {{{','.join(STAGES)}}} [hydra overrides...]"


def _user_errors() -> tuple[type[BaseException], ...]:
    from pipeline.core.errors import PlanError
    from pipeline.models import ModelError
    from pipeline.solvers.errors import FractionalRelaxationError, InfeasibleError

    return (PlanError, ModelError, FractionalRelaxationError, InfeasibleError)


#: Errors whose one-line message is the whole story for the user (exit status 2).
USER_ERRORS = _user_errors()


def preflight_trace(cfg: DictConfig) -> None:
    """Before any stage writes: every sharded input dim at least its shard count
    (:func:`pipeline.config.validate.check_input_sharding`), then the model checks that
    need the family's packages or a forward on meta (:func:`pipeline.models.preflight`),
    unless the trace artifact exists (the model was traced, so it is valid).

    Raises:
        ConfigError: one line naming the key, the value and what is allowed.
    """
    from omegaconf import OmegaConf

    from pipeline.config.pipeline_stage import pipeline_degree, stage_config
    from pipeline.config.validate import check_input_sharding
    from pipeline.models import ModelError, preflight

    if pipeline_degree(cfg) > 1:  # the stage solve's config (sub-mesh, one microbatch)
        cfg = stage_config(cfg)
    if cfg.get("recipe") is None:  # a recipe places the inputs itself
        check_input_sharding(cfg, list(cfg.mesh), list(cfg.mesh_names))
    if sentinel(stage_dirs(cfg), "trace").exists():
        return
    try:
        preflight(OmegaConf.to_container(cfg.model, resolve=True))
    except ModelError as err:
        raise ConfigError(str(err)) from None


def sentinel(dirs: StageDirs, stage: str) -> Path:
    """Path of the artifact ``stage`` writes last (``dirs.solve / "run.json"``, ...)."""
    return dirs.of(stage) / SENTINELS[stage]


#: errno values of a directory this process may not write (a read-only results tree).
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def _open_lock(directory: Path) -> Any:
    """Open ``directory/.lock`` for appending (created if missing)."""
    return open(directory / LOCK_FILE, "a")


@contextlib.contextmanager
def stage_lock(directory: Path) -> Iterator[bool]:
    """Hold an exclusive ``fcntl.flock`` on ``directory/.lock`` (:data:`LOCK_FILE`, created
    with the directory); yields whether the directory is writable.

    A second process writing the same stage directory waits here, then finds the
    artifact and reuses it. On a read-only results tree no lock can be taken (nor is one
    needed: nobody writes there through this process); it yields ``False``.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fh = _open_lock(directory)
    except OSError as err:
        if err.errno not in _READ_ONLY:
            from pipeline.core.errors import WriteError

            raise WriteError.of(directory / LOCK_FILE, err) from None
        yield False
        return
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def stage_is_current(stage: str, dirs: StageDirs, code: str, lazy_costs: bool = True) -> bool:
    """Whether every artifact of the stage exists (``lazy_costs``: the cost mode, which
    decides whether the costs stage writes ``factors.npz``), matches the size, checksum
    and schema version of the stage's stamp (:func:`pipeline.core.artifacts.write_stamp`,
    written after them), was made by the current code, and is not older than the
    artifact it was computed from (the checks Snakemake makes, and the content checks it
    does not make, for one process). A missing, truncated or changed artifact is logged in
    one line naming it, and the stage reruns."""
    directory = dirs.of(stage)
    done = sentinel(dirs, stage)
    if not done.exists():
        return False
    outputs = stage_outputs(stage, lazy_costs)
    for artifact in outputs:
        if not artifact.path(directory).exists():
            log.warning("%s: %s is missing; rerunning", stage, artifact.path(directory))
            return False
    stamp = artifacts.read_stamp(directory)
    if stamp is None:
        log.warning("%s: %s has no checksum stamp (%s); rerunning", stage, directory,
                    CODE_STAMP)
        return False
    if stamp.get("code") != code:
        log.info("%s: code changed since %s was written; rerunning", stage, done)
        return False
    problem = artifacts.stamp_problem(directory, outputs, stamp)
    if problem is not None:
        log.warning("%s: %s; rerunning", stage, problem)
        return False
    upstream = _UPSTREAM.get(stage)
    if upstream is not None:
        src = sentinel(dirs, upstream)
        if src.exists() and src.stat().st_mtime > done.stat().st_mtime:
            log.info("%s: %s is newer than %s; rerunning", stage, src, done)
            return False
    return True


def check_problem_size(cfg: DictConfig, dirs: StageDirs) -> None:
    """Before the costs stage builds anything: estimate the problem from the topology
    (:func:`pipeline.stages.costs.problem_size.estimate`) and refuse one above
    ``solver.max_memory``.

    Raises:
        PlanError: one line with the estimate and what to change.
    """
    from pipeline.config import mesh_label
    from pipeline.stages.costs.problem_size import check_fits, estimate

    size = estimate(dirs.topology)
    log.info("costs: estimated %s group labels, %s class pairs, %.2f GiB", f"{size.labels:,}",
             f"{size.class_pairs:,}", size.bytes / 2**30)
    check_fits(size, cfg.solver.get("max_memory"), mesh_label(cfg.mesh))


def check_inputs(stage: str, dirs: StageDirs, lazy_costs: bool) -> None:
    """Before a stage runs on its own (``python -m pipeline.cli``, the Snakemake jobs):
    every artifact of the earlier stages that carries a stamp must match it.

    Raises:
        PlanError: one line naming the file and the stage to rerun.
    """
    from pipeline.core.errors import PlanError

    for earlier in STAGES[:STAGES.index(stage)]:
        directory = dirs.of(earlier)
        stamp = artifacts.read_stamp(directory)
        if stamp is None:
            continue
        problem = artifacts.stamp_problem(directory, stage_outputs(earlier, lazy_costs), stamp)
        if problem is not None:
            raise PlanError(f"{problem}; rerun the {earlier} stage (python -m pipeline "
                            f"reruns it; snakemake --forcerun {earlier} or delete the file)")


def _call_stage(stage: str, cfg: DictConfig, dirs: StageDirs) -> None:
    """Call the stage function (imported here, so this module imports without them)."""
    if stage == "trace":
        from pipeline.stages.trace.stage import run_trace

        run_trace(cfg, dirs.trace)
    elif stage == "topology":
        from pipeline.stages.topology import run_topology

        run_topology(cfg, dirs.trace, dirs.topology)
    elif stage == "costs":
        from pipeline.stages.costs.stage import run_costs

        check_problem_size(cfg, dirs)  # before anything is built
        run_costs(cfg, dirs.topology, dirs.costs)
    elif stage == "solve":
        from pipeline.config.pipeline_stage import pipeline_degree

        if pipeline_degree(cfg) > 1:  # priced from its stage solve (docs/pipelining.md)
            from pipeline.stages.solve.pipelined import run_pipelined

            run_pipelined(cfg, dirs)
        else:
            from pipeline.stages.solve.stage import run_solve

            run_solve(cfg, dirs)
    elif stage == "report":
        from pipeline.stages.report.stage import run_report

        run_report(Path(cfg.results_dir), workers=workers_config(cfg))
    else:
        raise ValueError(f"stage={stage}: allowed {', '.join(STAGES)}")


def run_stage(stage: str, cfg: DictConfig, dirs: StageDirs, force: bool = False) -> bool:
    """Run ``stage`` for a resolved config unless its artifact is current; return whether
    it ran.

    Under the directory lock: the artifact is reused when it exists, the stage's code
    (:func:`pipeline.config.stage_code_hash`) is unchanged and it is not older than its
    input; otherwise the stage runs and a code stamp is written next to it. ``report``
    aggregates every run under ``results_dir`` and always runs.

    Raises:
        FileNotFoundError: the stage finished without writing its sentinel artifact.
        Exception: whatever the stage function raises.
    """
    from pipeline.core.errors import PlanError
    from pipeline.solvers.ilp.interrupts import remove_stale_temps

    directory = dirs.of(stage)
    code = stage_code_hash(stage)
    lazy = bool(cfg.lazy_costs)
    with stage_lock(directory) as writable:
        if writable:
            for stale in remove_stale_temps(directory):
                log.info("%s: removed %s, a temp file of an interrupted run", stage, stale)
        if not force and stage != "report" and stage_is_current(stage, dirs, code, lazy):
            log.info("%s: reusing %s", stage, sentinel(dirs, stage))
            return False
        if not writable:
            if stage == "report" and sentinel(dirs, stage).exists():
                log.warning("report: %s is read-only; keeping its tables", directory)
                return False
            raise PlanError(f"results_dir={cfg.results_dir}: {directory} is read-only and "
                            f"the {stage} stage has to run; allowed a writable results_dir "
                            "(or a fully cached run)")
        log.info("%s: running in %s", stage, directory)
        try:
            _call_stage(stage, cfg, dirs)
        except BaseException:
            _remove_if_empty(directory)
            raise
        if not sentinel(dirs, stage).exists():
            raise FileNotFoundError(
                f"stage {stage} finished without writing {sentinel(dirs, stage)}")
        # what the stage wrote (a missing artifact fails stage_is_current on its own)
        artifacts.write_stamp(directory, code, [a for a in stage_outputs(stage, lazy)
                                                if a.path(directory).exists()])
        remove_stale_temps(directory)
    return True


def run_pipeline(cfg: DictConfig, force: bool = False, report: bool = True) -> PhaseTimer:
    """Run every stage for a *resolved* config; return the wall time of each phase.

    A stage whose artifact is current is reused (unless ``force``: every stage runs).
    Once a stage has run, the later stages run too, because their artifacts are now
    older than their input (:func:`run_stage` compares modification times, as Snakemake
    does) -- unless another process running the same config has already remade them
    from the new input meanwhile: then they are current and reused, so two processes of
    one config run each stage once. The report always runs, unless ``report`` is false
    (a job of a sweep: the sweep writes one report at its end, :func:`report_once`).
    """
    from pipeline.config.pipeline_stage import pipeline_degree, stage_config

    dirs = stage_dirs(cfg)
    timer = PhaseTimer()
    done = []
    # a pipelined run: the stage solve (sub-mesh, one microbatch) runs trace .. solve, then
    # the solve stage of the pipelined config prices the pipeline from it
    sub = stage_config(cfg) if pipeline_degree(cfg) > 1 else None
    with timer.phase("wall"):
        for stage in STAGES if report else [s for s in STAGES if s != "report"]:
            with timer.phase(PHASES[stage]):
                if sub is not None and stage != "report":
                    ran = run_stage(stage, sub, stage_dirs(sub), force=force)
                if sub is None or stage in ("solve", "report"):
                    ran = run_stage(stage, cfg, dirs, force=force and stage != "report")
            done.append(f"{stage} {timer.seconds[PHASES[stage]]:.2f} s"
                        + ("" if ran else " (reused)"))
    log.info("stages: %s; wall %.2f s", ", ".join(done), timer.seconds["wall"])
    print(f"run record: {sentinel(dirs, 'solve')}")
    if report:
        print(f"report: {dirs.report}")
    return timer


def report_once(jobs: Sequence[DictConfig]) -> None:
    """The report stage of a sweep, once per results directory after its jobs (resolved
    configs): the report reads every run under the directory, so one report at the end
    is the one a report per job would leave, without rereading (and redrawing) the
    earlier runs for every job."""
    first: dict[str, DictConfig] = {}
    for c in jobs:
        first.setdefault(str(c.results_dir), c)
    for cfg in first.values():
        timer = PhaseTimer()
        with timer.phase("report"):
            run_stage("report", cfg, stage_dirs(cfg))
        log.info("report of the sweep: %.2f s", timer.seconds["report"])
        print(f"report: {stage_dirs(cfg).report}")


def _remove_if_empty(directory: Path) -> None:
    """After a failed stage: drop its directory if only the lock file is in it, so a
    failure leaves nothing half-made behind (the lock is released by then only on
    POSIX unlink semantics, which keep the open descriptor valid)."""
    entries = ([p for p in directory.iterdir() if p.name != LOCK_FILE]
               if directory.exists() else [])
    if not entries and directory.exists():
        (directory / LOCK_FILE).unlink(missing_ok=True)
        try:
            directory.rmdir()
        except OSError:
            pass


#: Environment variable naming a file descriptor that also gets the one-line error of a
#: failing stage. The Snakemake rules send a job's stderr to its log; their shell prefix
#: (workflow/rules/common.smk) keeps Snakemake's own stderr open as fd 3 and sets this,
#: so the line reaches the user as well.
ERROR_FD_ENV = "PIPELINE_ERROR_FD"


def tell_error(line: str, to_stderr: bool = True) -> None:
    """Print a one-line error on stderr (unless ``to_stderr`` is false) and on the
    descriptor of :data:`ERROR_FD_ENV`, if set."""
    if to_stderr:
        print(line, file=sys.stderr, flush=True)
    fd = os.environ.get(ERROR_FD_ENV)
    if not fd:
        return
    try:
        os.write(int(fd), (line + "\n").encode())
    except (OSError, ValueError) as err:
        print(f"{ERROR_FD_ENV}={fd}: cannot write the error there ({err})", file=sys.stderr)


def configure_logging() -> None:
    """INFO messages of the pipeline on stderr (Hydra's own logging is switched off), or
    the level of ``PIPELINE_LOG_LEVEL`` (a bad one: :class:`ConfigError`, one line)."""
    from pipeline.config import log_level

    logging.basicConfig(level=log_level(),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pipeline.cli``; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    stage, overrides = args[0], args[1:]
    if stage not in STAGES:
        print(f"stage={stage}: allowed {', '.join(STAGES)}", file=sys.stderr)
        return 2
    try:
        cfg = load_resolved(overrides)
        if stage == "trace":
            preflight_trace(cfg)
    except ConfigError as err:
        tell_error(str(err))
        return 2
    configure_logging()
    try:
        check_inputs(stage, stage_dirs(cfg), bool(cfg.lazy_costs))
        run_stage(stage, cfg, stage_dirs(cfg))
    except USER_ERRORS as err:
        tell_error(str(err).splitlines()[0] if str(err) else type(err).__name__)
        return 2
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        tell_error(f"{stage}: {type(err).__name__}: {first} (traceback in the job's log)",
                   to_stderr=False)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
