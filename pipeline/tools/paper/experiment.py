"""Paper experiments: composing an experiment and its run sets (:func:`load_experiment`),
the files the paper writes, and making the runs that are missing (:func:`ensure_runs`)
and the report they are read from (:func:`refresh_report`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.config import (
    ConfigError,
    load_resolved,
    parse_mesh,
    stage_code_hash,
    stage_dirs,
    sweep_overrides,
)

log = logging.getLogger("pipeline.tools.paper")

#: Experiment used when none is selected (fast; fits CI-size machines).
DEFAULT_EXPERIMENT = "paper_toy"

#: Run sets an experiment must define in ``paper.runs``.
RUN_SETS: tuple[str, ...] = ("eager_vs_lazy", "solvers", "depth", "scale")

#: Artifact name -> the files it consists of (in ``<results_dir>/paper/<experiment>/``).
ARTIFACTS: dict[str, tuple[str, ...]] = {
    "eager_vs_lazy": ("eager_vs_lazy.md", "eager_vs_lazy.parquet"),
    "fig_phases": ("fig_phases.png",),
    "fig_peak_rss": ("fig_peak_rss.png",),
    "fig_depth": ("fig_depth.png",),
    "fig_solvers": ("fig_solvers.png",),
    "plans": ("plans.md", "plans.parquet"),
    "fig_plans": ("fig_plans.png",),
    "scale": ("scale.md", "scale.parquet"),
    "fig_scale": ("fig_scale.png",),
}
SIDECAR_SUFFIX = ".provenance.json"
PROVENANCE_FILE = "provenance.json"


class PaperError(ValueError):
    """The paper cannot be built from what is there (one-line message)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


# --------------------------------------------------------------------------- experiments


def run_key(solve_dir: str | Path) -> str:
    """The result directory of a run below ``<results_dir>/runs/`` (five levels: trace,
    topology, hardware, cost mode, solver), independent of where ``results_dir`` is."""
    parts = PurePosixPath(Path(solve_dir).as_posix()).parts
    if len(parts) < 6 or parts[-6] != "runs":
        raise PaperError(f"solve_dir={solve_dir}: not a run directory "
                         "<results_dir>/runs/<trace>/<topology>/<hardware>/<mode>/<solver>")
    return "/".join(parts[-5:])


@dataclass(frozen=True)
class PaperRun:
    """One run of an experiment: the overrides that compose it and its resolved config."""

    overrides: tuple[str, ...]
    cfg: DictConfig = field(compare=False, repr=False)

    @property
    def key(self) -> str:
        return run_key(stage_dirs(self.cfg).solve)


@dataclass(frozen=True)
class Experiment:
    """A paper experiment: its name, base overrides, resolved config and run sets."""

    name: str
    overrides: tuple[str, ...]
    cfg: DictConfig = field(repr=False)
    sets: dict[str, list[PaperRun]] = field(repr=False)
    table_mesh: str

    @property
    def results_dir(self) -> Path:
        return Path(self.cfg.results_dir)

    @property
    def out_dir(self) -> Path:
        return paper_dir(self.cfg.results_dir, self.name)

    def runs(self) -> list[PaperRun]:
        """Every distinct run of the experiment (by result directory), in set order."""
        seen: dict[str, PaperRun] = {}
        for name in RUN_SETS:
            for run in self.sets[name]:
                seen.setdefault(run.key, run)
        return list(seen.values())


@functools.lru_cache(maxsize=256)
def _resolved(overrides: tuple[str, ...]) -> DictConfig:
    """:func:`load_resolved`, memoised (an experiment composes every run, and Snakemake
    parses the workflow again in every job); the config is read-only."""
    cfg = load_resolved(list(overrides))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def experiment_overrides(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with ``experiment=`` :data:`DEFAULT_EXPERIMENT` first when none is
    selected."""
    out = list(overrides)
    if not any(o.split("=", 1)[0].lstrip("+~") == "experiment" for o in out):
        out.insert(0, f"experiment={DEFAULT_EXPERIMENT}")
    return out


def experiment_name(overrides: Sequence[str]) -> str:
    """The selected experiment's name (the last ``experiment=`` override, else the
    default), without composing anything."""
    name = DEFAULT_EXPERIMENT
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+") == "experiment":
            name = value.strip("'\"")
    return name


def paper_dir(results_dir: str | Path, experiment: str) -> Path:
    """``<results_dir>/paper/<experiment>``."""
    return Path(results_dir) / "paper" / experiment


def output_files(results_dir: str | Path, experiment: str) -> list[str]:
    """Every file the paper writes for an experiment (what ``rule paper`` declares)."""
    out = paper_dir(results_dir, experiment)
    files = []
    for name, parts in ARTIFACTS.items():
        files.extend(str(out / p) for p in parts)
        files.append(str(out / f"{name}{SIDECAR_SUFFIX}"))
    files.append(str(out / PROVENANCE_FILE))
    return files


def _grids(entry: Any, set_name: str) -> list[list[str]]:
    """The sweeps of one run set: a list of overrides is one sweep (every combination of
    its values); a list of such lists is the union of their sweeps (e.g. one per mesh,
    each with its own batch size)."""
    items = list(entry) if entry is not None else []
    nested = [OmegaConf.is_list(i) or isinstance(i, (list, tuple)) for i in items]
    grids = [[str(o) for o in i] for i in items] if items and all(nested) else [
        [str(o) for o in items]]
    if not items or any(nested) and not all(nested) or not all(grids):
        raise ConfigError(f"paper.runs.{set_name}={list(items) if items else '[]'}: allowed a "
                          "non-empty list of overrides, e.g. \"paper.runs."
                          f"{set_name}=['mesh=8,2x4','lazy_costs=true,false']\", or a list of "
                          "such lists")
    return grids


def load_experiment(overrides: Sequence[str] = ()) -> Experiment:
    """Compose an experiment and every run of its run sets.

    Args:
        overrides: Hydra overrides (``experiment=paper``, ``results_dir=...``, any other
            key, applied to every run); no ``experiment=``: :data:`DEFAULT_EXPERIMENT`.

    Raises:
        ConfigError: one line, for a bad value in ``overrides`` or in a run set, or an
            experiment without the run sets :data:`RUN_SETS`.
    """
    base = experiment_overrides(overrides)
    cfg = _resolved(tuple(base))
    name = experiment_name(base)
    runs = cfg.paper.runs
    missing = [s for s in RUN_SETS if s not in runs]
    if missing:
        raise ConfigError(f"experiment={name}: paper.runs lacks the run set(s) "
                          f"{', '.join(missing)}; allowed an experiment defining "
                          f"{', '.join(RUN_SETS)} (e.g. conf/experiment/paper_toy.yaml)")
    cache: dict[tuple[str, ...], PaperRun] = {}
    sets: dict[str, list[PaperRun]] = {}
    for set_name in RUN_SETS:
        grids = _grids(runs[set_name], set_name)
        sets[set_name] = []
        for job in (j for grid in grids for j in sweep_overrides(grid)):
            full = (*base, *job)
            if full not in cache:
                cache[full] = PaperRun(overrides=full, cfg=_resolved(full))
            sets[set_name].append(cache[full])
    table_mesh = cfg.paper.table_mesh
    meshes = ["x".join(str(d) for d in r.cfg.mesh) for r in sets["eager_vs_lazy"]]
    if table_mesh is None:
        table_mesh = max(meshes, key=lambda m: (math.prod(int(d) for d in m.split("x")),
                                                m.count("x")))
    else:
        table_mesh = "x".join(str(d) for d in parse_mesh(table_mesh))
        if table_mesh not in meshes:
            raise ConfigError(f"paper.table_mesh={table_mesh}: allowed a mesh of run set "
                              f"eager_vs_lazy ({', '.join(dict.fromkeys(meshes))})")
    return Experiment(name=name, overrides=tuple(base), cfg=cfg, sets=sets,
                      table_mesh=table_mesh)


# --------------------------------------------------------------------------- running


def run_is_current(cfg: DictConfig) -> bool:
    """Whether every stage of a run, trace through solve, has a current artifact (the
    check ``python -m pipeline`` makes before reusing one)."""
    from pipeline.stages import runner as cli

    dirs = stage_dirs(cfg)
    return all(cli.stage_is_current(stage, dirs, stage_code_hash(stage), bool(cfg.lazy_costs))
               for stage in ("trace", "topology", "costs", "solve"))


def ensure_runs(exp: Experiment) -> list[str]:
    """Run the experiment's runs that are missing or stale, one ``python -m pipeline``
    process each (so a run's peak RSS is its own), one after the other.

    Returns:
        The keys of the runs that ran.

    Raises:
        subprocess.CalledProcessError: a run failed.
    """
    from pipeline.core.runtime import PROJECT_ROOT

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT),
                                                    env.get("PYTHONPATH")) if p)
    ran = []
    todo = [r for r in exp.runs() if not run_is_current(r.cfg)]
    for i, run in enumerate(todo, 1):
        log.info("paper: run %d/%d: %s", i, len(todo), " ".join(run.overrides))
        subprocess.run([sys.executable, "-m", "pipeline", *run.overrides], check=True,
                       env=env)
        ran.append(run.key)
    return ran


def refresh_report(exp: Experiment) -> Path:
    """Aggregate every run under ``results_dir`` into ``report/runs.parquet``; its path."""
    from pipeline.stages.runner import run_stage, sentinel

    dirs = stage_dirs(exp.cfg)
    run_stage("report", exp.cfg, dirs)
    return sentinel(dirs, "report")
