"""The Python entry point, for notebooks and training scripts: :func:`plan` returns a :class:`Run`.

    from pipeline.api import plan

    run = plan(model="toy", mesh=(2, 4), solver="ilp", overrides=["solver.mip_gap=0.01"])
    run.objective, run.placement_hash, run.plan.parameter_placements()

:func:`plan` composes and validates the same config as ``python -m pipeline`` with the
same overrides (:func:`pipeline.config.load_resolved`, then the checks before any stage
writes, :func:`pipeline.stages.runner.preflight_trace`), and runs the same stages through
the same runner (:func:`pipeline.stages.runner.run_pipeline`) into the same directories:
a stage whose artifacts are current is reused, whichever front end wrote them, and a
run made here is reused by the command line, Snakemake and :mod:`pipeline.tools.profile`.
A bad value raises the error the command line reports, with the same one-line message
(:class:`pipeline.config.ConfigError` for the config; :class:`pipeline.core.errors.PlanError`,
:class:`pipeline.models.ModelError` and the solver errors of
:data:`pipeline.stages.runner.USER_ERRORS` from the stages).

Keyword arguments are config keys: ``solver="ilp"`` (a group option),
``lazy_costs=False``, ``mesh_names=["dp", "tp"]``, and a dotted key with ``__`` for each
dot, ``solver__time_limit_s=60`` for ``solver.time_limit_s=60``; each value is written in
Hydra's grammar (:func:`pipeline.config.override_value`). ``overrides`` takes Hydra
override strings as they are (``"solver.backend=highs"``, ``"+model.config.x=1"``) and
comes last, so it wins over the keywords. :func:`hydra_overrides` shows the overrides a
call makes, i.e. the equivalent ``python -m pipeline`` command.

The report (``runs.parquet`` over every run of ``results_dir``, the plan pictures
``plan.png``/``plan.svg``) is written only with ``report=True``, as ``python -m
pipeline`` does after every run. docs/api.md has a runnable example.
The library configures no logging: ``pipeline.stages.runner.configure_logging()`` turns
on the command line's INFO lines.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.config import StageDirs, load_resolved, mesh_label, override_value, stage_dirs
from pipeline.core import artifacts, runtime
from pipeline.plan.format import Plan
from pipeline.plan.format import load as load_plan
from pipeline.stages.runner import preflight_trace, run_pipeline

__all__ = ["RUN_TABLES", "Run", "hydra_overrides", "plan"]

#: The Parquet artifacts of one run, by name (``Run.table(name)``): the stage that
#: writes each into its own directory.
RUN_TABLES: dict[str, artifacts.Artifact] = {
    a.name.removesuffix(".parquet"): a for a in artifacts.ARTIFACTS
    if a.name.endswith(".parquet") and a.stage in ("trace", "topology", "solve")}


@dataclass(frozen=True)
class Run:
    """One planned run: its resolved config, its stage directories and its run record.

    The record is read when the run is made; the plan file and the tables are read on
    first use and kept (``cached_property``).

    Attributes:
        config: the resolved config (:func:`pipeline.config.resolve`).
        dirs: the stage directories (:func:`pipeline.config.stage_dirs`), relative to
            the working directory when ``results_dir`` is.
        record: the run record, ``run.json`` of the solve directory.
        seconds: wall seconds of each phase of the call that made it (``trace``,
            ``topology``, ``cost_build``, ``solve``, ``report`` with ``report=True``,
            ``wall``); a reused stage takes milliseconds. Empty for :meth:`of`.
    """

    config: DictConfig = field(repr=False)
    dirs: StageDirs = field(repr=False)
    record: dict[str, Any] = field(repr=False)
    seconds: dict[str, float] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, config: DictConfig, seconds: Mapping[str, float] | None = None) -> Run:
        """The run of a resolved config whose solve stage has run (its record read now).

        Raises:
            FileNotFoundError: the solve directory has no ``run.json``.
        """
        dirs = stage_dirs(config)
        record = artifacts.read_json(artifacts.RUN, dirs.solve)
        return cls(config=config, dirs=dirs, record=record, seconds=dict(seconds or {}))

    @property
    def solve_dir(self) -> Path:
        """The solve stage's directory: ``run.json``, ``plan.json``, ``solution.parquet``."""
        return self.dirs.solve

    @property
    def plan_path(self) -> Path:
        """``plan.json`` of the run (docs/plan.md)."""
        return artifacts.PLAN.path(self.dirs.solve)

    @functools.cached_property
    def plan(self) -> Plan:
        """The plan file, loaded and validated (:func:`pipeline.plan.load`)."""
        return load_plan(self.plan_path)

    @property
    def objective(self) -> float | None:
        """The solver's objective: the plan's cost under the MRF (microseconds); None
        where the record has none (a non-finite value is written as null)."""
        return self.record.get("objective")

    @property
    def step_time_us(self) -> float | None:
        """The predicted time of one training step (microseconds), as the record has it."""
        return self.record.get("step_time_us")

    @property
    def status(self) -> str:
        """The solver status (``Optimal``, ``Feasible``, ...)."""
        return str(self.record["status"])

    @property
    def placement_hash(self) -> str:
        """SHA-256 over every node's chosen placements (the plan file's too)."""
        return str(self.record["placement_hash"])

    def table(self, name: str) -> Any:
        """A Parquet artifact of the run as a ``pyarrow.Table``, read now: ``graph``
        (trace), ``nodes``, ``strategies``, ``edges`` (topology), ``solution``,
        ``redistributions`` (solve); :data:`RUN_TABLES`.

        Raises:
            ValueError: an unknown name (one line naming the allowed ones).
        """
        if name not in RUN_TABLES:
            raise ValueError(f"table={name}: allowed {', '.join(sorted(RUN_TABLES))}")
        artifact = RUN_TABLES[name]
        return runtime.read_parquet(artifact.path(self.dirs.of(artifact.stage)))

    @functools.cached_property
    def solution(self) -> Any:
        """``solution.parquet``: one row per node, its chosen placements and costs."""
        return self.table("solution")

    @functools.cached_property
    def redistributions(self) -> Any:
        """``redistributions.parquet``: one row per edge whose placements differ."""
        return self.table("redistributions")

    def __repr__(self) -> str:
        return (f"Run(model={self.config.model.name}, mesh={mesh_label(self.config.mesh)}, "
                f"solver={self.config.solver.name}, status={self.status}, "
                f"objective={self.objective}, step_time_us={self.step_time_us}, "
                f"solve_dir={self.solve_dir})")


def hydra_overrides(model: str = "llama1b", mesh: str | int | Sequence[int] = "2x4x8", *,
                    results_dir: str | os.PathLike[str] | None = None,
                    overrides: Sequence[str] = (), **options: Any) -> list[str]:
    """The Hydra overrides of a :func:`plan` call (the module docstring says how each
    argument is written): ``hydra_overrides("toy", (2, 4), solver="ilp")`` ->
    ``["model=toy", "mesh=2x4", "solver=ilp"]``.

    Raises:
        TypeError: a keyword value Hydra's grammar cannot write (a set, an object), or
            ``overrides`` given as one string instead of a list of them.
    """
    if isinstance(overrides, str):
        raise TypeError(f"overrides={overrides!r}: allowed a list of Hydra overrides, "
                        f"e.g. [{overrides!r}]")
    shape = str(mesh) if isinstance(mesh, (str, int)) else "x".join(str(d) for d in mesh)
    out = [f"model={model}", f"mesh={shape}"]
    if results_dir is not None:
        out.append(f"results_dir={override_value(os.fspath(results_dir), quote='path')}")
    out += [f"{key.replace('__', '.')}={override_value(value)}"
            for key, value in options.items()]
    return out + list(overrides)


def plan(model: str = "llama1b", mesh: str | int | Sequence[int] = "2x4x8", *,
         results_dir: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (),
         report: bool = False, force: bool = False, **options: Any) -> Run:
    """Plan how to shard ``model`` over ``mesh``, as ``python -m pipeline`` does.

    Args:
        model: a ``conf/model/`` option (``toy``, ``llama1b``, ``hf/gpt2``, ...).
        mesh: the mesh shape: ``"2x4x8"``, ``"2,4,8"``, ``8`` or ``(2, 4, 8)``.
        results_dir: where the runs go (default the config's, ``results`` under the
            working directory).
        overrides: Hydra override strings, applied last.
        report: also write the report over every run of ``results_dir`` (and the plan
            pictures), as the command line does.
        force: rerun every stage, even one whose artifacts are current.
        **options: further config keys, ``__`` for each dot (module docstring).

    Returns:
        The :class:`Run`, its record read.

    Raises:
        ConfigError: a bad value, with the command line's one-line message.
        PlanError, ModelError, InfeasibleError, FractionalRelaxationError: as the
            command line reports them (one line: ``str(err)``).
    """
    cfg = load_resolved(hydra_overrides(model, mesh, results_dir=results_dir,
                                        overrides=overrides, **options))
    preflight_trace(cfg)
    timer = run_pipeline(cfg, force=force, report=report)
    return Run.of(cfg, timer.seconds)
