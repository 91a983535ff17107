"""The paper's figures (matplotlib, Agg), one PNG each with its provenance in the PNG
metadata, in a JSON sidecar and, naming the configs, in a footer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipeline.tools.paper.provenance import describe_runs, write_sidecar
from pipeline.tools.paper.tables import (
    MIB,
    RSS_NOTE,
    SEARCH_PHASES,
    mesh_order,
    row_config,
    row_float,
    row_layers,
    row_value,
)

_PHASE_COLORS = {"trace": "#4C72B0", "topology": "#55A868", "cost_build": "#C44E52",
                 "factor_build": "#8172B2", "solve": "#CCB974"}
_MODE_COLORS = {"eager": "#C44E52", "lazy": "#4C72B0"}
_SOLVER_COLORS = {"approx": "#4C72B0", "ilp": "#55A868", "lp": "#8172B2"}


def _figure(width: float = 8.0, height: float = 4.8, ncols: int = 1) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False)
    return fig, axes[0]


def _save(fig: Any, path: Path, runs: Any, prov: dict[str, Any]) -> None:
    """Footer naming the configs, then write the PNG atomically (provenance in its
    metadata too) and the JSON sidecar."""
    import matplotlib.pyplot as plt

    from pipeline.core import runtime

    fig.text(0.01, 0.01, describe_runs(runs), fontsize=7, color="#444444",
             ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    meta = {"Title": prov["artifact"], "Software": "pipeline.tools.paper",
            "Description": json.dumps({k: prov[k] for k in
                                       ("experiment", "run_ids", "config_hashes",
                                        "git_revisions")}, sort_keys=True)}
    with runtime.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=150, metadata=meta)
    plt.close(fig)
    write_sidecar(path, prov)


def _sorted_runs(runs: Any) -> Any:
    order = sorted(range(len(runs)), key=lambda i: (
        mesh_order(runs.iloc[i]["mesh"]), str(runs.iloc[i].get("cost_mode")),
        str(runs.iloc[i].get("solver"))))
    return runs.iloc[order].reset_index(drop=True)


def plot_phases(runs: Any, path: Path, prov: dict[str, Any]) -> None:
    """Stacked bars of the search phases, eager and lazy side by side per mesh."""
    runs = _sorted_runs(runs)
    fig, (ax,) = _figure()
    x, labels, bottoms = [], [], []
    pos = 0.0
    last_mesh = None
    for _, row in runs.iterrows():
        if last_mesh is not None and row["mesh"] != last_mesh:
            pos += 0.6
        x.append(pos)
        labels.append(f"{row['mesh']}\n{row['cost_mode']}")
        bottoms.append(0.0)
        last_mesh = row["mesh"]
        pos += 1.0
    for phase in SEARCH_PHASES:
        vals = [max(row_float(r, f"phases.{phase}"), 0.0)
                if math.isfinite(row_float(r, f"phases.{phase}")) else 0.0
                for _, r in runs.iterrows()]
        ax.bar(x, vals, bottom=bottoms, width=0.8, label=phase, color=_PHASE_COLORS[phase],
               edgecolor="white", linewidth=0.5)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for xi, top in zip(x, bottoms):
        ax.annotate(f"{top:.1f}", (xi, top), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, labels)
    ax.set_xlabel("mesh and cost mode")
    ax.set_ylabel("time (s)")
    ax.set_title("Search time by phase: eager vs lazy costs")
    ax.set_ylim(0, max(bottoms + [1e-9]) * 1.15)
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], title="phase", fontsize=8, title_fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path, runs, prov)


def plot_peak_rss(runs: Any, path: Path, prov: dict[str, Any]) -> None:
    """Peak RSS (MiB) per mesh, eager and lazy bars side by side."""
    runs = _sorted_runs(runs)
    meshes = sorted(dict.fromkeys(runs["mesh"].tolist()), key=mesh_order)
    fig, (ax,) = _figure()
    width = 0.38
    top = 0.0
    for j, mode in enumerate(("eager", "lazy")):
        vals = []
        for mesh in meshes:
            sel = runs[(runs["mesh"] == mesh) & (runs["cost_mode"] == mode)]
            vals.append(row_float(sel.iloc[0], "peak_rss_bytes.max") / MIB if len(sel)
                        else float("nan"))
        xs = [i + (j - 0.5) * width for i in range(len(meshes))]
        bars = ax.bar(xs, vals, width=width, label=mode, color=_MODE_COLORS[mode])
        ax.bar_label(bars, labels=["" if not math.isfinite(v) else f"{v:.0f}" for v in vals],
                     fontsize=8, padding=2)
        top = max([top] + [v for v in vals if math.isfinite(v)])
    ax.set_xticks(range(len(meshes)), meshes)
    ax.set_xlabel("mesh")
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title("Peak resident memory: eager vs lazy costs\n"
                 f"{RSS_NOTE}", fontsize=10)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.legend(title="costs", fontsize=8, title_fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path, runs, prov)


def plot_depth(runs: Any, path: Path, prov: dict[str, Any]) -> None:
    """Search time against the number of layers: total, trace, and the rest."""
    layers = [int(row_layers(r, row_config(r)) or 0) for _, r in runs.iterrows()]
    order = sorted(range(len(runs)), key=lambda i: layers[i])
    runs = runs.iloc[order].reset_index(drop=True)
    layers = [layers[i] for i in order]
    total = [row_float(r, "phases.search_total") for _, r in runs.iterrows()]
    trace = [row_float(r, "phases.trace") for _, r in runs.iterrows()]
    rest = [t - tr for t, tr in zip(total, trace)]
    fig, (ax,) = _figure()
    ax.plot(layers, total, "o-", color="#222222", label="search total")
    ax.plot(layers, trace, "s--", color=_PHASE_COLORS["trace"], label="trace")
    ax.plot(layers, rest, "^--", color=_PHASE_COLORS["cost_build"],
            label="topology + costs + solve")
    for xv, yv in zip(layers, total):
        ax.annotate(f"{yv:.1f}", (xv, yv), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 4), textcoords="offset points")
    ax.set_xticks(layers)
    ax.set_xlabel("number of layers (repeated blocks of the traced graph)")
    ax.set_ylabel("time (s)")
    ax.set_ylim(0, max([v for v in total if math.isfinite(v)] + [1e-9]) * 1.15)
    ax.set_title("Search time vs depth")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path, runs, prov)


def plot_solvers(runs: Any, path: Path, prov: dict[str, Any]) -> None:
    """Two panels by mesh, one bar per solver: objective (ms) and certified gap (%)."""
    runs = _sorted_runs(runs)
    meshes = sorted(dict.fromkeys(runs["mesh"].tolist()), key=mesh_order)
    known = ("approx", "ilp", "lp")
    solvers = sorted(dict.fromkeys(runs["solver"].tolist()),
                     key=lambda v: (known.index(v) if v in known else len(known), v))
    fig, (ax_obj, ax_gap) = _figure(width=10.0, ncols=2)
    width = 0.8 / max(1, len(solvers))
    gap_top = 0.0
    for j, solver in enumerate(solvers):
        objs, gaps, notes = [], [], []
        for mesh in meshes:
            sel = runs[(runs["mesh"] == mesh) & (runs["solver"] == solver)]
            if not len(sel):
                objs.append(float("nan"))
                gaps.append(float("nan"))
                notes.append("")
                continue
            r = sel.iloc[0]
            objs.append(row_float(r, "objective") / 1000.0)
            gap = 100.0 * row_float(r, "gap")
            gaps.append(max(gap, 0.0) if math.isfinite(gap) else float("nan"))
            certified = bool(row_value(r, "certified"))
            notes.append(("certified" if certified else f"{gap:.2g} %")
                         + f"\n{row_value(r, 'status') or '?'}")
        xs = [i + (j - (len(solvers) - 1) / 2) * width for i in range(len(meshes))]
        color = _SOLVER_COLORS.get(solver, None)
        bars = ax_obj.bar(xs, objs, width=width, label=solver, color=color)
        ax_obj.bar_label(bars, labels=["" if not math.isfinite(v) else f"{v:.3f}"
                                       for v in objs], fontsize=7, padding=2)
        gbars = ax_gap.bar(xs, gaps, width=width, label=solver, color=color)
        ax_gap.bar_label(gbars, labels=notes, fontsize=7, padding=2)
        gap_top = max([gap_top] + [g for g in gaps if math.isfinite(g)])
    for ax in (ax_obj, ax_gap):
        ax.set_xticks(range(len(meshes)), meshes)
        ax.set_xlabel("mesh")
        ax.grid(axis="y", alpha=0.3)
    ax_gap.legend(title="solver", fontsize=8, title_fontsize=8, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0))
    top = max([v for v in (row_float(r, "objective") for _, r in runs.iterrows())
               if math.isfinite(v)] + [1e-9]) / 1000.0
    ax_obj.set_ylim(0, top * 1.15)
    ax_obj.set_ylabel("objective: estimated step time (ms)")
    ax_obj.set_title("Objective by solver and mesh")
    ax_gap.set_ylabel("gap to lower bound (% of objective)")
    ax_gap.set_title("Certified gap by solver and mesh")
    ax_gap.set_ylim(0, max(gap_top * 1.4, 1.0))
    if gap_top < 0.01:
        ax_gap.text(0.5, 0.5, "every gap < 0.01 %: bars too small to see;\n"
                    "the labels give each gap", transform=ax_gap.transAxes,
                    ha="center", va="center", fontsize=8, color="#444444")
    _save(fig, path, runs, prov)


def plot_plans(runs: Any, path: Path, prov: dict[str, Any]) -> None:
    """Each run's plan: the additive objective beside the overlap-aware step time
    (pipeline/costmodel/steptime.py), grouped by model and mesh; recipes by name
    (pipeline/tools/paper/tables.py ``plans_table``)."""
    from pipeline.tools.paper.tables import plans_table

    table = plans_table(runs)
    order = sorted(range(len(table)), key=lambda i: (
        str(table.iloc[i]["model"]), mesh_order(table.iloc[i]["mesh"]),
        table.iloc[i]["plan"] != "planner", str(table.iloc[i]["plan"])))
    table = table.iloc[order].reset_index(drop=True)
    fig, (ax,) = _figure(width=max(8.0, 0.9 * len(table) + 2))
    xs = list(range(len(table)))
    ax.bar([x - 0.2 for x in xs], table["objective"], width=0.4, color="#C9D3E6",
           label="objective (additive)")
    ax.bar([x + 0.2 for x in xs], table["step_time_us"], width=0.4, color="#4C72B0",
           label="step time (overlapped)")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r['model']} {r['mesh']}\n{r['plan']}"
                        for r in table.to_dict("records")], fontsize=8)
    ax.set_ylabel("µs per step")
    ax.set_title("Plans: additive objective and overlapped step time")
    ax.legend(fontsize=8)
    _save(fig, path, runs, prov)


def plot_scale(runs: Any, path: Path, prov: dict[str, Any]) -> None:
    """The scale run set (pipeline/tools/paper/tables.py ``scale_table``): per model and mesh,
    the planner's plan beside each recipe: overlap-aware step time, tokens/s per GPU,
    and peak memory per GPU against the device memory (dashed); log scales, so that
    models of very different size share a panel."""
    from pipeline.tools.paper.tables import scale_table

    table = scale_table(runs)
    fig, axes = _figure(ncols=3, width=max(12.0, 0.5 * len(table) + 6), height=5.2)
    xs = list(range(len(table)))
    labels = [f"{r['model']} {r['mesh']}\n{r['plan']}" for r in table.to_dict("records")]
    colors = ["#4C72B0" if p == "planner" else "#C9D3E6" for p in table["plan"]]
    panels = ((table["step_time_us"] / 1000.0, "step time (ms)", "Step time (overlapped)"),
              (table["tokens_per_s_per_device"], "tokens/s per GPU", "Throughput"),
              (table["peak_gib"], "GiB per GPU", "Peak memory"))
    for ax, (values, ylabel, title) in zip(axes, panels, strict=True):
        ax.bar(xs, values, color=colors)
        if (values > 0).any():
            ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=6, rotation=90)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    device = table["device_gib"].dropna()
    if len(device):
        axes[2].axhline(float(device.iloc[0]), color="#C44E52", linestyle="--", linewidth=1,
                        label=f"device memory {float(device.iloc[0]):.0f} GiB")
        axes[2].legend(fontsize=7)
    _save(fig, path, runs, prov)
