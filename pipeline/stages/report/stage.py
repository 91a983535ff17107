"""Stage 5 - report: aggregate every run under ``results/runs`` into Parquet tables.

* ``results/report/runs.parquet``: one row per run record (``run.json``), nested
  fields flattened with ``.`` (``phases.solve``, ``counts.groups``, ...).
* ``results/report/placements.parquet``: one row per (run, node), the union of
  every run's ``solution.parquet``.
* ``results/report/redistributions.parquet``: one row per (run, graph edge whose
  placements differ), the union of every run's ``redistributions.parquet``: the
  src/dst placements, the collectives DTensor would run (``reduce_scatter(dp)``...),
  bytes and µs.
* ``results/report/recipes.parquet``: the planner's plan beside each recipe (config
  ``recipe``, pipeline/stages/topology/pins.py): one row per (recipe run, planner run) that
  share the model, mesh, mesh names, hardware and memory-model options (the same cost
  model), with both objectives, both overlap-aware step times (pipeline/costmodel/steptime.py),
  tokens/s per device and the ratios recipe / planner (:func:`recipe_rows`).
* ``plan.png`` / ``plan.svg`` in each run's solve directory whose picture is missing
  or older than its record (:mod:`pipeline.stages.report.picture`).

All load with pandas, polars or duckdb. Rows are sorted by run directory so
the files are deterministic for a given set of runs. File names and schema versions:
pipeline/core/artifacts.py (a run record's own version is its ``schema_version`` column;
records written before versioning have none).

A run is reported only when its record can be trusted (:func:`record_problem`): a
``run.json`` that is not a JSON object, whose objective lies below its own lower bound
(or step time below its own step-time bound), or whose ``placement_hash`` does not
match the placements in its ``solution.parquet`` (or whose tables cannot be read) is
skipped with a one-line warning naming the file; the other runs are reported as usual.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.core import artifacts, runtime
from pipeline.core.artifacts import (  # noqa: F401 - file names, re-exported
    PLACEMENTS,
    PLACEMENTS_FILE,
    REDISTRIBUTIONS,
    REPORT_REDISTRIBUTIONS,
    RUN,
    RUNS,
    RUNS_FILE,
    SOLUTION,
)

log = logging.getLogger(__name__)

#: ``redistributions.parquet`` of the report directory (the union of the runs' tables).
REDISTRIBUTIONS_FILE = REPORT_REDISTRIBUTIONS.name
#: ``recipes.parquet`` of the report directory (:func:`recipe_rows`).
RECIPES = artifacts.Artifact("recipes.parquet", "report", 1,
                             "pipeline.stages.report.stage.run_report",
                             "pipeline.tools.paper.tables.plans_table")
RECIPES_FILE = RECIPES.name
_SKIP = ("config", "bound_history", "layer_profile")
#: Config keys two runs share when they are priced by the same cost model.
_COST_MODEL_KEYS = ("model", "mesh", "mesh_names", "hardware", "optimizer", "memory", "fsdp")


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts with dotted keys; lists become JSON text."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, list):
            out[key] = json.dumps(v)
        else:
            out[key] = v
    return out


#: Relative slack of the objective-vs-bound check (a bound is never above the objective
#: it certifies, up to float rounding).
BOUND_RTOL = 1e-6


def _read_record(path: Path) -> dict[str, Any]:
    rec = json.loads(path.read_text())
    if not isinstance(rec, dict):
        raise ValueError(f"a JSON {type(rec).__name__}, not an object")
    return rec


def record_problem(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(record, None)`` for a trustworthy run record, ``(None, why)`` otherwise: the
    file does not parse as a JSON object, its objective is below its own lower bound
    or its step time below its own step-time bound (by more than :data:`BOUND_RTOL`),
    or its ``placement_hash`` differs from the hash
    of the placements in the run's ``solution.parquet`` (or that table is unreadable)."""
    from pipeline.stages.solve.stage import placement_hash

    try:
        rec = _read_record(path)
    except (OSError, ValueError) as err:
        return None, f"not a readable run record ({type(err).__name__}: " \
                     f"{str(err).splitlines()[0] if str(err) else ''})"
    obj, bound = rec.get("objective"), rec.get("lower_bound")
    if isinstance(obj, (int, float)) and isinstance(bound, (int, float)) \
            and obj < bound - BOUND_RTOL * max(1.0, abs(obj)):
        return None, f"objective={obj} is below its own lower_bound={bound}"
    step, step_bound = rec.get("step_time_us"), rec.get("step_time_lower_bound_us")
    if isinstance(step, (int, float)) and isinstance(step_bound, (int, float)) \
            and step < step_bound - BOUND_RTOL * max(1.0, abs(step)):
        return None, (f"step_time_us={step} is below its own "
                      f"step_time_lower_bound_us={step_bound}")
    solution = path.parent / SOLUTION.name
    try:
        table = runtime.read_parquet(solution, columns=["node", "name", "output_placement",
                                                 "input_placements"]).sort_by("node")
        runtime.read_parquet(path.parent / REDISTRIBUTIONS.name)
    except (OSError, pa.ArrowException) as err:
        return None, f"its tables are unreadable ({type(err).__name__}: " \
                     f"{str(err).splitlines()[0] if str(err) else ''})"
    found = placement_hash(table["name"].to_pylist(), table["output_placement"].to_pylist(),
                           table["input_placements"].to_pylist())
    if rec.get("placement_hash") != found:
        return None, (f"placement_hash={rec.get('placement_hash')} does not match "
                      f"{solution} ({found})")
    return rec, None


def trusted_runs(results_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """``(run directory, record)`` of every trustworthy ``runs/**/run.json`` (sorted by
    path); each skipped record is logged in one line naming it (:func:`record_problem`)."""
    out = []
    for path in sorted(Path(results_dir, "runs").glob(f"**/{RUN.name}")):
        rec, problem = record_problem(path)
        if problem is not None:
            log.warning("report: skipping %s: %s", path, problem)
            continue
        out.append((path.parent, rec))
    return out


def run_records(results_dir: Path) -> list[dict[str, Any]]:
    """The trustworthy ``runs/**/run.json`` records (sorted by path,
    :func:`trusted_runs`)."""
    return [rec for _, rec in trusted_runs(results_dir)]


def run_rows(results_dir: Path, records: list[dict[str, Any]] | None = None
             ) -> list[dict[str, Any]]:
    """Flattened run records of every trustworthy ``runs/**/run.json`` (sorted by path;
    ``records``: those already read by :func:`run_records`)."""
    rows = []
    for rec in run_records(results_dir) if records is None else records:
        row = flatten({k: v for k, v in rec.items() if k not in _SKIP})
        row["config_json"] = json.dumps(rec.get("config", {}), sort_keys=True)
        rows.append(row)
    return rows


def _comparison_key(record: dict[str, Any]) -> str:
    cfg = record.get("config") or {}
    return json.dumps({k: cfg.get(k) for k in _COST_MODEL_KEYS}, sort_keys=True)


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not b:
        return None
    return float(a) / float(b)


def recipe_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (recipe run, planner run) of the same cost model (module docstring),
    in run-directory order of the recipe runs, then of the planner runs: ``recipe``,
    ``model``, ``mesh``, ``mesh_names``, ``hardware``, both run ids and solvers, the
    planner's ``param_memory`` and ``device_memory`` constraints (JSON text: a recipe's
    pinned parameters are outside the parameter budget, the planner's are not),
    ``objective`` / ``step_time_us`` / ``tokens_per_s_per_device`` /
    ``step_time_gap`` of each, ``objective_ratio`` / ``step_time_ratio`` (recipe /
    planner), the ``verdict`` by step time with its ``step_time_uncertainty``
    (:func:`_verdict`), and each run's predicted peak bytes per device and whether it
    fits the device (``recipe_peak_bytes``, ``planner_peak_bytes``, ``recipe_fits``,
    ``planner_fits``: pipeline/memory/fit.py)."""
    planners: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("recipe") is None:
            planners.setdefault(_comparison_key(r), []).append(r)
    rows = []
    for r in records:
        if r.get("recipe") is None:
            continue
        for p in planners.get(_comparison_key(r), []):
            constraints = (p.get("config") or {}).get("constraints") or {}
            rows.append({
                "recipe": str(r["recipe"]), "model": r.get("model"), "mesh": r.get("mesh"),
                "mesh_names": json.dumps(r.get("mesh_names")), "hardware": r.get("hardware"),
                "recipe_run_id": r.get("run_id"), "planner_run_id": p.get("run_id"),
                "recipe_solver": r.get("solver"), "planner_solver": p.get("solver"),
                "planner_param_memory": json.dumps(constraints.get("param_memory")),
                "planner_device_memory": json.dumps(constraints.get("device_memory")),
                "recipe_objective": r.get("objective"), "planner_objective": p.get("objective"),
                "objective_ratio": _ratio(r.get("objective"), p.get("objective")),
                "recipe_step_time_us": r.get("step_time_us"),
                "planner_step_time_us": p.get("step_time_us"),
                "step_time_ratio": _ratio(r.get("step_time_us"), p.get("step_time_us")),
                "recipe_tokens_per_s_per_device": r.get("tokens_per_s_per_device"),
                "planner_tokens_per_s_per_device": p.get("tokens_per_s_per_device"),
                "recipe_peak_bytes": _peak(r), "planner_peak_bytes": _peak(p),
                "recipe_fits": r.get("fits"), "planner_fits": p.get("fits"),
                "recipe_step_time_gap": r.get("step_time_gap"),
                "planner_step_time_gap": p.get("step_time_gap"),
                **_verdict(r.get("step_time_us"), p.get("step_time_us"), p),
            })
    return rows


def _peak(record: dict[str, Any]) -> float | None:
    """The predicted peak bytes per device of a run record (``memory.peak_bytes``)."""
    peak = (record.get("memory") or {}).get("peak_bytes")
    return None if peak is None else float(peak)


_RECIPE_NUMERIC = ("objective", "step_time", "ratio", "tokens", "peak_bytes")
_RECIPE_BOOL = ("recipe_fits", "planner_fits")


def _verdict(recipe: Any, planner: Any, planner_record: dict[str, Any]) -> dict[str, Any]:
    """``verdict`` (``tie``, ``planner faster``, ``recipe faster``; null without both step
    times) and the ``step_time_uncertainty`` it used: the planner run's
    ``costs.step_time_uncertainty`` (relative; not measured, pipeline/core/ranking.py).
    A tie: the two step times within it of the faster one."""
    costs = ((planner_record.get("config") or {}).get("costs") or {})
    u = float(costs.get("step_time_uncertainty", 0.0))
    if recipe is None or planner is None:
        return {"verdict": None, "step_time_uncertainty": u}
    fast, slow = sorted((float(recipe), float(planner)))
    if slow - fast <= u * fast:
        verdict = "tie"
    else:
        verdict = "planner faster" if float(planner) < float(recipe) else "recipe faster"
    return {"verdict": verdict, "step_time_uncertainty": u}


def _recipe_table(rows: list[dict[str, Any]]) -> pa.Table:
    names = ["recipe", "model", "mesh", "mesh_names", "hardware", "recipe_run_id",
             "planner_run_id", "recipe_solver", "planner_solver", "planner_param_memory",
             "planner_device_memory", "recipe_objective", "planner_objective",
             "objective_ratio", "recipe_step_time_us", "planner_step_time_us",
             "step_time_ratio", "recipe_tokens_per_s_per_device",
             "planner_tokens_per_s_per_device", "recipe_peak_bytes", "planner_peak_bytes",
             "recipe_fits", "planner_fits", "recipe_step_time_gap",
             "planner_step_time_gap", "verdict", "step_time_uncertainty"]
    cols = {}
    for k in names:
        numeric = any(t in k for t in _RECIPE_NUMERIC)
        values = [r[k] for r in rows]
        if k in _RECIPE_BOOL:
            cols[k] = pa.array(values, pa.bool_())
            continue
        cols[k] = pa.array([None if v is None else float(v) for v in values], pa.float64()) \
            if numeric else pa.array(values, pa.string())
    return pa.table(cols)


def run_report(results_dir: Path, workers: int = 1) -> None:
    """Write ``report/runs.parquet``, ``report/placements.parquet``,
    ``report/redistributions.parquet`` and ``report/recipes.parquet`` atomically
    (``runs.parquet``, the sentinel, last) over the trustworthy runs (:func:`trusted_runs`);
    an empty results directory gives empty tables."""
    results_dir = Path(results_dir)
    out = results_dir / "report"
    trusted = trusted_runs(results_dir)
    records = [rec for _, rec in trusted]
    run_dirs = [d for d, _ in trusted]
    rows = run_rows(results_dir, records)
    keys = sorted({k for r in rows for k in r})
    cols = {k: [r.get(k) for r in rows] for k in keys}
    table = pa.table({k: _column(v) for k, v in cols.items()}) if rows else pa.table({})
    placements = _union(run_dirs, SOLUTION.name)
    redistributions = _union(run_dirs, REDISTRIBUTIONS.name)
    recipes = recipe_rows(records)
    from pipeline.stages.report.picture import draw_plan_pictures  # each run's plan.png / plan.svg

    draw_plan_pictures(results_dir, run_dirs, workers=workers)
    # the four tables replace the old ones together, or (an OS error while writing one)
    # not at all: a report directory is never half old, half new
    with runtime.atomic_group() as group:
        artifacts.write_table(PLACEMENTS, out, placements, metadata={"runs": len(rows)},
                              group=group)
        artifacts.write_table(REPORT_REDISTRIBUTIONS, out, redistributions,
                              metadata={"runs": len(rows)}, group=group)
        artifacts.write_table(RECIPES, out, _recipe_table(recipes),
                              metadata={"rows": len(recipes)}, group=group)
        artifacts.write_table(RUNS, out, table, metadata={
            "runs": len(rows), "git": runtime.git_revision()}, group=group)
    log.info("report: %d runs, %d placement rows, %d redistribution rows -> %s", len(rows),
             placements.num_rows, redistributions.num_rows, out)


def _union(run_dirs: list[Path], name: str) -> pa.Table:
    """Every run's ``name`` table, concatenated in run-directory order."""
    parts = [runtime.read_parquet(d / name).replace_schema_metadata(None)
             for d in run_dirs if (d / name).exists()]
    return pa.concat_tables(parts, promote_options="default") if parts else pa.table({})


def _column(values: list[Any]) -> pa.Array:
    kinds = {type(v) for v in values if v is not None}
    if kinds == {int, float} or kinds == {float}:
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    if len(kinds) > 1:
        return pa.array([None if v is None else json.dumps(v) for v in values], pa.string())
    return pa.array(values)
