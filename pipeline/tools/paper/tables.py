"""The runs table (``runs.parquet``: :func:`read_runs`, :func:`select_runs`) and the
eager-vs-lazy table built from it (:func:`eager_vs_lazy_table`, :func:`table_markdown`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.tools.paper.experiment import PaperError, run_key

#: Phases of a search, in order (the phase names of :data:`pipeline.stages.runner.PHASES`).
SEARCH_PHASES: tuple[str, ...] = ("trace", "topology", "cost_build", "factor_build", "solve")

#: Columns of the eager-vs-lazy table: (Parquet column, Markdown header, unit, source).
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("optimizer_init_s", "Optimizer init", "s"),
    ("factor_build_s", "Factor build", "s"),
    ("trws_solve_s", "TRW-S solve", "s"),
    ("search_total_s", "Search total", "s"),
    ("peak_rss_mib", "Peak RSS", "MiB"),
)

MIB = 2**20

#: What the Peak RSS numbers are (the run record's ``peak_rss_bytes.max``).
RSS_NOTE = ("peak RSS of the process that wrote the run record "
            "(under Snakemake: the solve stage alone)")


# --------------------------------------------------------------------------- the runs table


def read_runs(path: str | Path) -> Any:
    """``runs.parquet`` as a pandas DataFrame with a ``run_key`` column."""
    import pandas as pd

    df = pd.read_parquet(path)
    if df.empty:
        return df.assign(run_key=pd.Series(dtype=str))
    return df.assign(run_key=[run_key(d) for d in df["solve_dir"]])


def select_runs(runs: Any, keys: Sequence[str], what: str) -> Any:
    """The rows of ``runs`` for ``keys`` (in that order).

    Raises:
        PaperError: a key has no row (the run is not in runs.parquet).
    """
    by_key = {k: i for i, k in enumerate(runs["run_key"])} if len(runs) else {}
    absent = [k for k in keys if k not in by_key]
    if absent:
        raise PaperError(f"{what}: {len(absent)} run(s) not in runs.parquet, e.g. "
                         f"runs/{absent[0]}; run them first (python -m pipeline.tools.paper "
                         "without --no-run, or snakemake paper)")
    keys = list(dict.fromkeys(keys))
    return runs.iloc[[by_key[k] for k in keys]].reset_index(drop=True)


def row_config(row: Any) -> dict[str, Any]:
    """The resolved config of a runs-table row (its ``config_json``); ``{}`` without one."""
    text = row.get("config_json") if hasattr(row, "get") else None
    return json.loads(text) if isinstance(text, str) and text else {}


def row_value(row: Any, key: str) -> Any:
    """A column of a runs-table row; ``None`` when absent, null or NaN (pandas fills the
    cells of a column some records lack with NaN)."""
    value = row.get(key) if hasattr(row, "get") else None
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def row_layers(row: Any, cfg: dict[str, Any]) -> int | None:
    """Depth of a run's model: the repeated blocks the trace found (``model_info.layers``
    of the run record, any model family), else the LLaMA config's ``n_layers``."""
    value = row_value(row, "model_info.layers")
    if value is None:
        value = cfg.get("model", {}).get("n_layers")
    return None if value is None else int(value)


def row_width(row: Any, cfg: dict[str, Any]) -> int | None:
    """Width (hidden size) of a run's model: ``model_info.width``, else LLaMA's ``dim``."""
    value = row_value(row, "model_info.width")
    if value is None:
        value = cfg.get("model", {}).get("dim")
    return None if value is None else int(value)


def row_float(row: Any, col: str) -> float:
    """A column of a runs-table row as a float; NaN when absent or not a number."""
    value = row.get(col) if hasattr(row, "get") else None
    if value is None:
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def mesh_order(mesh: str) -> tuple[int, int, str]:
    """Sort key of a mesh label (``2x4``): device count, then rank, then the label."""
    dims = [int(d) for d in str(mesh).split("x")]
    return (math.prod(dims), len(dims), str(mesh))


# --------------------------------------------------------------------------- eager vs lazy


def eager_vs_lazy_table(runs: Any) -> Any:
    """The eager-vs-lazy table from exactly one eager and one lazy run.

    Rows ``eager``, ``lazy``, ``delta`` (lazy - eager, seconds / MiB) and ``delta_pct``
    (100 * (lazy - eager) / eager; NaN when the eager value is 0). Columns
    :data:`TABLE_COLUMNS`: ``optimizer_init_s`` = phases.topology + phases.cost_build,
    ``factor_build_s`` = phases.factor_build, ``trws_solve_s`` = phases.solve,
    ``search_total_s`` = phases.search_total, ``peak_rss_mib`` = peak_rss_bytes.max / 2^20;
    plus ``run_id`` of the eager and lazy rows.

    Raises:
        PaperError: not exactly one eager and one lazy run.
    """
    import pandas as pd

    rows = {}
    for mode in ("eager", "lazy"):
        sel = runs[runs["cost_mode"] == mode]
        if len(sel) != 1:
            raise PaperError(f"eager-vs-lazy table: need one {mode} run, got {len(sel)}")
        row = sel.iloc[0]
        rows[mode] = {
            "optimizer_init_s": (row_float(row, "phases.topology")
                                 + row_float(row, "phases.cost_build")),
            "factor_build_s": row_float(row, "phases.factor_build"),
            "trws_solve_s": row_float(row, "phases.solve"),
            "search_total_s": row_float(row, "phases.search_total"),
            "peak_rss_mib": row_float(row, "peak_rss_bytes.max") / MIB,
            "run_id": str(row.get("run_id")),
        }
    cols = [c for c, _, _ in TABLE_COLUMNS]
    delta = {c: rows["lazy"][c] - rows["eager"][c] for c in cols}
    pct = {c: (100.0 * delta[c] / rows["eager"][c] if rows["eager"][c] else float("nan"))
           for c in cols}
    table = pd.DataFrame([
        {"mode": "eager", **rows["eager"]},
        {"mode": "lazy", **rows["lazy"]},
        {"mode": "delta", **delta, "run_id": None},
        {"mode": "delta_pct", **pct, "run_id": None},
    ], columns=["mode", *cols, "run_id"])
    return table


def _fmt_delta(value: float, pct: float, unit: str, digits: int) -> str:
    sign = "+" if value > 0 else ("−" if value < 0 else "±")
    text = f"{sign}{abs(value):.{digits}f} {unit}"
    if math.isfinite(pct):
        psign = "+" if pct > 0 else ("−" if pct < 0 else "±")
        text += f" ({psign}{abs(pct):.1f} %)"
    else:
        text += " (n/a)"
    return text


def table_markdown(table: Any, title: str, footer: str) -> str:
    """The table as GitHub Markdown: eager and lazy rows, then ``Δ lazy − eager`` with
    seconds (MiB) and percent of eager."""
    by_mode = {r["mode"]: r for r in table.to_dict("records")}
    head = ["Mode"] + [f"{h} ({u})" for _, h, u in TABLE_COLUMNS]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |",
             "| --- |" + " ---: |" * len(TABLE_COLUMNS)]
    for mode in ("eager", "lazy"):
        r = by_mode[mode]
        cells = [f"{r[c]:.0f}" if u == "MiB" else f"{r[c]:.2f}" for c, _, u in TABLE_COLUMNS]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    d, p = by_mode["delta"], by_mode["delta_pct"]
    cells = [_fmt_delta(d[c], p[c], u, 0 if u == "MiB" else 2) for c, _, u in TABLE_COLUMNS]
    lines.append("| Δ lazy − eager | " + " | ".join(cells) + " |")
    lines += ["", footer, ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plans


#: Columns of the plans table: (column, Markdown header, unit).
PLAN_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("rank", "Rank by step time", "text"),
    ("step_time_us", "Step time (overlapped)", "µs"),
    ("step_time_gap", "Step-time gap", ""),
    ("objective", "Objective (additive)", "µs"),
    ("exposed_comm_us", "Exposed comm", "µs"),
    ("tokens_per_s_per_device", "Tokens/s/device", ""),
    ("objective_ratio", "Objective / planner", ""),
    ("step_time_ratio", "Step time / planner", ""),
)

#: Config keys two runs share when they are priced by the same cost model.
COST_MODEL_KEYS: tuple[str, ...] = ("model", "mesh", "mesh_names", "hardware", "optimizer",
                                    "memory", "fsdp")


def _plan_name(row: Any) -> str:
    recipe = row_value(row, "recipe")
    return "planner" if recipe is None else str(recipe)


def plans_table(runs: Any, uncertainty: float = 0.0) -> Any:
    """Every run's plan: the overlap-aware step time (pipeline/costmodel/steptime.py:
    ``step_time_us``, its certified ``step_time_gap``, ``exposed_comm_us``,
    ``tokens_per_s_per_device``) beside the additive objective, and for a recipe run
    (config ``recipe``) the ratios to the planner's run of the same cost model
    (:data:`COST_MODEL_KEYS`; the one with the same ``constraints`` when there is one,
    else the first). Rows: the runs of one cost model together (in order of first
    appearance in ``runs``), fastest step first; ``rank`` within them by step time, a
    rank shared by the plans within ``uncertainty`` (``costs.step_time_uncertainty``,
    relative) of the fastest of their class and marked ``(tie)``
    (pipeline/core/ranking.py); ``n/a`` without a step time. Columns ``run_id``,
    ``model``, ``mesh``, ``hardware``, ``solver``, ``plan`` (``planner`` or the
    recipe), :data:`PLAN_COLUMNS` and ``planner_run_id``; NaN where a run has no step
    time (a record from before it)."""
    import pandas as pd

    from pipeline.core.ranking import tie_ranks

    keyed = []
    for _, row in runs.iterrows():
        cfg = row_config(row)
        key = json.dumps({k: cfg.get(k) for k in COST_MODEL_KEYS}, sort_keys=True)
        keyed.append((row, key, json.dumps(cfg.get("constraints"), sort_keys=True)))
    planners: dict[str, list[tuple[Any, str]]] = {}
    for row, key, cons in keyed:
        if _plan_name(row) == "planner":
            planners.setdefault(key, []).append((row, cons))
    out = []
    for row, key, cons in keyed:
        name = _plan_name(row)
        ref = None
        if name != "planner" and planners.get(key):
            same = [p for p, c in planners[key] if c == cons]
            ref = same[0] if same else planners[key][0][0]
        elif name == "planner":
            ref = row
        entry = {"key": key, "run_id": str(row.get("run_id")), "model": row.get("model"),
                 "mesh": row.get("mesh"), "hardware": row.get("hardware"),
                 "solver": row.get("solver"), "plan": name,
                 "objective": row_float(row, "objective"),
                 "step_time_us": row_float(row, "step_time_us"),
                 "step_time_gap": row_float(row, "step_time_gap"),
                 "exposed_comm_us": row_float(row, "exposed_comm_us"),
                 "tokens_per_s_per_device": row_float(row, "tokens_per_s_per_device"),
                 "planner_run_id": None if ref is None else str(ref.get("run_id"))}
        for col, base in (("objective_ratio", "objective"), ("step_time_ratio", "step_time_us")):
            denom = float("nan") if ref is None else row_float(ref, base)
            entry[col] = entry[base] / denom if denom and math.isfinite(denom) else float("nan")
        out.append(entry)
    groups: dict[str, list[dict[str, Any]]] = {}
    for entry in out:
        groups.setdefault(entry.pop("key"), []).append(entry)
    out = []
    for entries in groups.values():
        entries.sort(key=lambda e: (math.isnan(e["step_time_us"]),
                                    0.0 if math.isnan(e["step_time_us"]) else e["step_time_us"]))
        for e, (rank, tie) in zip(entries, tie_ranks([e["step_time_us"] for e in entries],
                                                     uncertainty)):
            e["rank"] = "n/a" if rank is None else f"{rank}{' (tie)' if tie else ''}"
        out.extend(entries)
    cols = ["run_id", "model", "mesh", "hardware", "solver", "plan",
            *[c for c, _, _ in PLAN_COLUMNS], "planner_run_id"]
    return pd.DataFrame(out, columns=cols)


def _cell(value: Any, unit: str) -> str:
    if unit == "text":
        return str(value)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if unit == "µs":
        return f"{value:,.1f}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3f}"


def plans_markdown(table: Any, title: str, footer: str) -> str:
    """The plans table as GitHub Markdown, one line per run (model, mesh, plan, then
    :data:`PLAN_COLUMNS`)."""
    return _per_plan_markdown(table, PLAN_COLUMNS, _cell, title, footer)


def _per_plan_markdown(table: Any, columns: Sequence[tuple[str, str, str]], cell: Any,
                       title: str, footer: str) -> str:
    """GitHub Markdown of a table with one line per plan: model, mesh, plan, then
    ``columns`` ((column, header, unit) each, a cell written by ``cell(value, unit)``),
    the title above and the footer below."""
    head = ["Model", "Mesh", "Plan"] + [f"{h} ({u})" if u and u != "text" else h
                                        for _, h, u in columns]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |",
             "| --- | --- | --- |" + " ---: |" * len(columns)]
    for r in table.to_dict("records"):
        cells = [cell(r[c], u) for c, _, u in columns]
        lines.append(f"| {r['model']} | {r['mesh']} | {r['plan']} | " + " | ".join(cells) + " |")
    lines += ["", footer, ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- scale

#: Columns of the scale table: (column, Markdown header, unit).
SCALE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("devices", "GPUs", ""),
    ("step_time_us", "Step time (overlapped)", "ms"),
    ("tokens_per_s_per_device", "Tokens/s/GPU", ""),
    ("peak_gib", "Peak memory/GPU", "GiB"),
    ("device_gib", "Device memory", "GiB"),
    ("fits", "Fits", ""),
    ("objective", "Objective (additive)", "ms"),
)


def scale_table(runs: Any) -> Any:
    """The scale run set as one line per run: model, mesh and GPUs, the plan
    (``planner`` or the recipe), the overlap-aware step time, tokens/s per GPU, the
    memory model's peak bytes per device against the hardware's device memory
    (``memory.peak_bytes``, ``hardware.device_memory_bytes``) and the additive
    objective; sorted by GPU count, then model, the planner first."""
    import pandas as pd

    out = []
    for _, row in runs.iterrows():
        cfg = row_config(row)
        mesh = str(row.get("mesh"))
        peak = row_float(row, "memory.peak_bytes")
        device = float((cfg.get("hardware") or {}).get("device_memory_bytes") or "nan")
        out.append({
            "run_id": str(row.get("run_id")), "model": row.get("model"), "mesh": mesh,
            "devices": math.prod(int(d) for d in mesh.split("x")), "plan": _plan_name(row),
            "step_time_us": row_float(row, "step_time_us"),
            "tokens_per_s_per_device": row_float(row, "tokens_per_s_per_device"),
            "peak_gib": peak / 2**30, "device_gib": device / 2**30,
            "fits": bool(peak <= device) if math.isfinite(peak) and math.isfinite(device)
            else None,
            "objective": row_float(row, "objective")})
    cols = ["run_id", "model", "mesh", "plan", *[c for c, _, _ in SCALE_COLUMNS]]
    table = pd.DataFrame(out, columns=cols)
    if len(table):
        order = sorted(range(len(table)), key=lambda i: (
            mesh_order(table.iloc[i]["mesh"]), str(table.iloc[i]["model"]),
            table.iloc[i]["plan"] != "planner", str(table.iloc[i]["plan"])))
        table = table.iloc[order].reset_index(drop=True)
    return table


def _scale_cell(value: Any, unit: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if unit == "ms":
        return f"{value / 1000:,.1f}"
    if unit == "GiB":
        return f"{value:,.1f}"
    return f"{value:,.0f}"


def scale_markdown(table: Any, title: str, footer: str) -> str:
    """The scale table as GitHub Markdown (model, mesh, plan, then
    :data:`SCALE_COLUMNS`)."""
    return _per_plan_markdown(table, SCALE_COLUMNS, _scale_cell, title, footer)
