"""Mesh-shape sweep: plan one config on every factorisation of a world size into mesh
dims and rank the shapes by objective.

    python -m pipeline.tools.shapes world=64 model=llama1b [max_dims=4] [hydra overrides...]
    snakemake shapes --config world=64 model=toy [max_dims=4]

**Shapes.** A shape of ``k`` mesh dims for world size ``W`` is an *ordered* tuple
``(n_1, ..., n_k)`` of integers ``n_i > 1`` with ``n_1 * ... * n_k = W``, for
``k = 1 .. max_dims`` (``max_dims`` 3 by default, at most 4). Dims of size 1 are
excluded: a size-1 dim shards nothing (``Shard`` and ``Replicate`` on it are the same
local tensor and it runs no collective), so ``2x1x32`` would plan the same problem as
``2x32`` under another name. Order matters: a mesh dim is bound to a group of devices
and its collectives run on that group's links (the innermost dims share a node,
``hardware.gpus_per_node``), so ``2x4x8`` and ``8x4x2`` are different problems.
For ``W = prod p_j^{e_j}`` the number of ordered factorisations into exactly ``k``
factors > 1 is, by inclusion-exclusion over the factors allowed to be 1,
``sum_{i=0..k} (-1)^i C(k, i) prod_j C(e_j + k - i - 1, k - i - 1)``; for
``W = 2^6 = 64`` it is the number of compositions of 6 into ``k`` parts, ``C(5, k-1)``:
1, 5, 10, 10 for ``k`` = 1, 2, 3, 4.

**Dim names** are fixed by rank, tp innermost (as the planner's defaults,
:data:`pipeline.config.DEFAULT_MESH_NAMES`): ``dp``; ``dp, tp``; ``dp, cp, tp``; and
``pp, dp, cp, tp`` for four dims. ``pp`` (the first of four) is the pipeline dim: a
four-dim shape of a llama model is a pipelined run (its stage solve on the other three
dims, then the pipelined step with the configured ``pipeline.*``; docs/pipelining.md),
and the table gives its ``pp`` degree, ``microbatches``, ``schedule``,
``virtual_stages``, ``bubble_fraction`` and the largest rank's ``peak_bytes``. On the
other dims the placements the solver chooses decide what the dim does.

**Runs.** Each shape is one ordinary run (``mesh=<shape> mesh_names=[...]`` added to
the given overrides) in the ordinary results tree, so the stages are reused as by
``python -m pipeline``: the trace is keyed by ``model.*`` only
(:data:`pipeline.config.STAGE_KEYS`), so all shapes share one trace directory; each
shape has its own topology, costs and solve. Each run gets its plan picture
(:mod:`pipeline.stages.report.picture`). Every config is validated before anything runs.

**Outputs**, in ``<results_dir>/shapes/<model.name>-<h8>/w<W>-d<max_dims>/`` (``h8``:
the hash of the solve-stage keys without ``mesh`` and ``mesh_names``):
``shapes.parquet``, ``shapes.csv``, ``shapes.md`` (one row per shape, best objective
first, ties by shape) and ``shapes.png`` (objective per shape, and the step time when
the run records report ``step_time_us``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.config import (
    DEFAULT_MESH_NAMES,
    ConfigError,
    config_hash,
    load_resolved,
    mesh_label,
    stage_code_hash,
    stage_dirs,
    stage_keys,
)
from pipeline.core.codehash import source_hash
from pipeline.core.runtime import PROJECT_ROOT
from pipeline.core.sweep import PointOutcome, one_line, summary_lines

log = logging.getLogger(__name__)

#: Dim names of a shape by its number of dims, tp innermost.
SHAPE_MESH_NAMES: dict[int, tuple[str, ...]] = {
    **{k: tuple(v) for k, v in DEFAULT_MESH_NAMES.items()}, 4: ("pp", "dp", "cp", "tp")}
#: Largest number of mesh dims a sweep may ask for.
MAX_DIMS_ALLOWED = max(SHAPE_MESH_NAMES)
#: Default number of mesh dims.
DEFAULT_MAX_DIMS = 3

#: Table status of a shape whose inputs cannot be sharded as asked (not a failure).
NOT_APPLICABLE = "not applicable"
#: The sweep's own keys (everything else is a Hydra override of each run).
SWEEP_KEYS: tuple[str, ...] = ("world", "max_dims")
#: Files of a sweep, in write order (the figure last: it is the Snakemake sentinel).
OUTPUT_FILES: tuple[str, ...] = ("shapes.parquet", "shapes.csv", "shapes.md", "shapes.png")
#: Columns of the table, in order (``step_time_us``, ``tie`` and ``step_time_gap`` only
#: when a run record has a step time; ``peak_bytes`` and ``fits`` only when a run record
#: has them: the predicted peak per device and whether the reserved memory is within the
#: hardware preset's device memory, pipeline/memory/fit.py).
COLUMNS: tuple[str, ...] = ("rank", "mesh", "mesh_names", "dims", "step_time_us", "tie",
                            "step_time_gap", "objective", "compute_us", "comm_us",
                            "transition_us", "peak_bytes", "fits", "pp",
                            "microbatches", "schedule", "virtual_stages", "bubble_fraction",
                            "status", "gap", "placement_hash", "run_id", "solve_dir")
#: Columns of a pipelined run (only when some run has a ``pipeline`` section).
PIPELINE_COLUMNS: tuple[str, ...] = ("pp", "microbatches", "schedule", "virtual_stages",
                                     "bubble_fraction")
_RUN_STAGES = ("trace", "topology", "costs", "solve")


# --------------------------------------------------------------------------- shapes


def factorisations(world: int, max_dims: int = DEFAULT_MAX_DIMS) -> list[tuple[int, ...]]:
    """Every ordered factorisation of ``world`` into 1 .. ``max_dims`` factors > 1, by
    number of factors, then lexicographically (``8`` -> ``(8,), (2, 4), (4, 2),
    (2, 2, 2)``).

    Raises:
        ConfigError: ``world`` < 2 or ``max_dims`` outside 1 .. :data:`MAX_DIMS_ALLOWED`.
    """
    check_world(world)
    check_max_dims(max_dims)
    out: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...], rest: int, k: int) -> None:
        if k == 1:
            out.append((*prefix, rest))
            return
        for d in range(2, rest // 2 + 1):  # leave a factor >= 2 for the other dims
            if rest % d == 0:
                extend((*prefix, d), rest // d, k - 1)

    for k in range(1, max_dims + 1):
        extend((), world, k)
    return out


def check_world(world: Any) -> int:
    """``world`` as an int >= 2, else ConfigError naming it."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ConfigError(f"world={world}: allowed an integer >= 2 (the number of devices "
                          "to factor into mesh dims)")
    return world


def check_max_dims(max_dims: Any) -> int:
    """``max_dims`` as an int in 1 .. :data:`MAX_DIMS_ALLOWED`, else ConfigError."""
    if (isinstance(max_dims, bool) or not isinstance(max_dims, int)
            or not 1 <= max_dims <= MAX_DIMS_ALLOWED):
        raise ConfigError(f"max_dims={max_dims}: allowed an integer from 1 to "
                          f"{MAX_DIMS_ALLOWED}")
    return max_dims


def _int_value(key: str, text: Any) -> Any:
    if isinstance(text, str) and text.strip().lstrip("-").isdigit():
        return int(text)
    if isinstance(text, str):
        raise ConfigError(f"{key}={text}: allowed an integer"
                          + (" >= 2" if key == "world" else f" from 1 to {MAX_DIMS_ALLOWED}"))
    return text


@dataclass(frozen=True)
class ShapeSweep:
    """A validated sweep: the world size, the largest rank, the overrides every run
    shares and the resolved config of each shape (in :func:`factorisations` order)."""

    world: int
    max_dims: int
    overrides: tuple[str, ...]
    configs: tuple[DictConfig, ...]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(int(d) for d in c.mesh) for c in self.configs]

    @property
    def out_dir(self) -> Path:
        return sweep_dir(self.configs[0], self.world, self.max_dims)


def shape_overrides(shape: Sequence[int]) -> list[str]:
    """The overrides that set one shape: ``mesh=2x4x8 mesh_names=[dp,cp,tp]``."""
    names = SHAPE_MESH_NAMES[len(shape)]
    return [f"mesh={mesh_label(shape)}", "mesh_names=[" + ",".join(names) + "]"]


def parse_args(argv: Sequence[str]) -> tuple[int, int, list[str]]:
    """Split ``world=N``, ``max_dims=K`` from the Hydra overrides of the runs.

    Raises:
        ConfigError: a missing or bad ``world``/``max_dims``, or an override of ``mesh``
            or ``mesh_names`` (the sweep sets them).
    """
    world: Any = None
    max_dims: Any = DEFAULT_MAX_DIMS
    rest = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key == "world":
            world = _int_value(key, value)
        elif sep and key == "max_dims":
            max_dims = _int_value(key, value)
        elif sep and key.lstrip("+~") in ("mesh", "mesh_names"):
            raise ConfigError(f"{arg}: the shape sweep sets mesh and mesh_names itself; "
                              "allowed world=<devices> and max_dims=1..4")
        else:
            rest.append(arg)
    if world is None:
        raise ConfigError("world: missing; allowed world=<integer >= 2>, e.g. world=64")
    return check_world(world), check_max_dims(max_dims), rest


def prepare(world: int, max_dims: int, overrides: Sequence[str]) -> ShapeSweep:
    """Resolve (and so validate) the config of every shape, before anything runs.

    Raises:
        ConfigError: one line for the first bad value.
    """
    from pipeline.stages.runner import preflight_trace

    configs = [load_resolved([*overrides, *shape_overrides(s)])
               for s in factorisations(world, max_dims)]
    # the model is the same for every shape: check it once, on a shape whose inputs can
    # be sharded as asked (a shape that cannot is a failed row of the table, not an error
    # of the sweep)
    fit = next((c for c in configs if _inputs_fit(c)), None)
    if fit is not None:  # none fits: every shape is a failed row
        preflight_trace(fit)
    return ShapeSweep(world, max_dims, tuple(overrides), tuple(configs))


def _check_inputs(cfg: DictConfig) -> None:
    """ConfigError (one line) when the shape cannot shard the inputs as asked."""
    from pipeline.config.validate import check_input_sharding

    if cfg.get("recipe") is None:  # a recipe places the inputs itself
        check_input_sharding(cfg, list(cfg.mesh), list(cfg.mesh_names))


def _inputs_fit(cfg: DictConfig) -> bool:
    try:
        _check_inputs(cfg)
    except ConfigError:
        return False
    return True


def sweep_dir(cfg: DictConfig, world: int, max_dims: int) -> Path:
    """``<results_dir>/shapes/<model.name>-<h8>/w<world>-d<max_dims>/``, ``h8`` the hash
    of the solve-stage keys of ``cfg`` without ``mesh`` and ``mesh_names`` (the same for
    every shape of a sweep)."""
    keys = {k: v for k, v in stage_keys(cfg, "solve").items()
            if k not in ("mesh", "mesh_names")}
    return (Path(cfg.results_dir) / "shapes" / f"{cfg.model.name}-{config_hash(keys)}"
            / f"w{world}-d{max_dims}")


@dataclass(frozen=True)
class ShapesRequest:
    """What the Snakemake rule needs before any job runs: the sweep's directory and the
    arguments of ``python -m pipeline.tools.shapes``."""

    world: int
    max_dims: int
    out_dir: Path
    argv: list[str]


def shapes_request(keys: dict[str, Any], plan_cfg: DictConfig,
                   overrides: Sequence[str]) -> ShapesRequest | None:
    """The sweep of ``snakemake shapes --config world=N [max_dims=K] ...``: ``keys`` are
    the popped ``world`` / ``max_dims`` (``world`` defaults to the size of the --config
    mesh, ``plan_cfg``), ``overrides`` the run's Hydra overrides (their ``mesh`` and
    ``mesh_names`` are dropped: the sweep sets them). One config (the 1-D shape) is
    composed to name the directory. ``None`` when no world is given and the --config
    mesh has a single device (nothing to sweep).

    Raises:
        ConfigError: a bad ``world`` or ``max_dims`` (one line).
    """
    world = keys.get("world")
    if world is None:
        world = math.prod(int(d) for d in plan_cfg.mesh)
        if world < 2:
            return None
    world = check_world(_int_value("world", world))
    max_dims = check_max_dims(_int_value("max_dims", keys.get("max_dims", DEFAULT_MAX_DIMS)))
    rest = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in ("mesh", "mesh_names")]
    cfg = load_resolved([*rest, *shape_overrides((world,))])
    return ShapesRequest(world, max_dims, sweep_dir(cfg, world, max_dims),
                         [f"world={world}", f"max_dims={max_dims}", *rest])


def code_hash() -> str:
    """SHA-256 (16 hex digits) over this module, the plan picture's code (the modules
    :mod:`pipeline.stages.report.picture` imports) and the run stages' code hashes: the
    Snakemake rule's ``params.code``."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes() + b"\0")
    h.update(source_hash(("pipeline.stages.report.picture",), PROJECT_ROOT).encode() + b"\0")
    for stage in _RUN_STAGES:
        h.update(stage_code_hash(stage).encode() + b"\0")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- running


def run_shapes(sweep: ShapeSweep) -> Any:
    """Plan every shape (stages reused when current, :func:`pipeline.stages.runner.run_stage`),
    draw each run's plan picture, then the report over all runs; write the table and
    the figure. Returns the table (pandas, best first).

    A shape the planner refuses (its inputs cannot be sharded as asked, e.g. the default
    ``S(0)`` on a first dim larger than the batch, or one of
    :data:`pipeline.stages.runner.USER_ERRORS`, e.g. no plan within the memory limit) is a row with
    status ``failed`` and the one-line reason in ``error``, after every planned shape;
    the sweep goes on. A shape whose inputs cannot be sharded as asked is a row with
    status ``not applicable`` (a shape the model cannot use, not a failure: it does not
    count in the exit status). So is a shape that fails with any other error (the reason then
    starts with the error's type, and its traceback is logged): the other shapes still
    run and the sweep ends with a summary and exit status 1 (:func:`main`).
    """
    from pipeline.config.pipeline_stage import pipeline_degree, stage_config
    from pipeline.stages.report.picture import drawable, ensure_plan_picture
    from pipeline.stages.runner import USER_ERRORS, run_stage

    failed: dict[tuple[int, ...], str] = {}
    inapplicable: set[tuple[int, ...]] = set()
    for i, cfg in enumerate(sweep.configs, 1):
        dirs = stage_dirs(cfg)
        shape = tuple(int(d) for d in cfg.mesh)
        log.info("shape %d/%d: %s (%s)", i, len(sweep.configs), mesh_label(shape),
                 ",".join(cfg.mesh_names))
        try:
            _check_inputs(cfg)
        except ConfigError as err:
            failed[shape] = one_line(err)
            inapplicable.add(shape)
            log.info("shape %s: not applicable: %s", mesh_label(shape), failed[shape])
            continue
        try:
            # a pp dim: the stage solve on the sub-mesh, then the pipelined solve
            sub = stage_config(cfg) if pipeline_degree(cfg) > 1 else None
            for stage in _RUN_STAGES:
                if sub is not None:
                    run_stage(stage, sub, stage_dirs(sub))
                if sub is None or stage == "solve":
                    run_stage(stage, cfg, dirs)
        except (*USER_ERRORS, ConfigError) as err:
            failed[shape] = one_line(err)
            log.warning("shape %s: not planned: %s", mesh_label(shape), failed[shape])
            continue
        except Exception as err:  # recorded, logged with its traceback; exit status 1
            failed[shape] = one_line(err, with_type=True)
            log.exception("shape %s: failed: %s", mesh_label(shape), failed[shape])
            continue
        if drawable(Path(dirs.solve)):  # a pipelined run's picture is its stage solve's
            ensure_plan_picture(dirs.solve)
    run_stage("report", sweep.configs[0], stage_dirs(sweep.configs[0]))
    table = shape_table([stage_dirs(c).solve for c in sweep.configs
                         if tuple(int(d) for d in c.mesh) not in failed], failed, inapplicable,
                        float(sweep.configs[0].costs.step_time_uncertainty))
    write_outputs(table, sweep)
    return table


def shape_table(solve_dirs: Sequence[Path],
                failed: dict[tuple[int, ...], str] | None = None,
                inapplicable: set[tuple[int, ...]] = frozenset(),
                uncertainty: float = 0.0) -> Any:
    """One row per run (its ``run.json``), fastest simulated step first (ties: fewer
    dims, then the mesh label; runs without a step time after them, best objective
    first), then one row per shape in ``failed`` (status ``failed``, the reason in
    ``error``; ``not applicable`` for a shape in ``inapplicable``). ``rank`` from 1:
    runs whose step times are within ``uncertainty`` (relative, ``costs.step_time_uncertainty``)
    of the fastest of their class share its rank and are marked ``tie``
    (pipeline/core/ranking.py); the others are ranked by position. ``step_time_us``,
    ``step_time_gap`` and ``tie`` are columns only when some run record has a step time,
    ``peak_bytes`` and ``fits`` only when some run record has them, ``error`` only when a
    shape failed."""
    import pandas as pd

    from pipeline.core.ranking import tie_ranks

    rows = []
    for d in solve_dirs:
        rec = json.loads((Path(d) / "run.json").read_text())
        mesh = [int(x) for x in str(rec["mesh"]).split("x")]
        rows.append({
            "mesh": rec["mesh"], "mesh_names": ",".join(rec["mesh_names"]),
            "dims": len(mesh), "objective": float(rec["objective"]),
            "step_time_us": _float_or_none(rec.get("step_time_us")),
            "step_time_gap": _float_or_none(rec.get("step_time_gap")), "tie": None,
            "compute_us": _float_or_none(rec.get("compute_us")),
            "comm_us": _float_or_none(rec.get("comm_us")),
            "transition_us": _float_or_none(rec.get("transition_us")),
            "peak_bytes": _float_or_none((rec.get("memory") or {}).get("peak_bytes")),
            "fits": rec.get("fits"),
            **_pipeline_cells(rec.get("pipeline")),
            "status": rec.get("status"), "gap": _float_or_none(rec.get("gap")),
            "placement_hash": rec.get("placement_hash"), "run_id": rec.get("run_id"),
            "solve_dir": str(d), "error": None})
    rows.sort(key=lambda r: (0, r["step_time_us"], r["dims"], r["mesh"])
              if r["step_time_us"] is not None else (1, r["objective"], r["dims"], r["mesh"]))
    for shape, reason in sorted((failed or {}).items(), key=lambda kv: (len(kv[0]), kv[0])):
        names = ",".join(SHAPE_MESH_NAMES[len(shape)])
        rows.append({"mesh": mesh_label(shape), "mesh_names": names,
                     "dims": len(shape), "objective": math.nan, "step_time_us": None,
                     "step_time_gap": None, "tie": None,
                     "compute_us": None, "comm_us": None, "transition_us": None,
                     "peak_bytes": None, "fits": None, **_pipeline_cells(None),
                     "status": NOT_APPLICABLE if shape in inapplicable else "failed",
                     "gap": None, "placement_hash": None, "run_id": None,
                     "solve_dir": None, "error": reason})
    timed = [r for r in rows if r["step_time_us"] is not None]
    for r, (rank, tie) in zip(timed, tie_ranks([r["step_time_us"] for r in timed],
                                                uncertainty)):
        r["rank"], r["tie"] = rank, tie
    for i, r in enumerate(rows[len(timed):], len(timed) + 1):
        r["rank"] = i
    optional = {"step_time_us": "step_time_us", "step_time_gap": "step_time_us",
                "tie": "step_time_us", "peak_bytes": "peak_bytes", "fits": "fits",
                "error": "error", **{c: "schedule" for c in PIPELINE_COLUMNS}}
    cols = [c for c in (*COLUMNS, "error")
            if c not in optional or any(r[optional[c]] is not None for r in rows)]
    return pd.DataFrame(rows, columns=cols)


def _pipeline_cells(section: dict[str, Any] | None) -> dict[str, Any]:
    """The pipeline columns of a run (``pp`` 1 and the rest empty without a pipeline)."""
    if not section:
        return {"pp": 1, "microbatches": None, "schedule": None, "virtual_stages": None,
                "bubble_fraction": None}
    return {"pp": int(section["degree"]), "microbatches": int(section["microbatches"]),
            "schedule": str(section["schedule"]),
            "virtual_stages": int(section["virtual_stages"]),
            "bubble_fraction": float(section["bubble_fraction"])}


def _float_or_none(v: Any) -> float | None:
    return None if v is None else float(v)


def markdown_table(table: Any) -> str:
    """The table as GitHub markdown (µs with thousands separators, 3 decimals)."""
    shown = [c for c in table.columns if c not in ("solve_dir", "placement_hash")]
    table = table.astype(object).where(table.notna(), None)
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for _, row in table.iterrows():
        cells = []
        for c in shown:
            v = row[c]
            if c.endswith("_us") or c == "objective":
                cells.append("" if v is None or (isinstance(v, float) and math.isnan(v))
                             else f"{v:,.3f}")
            elif c == "peak_bytes":
                cells.append("" if v is None or math.isnan(v) else f"{v / 2**30:,.2f} GiB")
            elif c in ("gap", "step_time_gap", "bubble_fraction"):
                cells.append("" if v is None or math.isnan(v) else f"{v:.4f}")
            elif c in ("pp", "microbatches", "virtual_stages") and v is not None:
                cells.append(str(int(v)))
            elif c == "tie":
                cells.append("tie" if v is True else "")
            elif v is None:
                cells.append("")
            else:
                cells.append(str(v).replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(table: Any, sweep: ShapeSweep) -> list[Path]:
    """Write :data:`OUTPUT_FILES` atomically into the sweep's directory; their paths."""
    import pyarrow as pa

    from pipeline.core import runtime

    out = sweep.out_dir
    out.mkdir(parents=True, exist_ok=True)
    meta = {"world": sweep.world, "max_dims": sweep.max_dims,
            "overrides": list(sweep.overrides), "git": runtime.git_revision()}
    runtime.write_parquet(out / "shapes.parquet",
                          pa.Table.from_pandas(table, preserve_index=False), metadata=meta)
    with runtime.atomic_path(out / "shapes.csv") as tmp:
        table.to_csv(tmp, index=False)
    title = (f"# Mesh shapes of {sweep.world} devices ({sweep.configs[0].model.name}, "
             f"1 to {sweep.max_dims} dims, fastest simulated step first; `tie`: within "
             f"{sweep.configs[0].costs.step_time_uncertainty:.0%} of the fastest of its "
             "rank, costs.step_time_uncertainty, not measured)\n\n")
    with runtime.atomic_path(out / "shapes.md") as tmp:
        Path(tmp).write_text(title + markdown_table(table))
    plot_shapes(table, out / "shapes.png",
                f"{sweep.configs[0].model.name}: mesh shapes of {sweep.world} devices")
    return [out / f for f in OUTPUT_FILES]


def plot_shapes(table: Any, path: Path, title: str) -> None:
    """Horizontal bars of the objective per shape, best at the top; beside them the
    step time when the table has ``step_time_us``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeline.core import runtime

    panels = ["objective"] + (["step_time_us"] if "step_time_us" in table.columns
                              and table["step_time_us"].notna().any() else [])
    n = len(table)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 1.2 + 0.32 * n),
                             squeeze=False)
    labels = [f"{m}  ({names})" for m, names in zip(table["mesh"], table["mesh_names"],
                                                     strict=True)]
    colors = {1: "#4C72B0", 2: "#55A868", 3: "#C44E52", 4: "#8172B2"}
    for ax, col in zip(axes[0], panels, strict=True):
        values = table[col].astype(float).to_numpy()
        y = range(n)
        ax.barh(list(y), values, color=[colors[int(d)] for d in table["dims"]])
        ax.set_yticks(list(y), labels if col == panels[0] else [""] * n, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("objective (µs, cost model)" if col == "objective"
                      else "step time (µs)")
        for yi, v in zip(y, values, strict=True):
            ax.text(0 if math.isnan(v) else v, yi,
                    " not planned (see the table's error)" if math.isnan(v) else f" {v:,.0f}",
                    va="center", fontsize=7)
        ax.margins(x=0.15)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[d]) for d in sorted(set(table["dims"]))]
    axes[0][0].legend(handles, [f"{d}-D" for d in sorted(set(table["dims"]))], fontsize=7,
                      loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with runtime.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pipeline.tools.shapes``; returns the exit code (2: bad input,
    one line, nothing written; 1: some shape failed, the table and the summary on stderr
    say which and why; 0: every shape planned)."""
    from pipeline.stages.runner import USER_ERRORS, configure_logging

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print("usage: python -m pipeline.tools.shapes world=<devices> [max_dims=1..4] "
              "[hydra overrides...]")
        return 0
    try:
        world, max_dims, overrides = parse_args(args)
        sweep = prepare(world, max_dims, overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    configure_logging()
    try:
        table = run_shapes(sweep)
    except USER_ERRORS as err:
        print(str(err).splitlines()[0] if str(err) else type(err).__name__, file=sys.stderr)
        return 2
    planned = table[~table["status"].isin(["failed", NOT_APPLICABLE])]
    best = (f"best {planned.iloc[0]['mesh']} ({planned.iloc[0]['objective']:,.3f} µs)"
            if len(planned) else "none planned")
    print(f"shapes: {len(table)} shapes, {len(table) - len(planned)} not planned, {best} "
          f"-> {sweep.out_dir}")
    lines = summary_lines(*sweep_outcomes(sweep, table), what="shapes")
    if not len(planned):  # not one shape planned, even if none failed: not a result
        lines.append(f"shapes: none of the {len(table)} shapes planned")
    for line in lines:
        print(line, file=sys.stderr)
    return 0 if len(lines) == 1 else 1


def sweep_outcomes(sweep: ShapeSweep, table: Any) -> tuple[list[str], dict[int, PointOutcome]]:
    """The shapes of the sweep as points (their ``mesh``/``mesh_names`` overrides, in the
    sweep's order, shapes that are not applicable left out) and how each ended, from the
    table's ``status`` and ``error``."""
    errors = {str(m): (str(e) if s == "failed" else None)
              for m, s, e in zip(table["mesh"], table["status"],
                                 table["error"] if "error" in table.columns
                                 else [None] * len(table), strict=True)
              if s != NOT_APPLICABLE}
    skipped = {str(m) for m, s in zip(table["mesh"], table["status"], strict=True)
               if s == NOT_APPLICABLE}
    points, outcomes = [], {}
    for cfg in sweep.configs:  # a shape that is not applicable is not a point
        shape = tuple(int(d) for d in cfg.mesh)
        if mesh_label(shape) in skipped:
            continue
        points.append(" ".join(shape_overrides(shape)))
        if mesh_label(shape) in errors:
            outcomes[len(points) - 1] = PointOutcome(points[-1], errors[mesh_label(shape)])
    return points, outcomes


if __name__ == "__main__":
    sys.exit(main())
