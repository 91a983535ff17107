"""Run one stage: ``python -m pipeline.cli <stage> [hydra overrides...]``.

``<stage>`` is one of trace, topology, costs, solve, report. The overrides are the
same as for ``python -m pipeline`` (``model=toy mesh=2x4x8 solver=ilp``); the
Snakemake rules call this CLI with the overrides of exactly the config the stage
depends on (:func:`pipeline.config.stage_overrides`).

Exit codes: 0 done (or reused), 2 bad configuration or usage (one line on stderr,
nothing written), 1 a stage failed (traceback).

This module also holds what both entry points share: :func:`run_stage`, which runs a
stage under a lock on ``<stage dir>/.lock`` and reuses an existing artifact, judged by
the stage's sentinel (:data:`pipeline.artifacts.SENTINELS`, re-exported here).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from omegaconf import DictConfig

from pipeline.artifacts import CODE_STAMP, LOCK_FILE, SENTINELS, stage_outputs
from pipeline.config import (
    STAGES,
    ConfigError,
    StageDirs,
    load_resolved,
    stage_code_hash,
    stage_dirs,
)

log = logging.getLogger(__name__)

#: Phase name under which each stage is timed by ``python -m pipeline``. The phase names
#: are the same everywhere (run record, Parquet, benchmark, paper table): ``trace``,
#: ``topology``, ``cost_build``, ``factor_build`` (pairwise group factors, see
#: pipeline/costs.py), ``solve``, ``report``; ``search_total`` = trace through solve,
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
    from pipeline.errors import PlanError
    from pipeline.models import ModelError
    from pipeline.solvers.errors import FractionalRelaxationError, InfeasibleError

    return (PlanError, ModelError, FractionalRelaxationError, InfeasibleError)


#: Errors whose one-line message is the whole story for the user (exit status 2).
USER_ERRORS = _user_errors()


def preflight_trace(cfg: DictConfig) -> None:
    """Before any stage writes: the model checks that need the family's packages or a
    forward on meta (:func:`pipeline.models.preflight`), unless the trace artifact exists
    (the model was traced, so it is valid).

    Raises:
        ConfigError: one line naming the key, the value and what is allowed.
    """
    from omegaconf import OmegaConf

    from pipeline.models import ModelError, preflight

    if sentinel(stage_dirs(cfg), "trace").exists():
        return
    try:
        preflight(OmegaConf.to_container(cfg.model, resolve=True))
    except ModelError as err:
        raise ConfigError(str(err)) from None


def sentinel(dirs: StageDirs, stage: str) -> Path:
    """Path of the artifact ``stage`` writes last (``dirs.solve / "run.json"``, ...)."""
    return dirs.of(stage) / SENTINELS[stage]


@contextlib.contextmanager
def stage_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``directory/.lock`` (:data:`LOCK_FILE`, created
    with the directory).

    A second process writing the same stage directory waits here, then finds the
    artifact and reuses it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_FILE, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def stage_is_current(stage: str, dirs: StageDirs, code: str, lazy_costs: bool = True) -> bool:
    """Whether every artifact of the stage exists (``lazy_costs``: the cost mode, which
    decides whether the costs stage writes ``factors.npz``), was made by the current code,
    and is not older than the artifact it was computed from (the checks Snakemake makes,
    for one process)."""
    done = sentinel(dirs, stage)
    if not done.exists():
        return False
    for artifact in stage_outputs(stage, lazy_costs):
        if not artifact.path(dirs.of(stage)).exists():
            log.info("%s: %s is missing; rerunning", stage, artifact.path(dirs.of(stage)))
            return False
    stamp = dirs.of(stage) / CODE_STAMP
    if stamp.exists() and stamp.read_text().strip() != code:
        log.info("%s: code changed since %s was written; rerunning", stage, done)
        return False
    upstream = _UPSTREAM.get(stage)
    if upstream is not None:
        src = sentinel(dirs, upstream)
        if src.exists() and src.stat().st_mtime > done.stat().st_mtime:
            log.info("%s: %s is newer than %s; rerunning", stage, src, done)
            return False
    return True





def _call_stage(stage: str, cfg: DictConfig, dirs: StageDirs) -> None:
    """Call the stage function (imported here, so this module imports without them)."""
    if stage == "trace":
        from pipeline.trace import run_trace

        run_trace(cfg, dirs.trace)
    elif stage == "topology":
        from pipeline.topology import run_topology

        run_topology(cfg, dirs.trace, dirs.topology)
    elif stage == "costs":
        from pipeline.costs import run_costs

        run_costs(cfg, dirs.topology, dirs.costs)
    elif stage == "solve":
        from pipeline.solve import run_solve

        run_solve(cfg, dirs)
    elif stage == "report":
        from pipeline.report import run_report

        run_report(Path(cfg.results_dir))
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
    directory = dirs.of(stage)
    code = stage_code_hash(stage)
    with stage_lock(directory):
        if not force and stage != "report" and stage_is_current(stage, dirs, code,
                                                                bool(cfg.lazy_costs)):
            log.info("%s: reusing %s", stage, sentinel(dirs, stage))
            return False
        log.info("%s: running in %s", stage, directory)
        try:
            _call_stage(stage, cfg, dirs)
        except BaseException:
            _remove_if_empty(directory)
            raise
        if not sentinel(dirs, stage).exists():
            raise FileNotFoundError(
                f"stage {stage} finished without writing {sentinel(dirs, stage)}")
        (directory / CODE_STAMP).write_text(code + "\n")
    return True


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


def configure_logging() -> None:
    """INFO messages of the pipeline on stderr (Hydra's own logging is switched off)."""
    logging.basicConfig(level=os.environ.get("PIPELINE_LOG_LEVEL", "INFO"),
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
        print(err, file=sys.stderr)
        return 2
    configure_logging()
    try:
        run_stage(stage, cfg, stage_dirs(cfg))
    except USER_ERRORS as err:
        print(str(err).splitlines()[0] if str(err) else type(err).__name__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
