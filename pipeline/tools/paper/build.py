"""Building the paper: every artifact of an experiment from the runs table
(:func:`build_paper`), after making the missing runs (:func:`make_paper`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.tools.paper.experiment import (
    ARTIFACTS,
    PROVENANCE_FILE,
    RUN_SETS,
    Experiment,
    ensure_runs,
    load_experiment,
    refresh_report,
)
from pipeline.tools.paper.figures import (
    plot_depth,
    plot_peak_rss,
    plot_phases,
    plot_plans,
    plot_scale,
    plot_solvers,
)
from pipeline.tools.paper.provenance import (
    describe_runs,
    file_sha256,
    provenance,
    sidecar_path,
    write_sidecar,
)
from pipeline.tools.paper.tables import (
    RSS_NOTE,
    eager_vs_lazy_table,
    plans_markdown,
    plans_table,
    read_runs,
    row_config,
    scale_markdown,
    scale_table,
    select_runs,
    table_markdown,
)

log = logging.getLogger("pipeline.tools.paper")

def build_paper(runs: Any, exp: Experiment, runs_path: Path | None = None) -> list[Path]:
    """Write every artifact of ``exp`` from the runs table ``runs``; return the paths.

    Raises:
        PaperError: a run of the experiment is not in ``runs``, or the eager-vs-lazy set
            lacks the eager or lazy run at ``table_mesh``.
    """
    from pipeline.core import runtime

    out = exp.out_dir
    source = {"runs_parquet": str(runs_path) if runs_path else None,
              "runs_parquet_sha256": file_sha256(runs_path) if runs_path else None,
              "overrides": list(exp.overrides)}
    sel = {name: select_runs(runs, [r.key for r in exp.sets[name]], f"run set {name}")
           for name in RUN_SETS}
    out.mkdir(parents=True, exist_ok=True)  # only once every run is there
    written: list[Path] = []
    provs: dict[str, dict[str, Any]] = {}

    # eager-vs-lazy table
    evl = sel["eager_vs_lazy"]
    at_mesh = evl[evl["mesh"] == exp.table_mesh].reset_index(drop=True)
    table = eager_vs_lazy_table(at_mesh)
    prov = provenance(at_mesh, "eager_vs_lazy", exp.name, source)
    provs["eager_vs_lazy"] = prov
    md_path, pq_path = (out / f for f in ARTIFACTS["eager_vs_lazy"])
    import pyarrow as pa

    runtime.write_parquet(pq_path, pa.Table.from_pandas(table, preserve_index=False),
                          metadata=prov)
    mesh_names = row_config(at_mesh.iloc[0]).get("mesh_names") or []
    title = (f"Eager vs lazy costs, mesh {exp.table_mesh}"
             + (f" ({','.join(mesh_names)})" if mesh_names else "") + ", solver "
             + ", ".join(dict.fromkeys(at_mesh["solver"].tolist())))
    footer = (f"<sub>Peak RSS: {RSS_NOTE}. Δ %: percent of eager."
              "</sub>\n\n<sub>" + describe_runs(at_mesh).replace("\n", "; ")
              + f"; config hashes {', '.join(str(h) for h in prov['config_hashes'])}"
              + f"; provenance: {sidecar_path(md_path).name}</sub>")
    with runtime.atomic_path(md_path) as tmp:
        tmp.write_text(table_markdown(table, title, footer))
    write_sidecar(md_path, prov)
    written += [md_path, pq_path]

    figures = (("fig_phases", plot_phases, evl), ("fig_peak_rss", plot_peak_rss, evl),
               ("fig_depth", plot_depth, sel["depth"]),
               ("fig_solvers", plot_solvers, sel["solvers"]))
    for name, plot, rows in figures:
        prov = provenance(rows, name, exp.name, source)
        provs[name] = prov
        path = out / ARTIFACTS[name][0]
        plot(rows, path, prov)
        written.append(path)

    written += _write_scale(sel["scale"], exp, source, provs)
    every = select_runs(runs, [r.key for r in exp.runs()], "experiment")
    written += _write_plans(every, exp, source, provs)
    summary = provenance(every, "paper", exp.name, source)
    summary["artifacts"] = {name: list(ARTIFACTS[name]) for name in ARTIFACTS}
    summary["table_mesh"] = exp.table_mesh
    summary["run_sets"] = {name: [r.key for r in exp.sets[name]] for name in RUN_SETS}
    runtime.write_json(out / PROVENANCE_FILE, summary)
    written.append(out / PROVENANCE_FILE)
    log.info("paper: %d artifacts from %d runs -> %s", len(ARTIFACTS), len(every), out)
    return written


def _write_table_and_figure(rows: Any, exp: Experiment, source: dict[str, Any],
                            provs: dict[str, dict[str, Any]], name: str, table: Any,
                            markdown: Any, footer: str, plot: Any) -> list[Path]:
    """Artifact ``name`` (``<name>.md`` and ``<name>.parquet`` of ``table``, each with its
    provenance; the Markdown from ``markdown(table, footer)``, the footer ending with the
    sidecar's name) and its figure ``fig_<name>`` (``plot(rows, path, provenance)``)."""
    import pyarrow as pa

    from pipeline.core import runtime

    prov = provenance(rows, name, exp.name, source)
    provs[name] = prov
    md_path, pq_path = (exp.out_dir / f for f in ARTIFACTS[name])
    runtime.write_parquet(pq_path, pa.Table.from_pandas(table, preserve_index=False),
                          metadata=prov)
    sep = "" if footer.endswith("<sub>") else "; "
    footer = f"{footer}{sep}provenance: {sidecar_path(md_path).name}</sub>"
    with runtime.atomic_path(md_path) as tmp:
        tmp.write_text(markdown(table, footer))
    write_sidecar(md_path, prov)
    fig_name = f"fig_{name}"
    fig_prov = provenance(rows, fig_name, exp.name, source)
    provs[fig_name] = fig_prov
    fig_path = exp.out_dir / ARTIFACTS[fig_name][0]
    plot(rows, fig_path, fig_prov)
    return [md_path, pq_path, fig_path]


def _write_scale(rows: Any, exp: Experiment, source: dict[str, Any],
                 provs: dict[str, dict[str, Any]]) -> list[Path]:
    """The scale table and figure of run set ``scale``: per model and mesh, the
    planner's plan and each recipe: overlapped step time, tokens/s per GPU, peak memory
    per GPU (pipeline/tools/paper/tables.py ``scale_table``)."""
    footer = ("<sub>Step time: one compute stream and one communication stream per mesh "
              "dim (pipeline/costmodel/steptime.py). Peak memory: the memory model's peak per GPU "
              "(pipeline/memory/); fits: at most the hardware's device memory. "
              + describe_runs(rows).replace("\n", "; "))
    return _write_table_and_figure(
        rows, exp, source, provs, "scale", scale_table(rows),
        lambda t, f: scale_markdown(t, "Scale: the planner's plan and the recipes", f),
        footer, plot_scale)


def _write_plans(every: Any, exp: Experiment, source: dict[str, Any],
                 provs: dict[str, dict[str, Any]]) -> list[Path]:
    """The plans table of every run of the experiment: objective, overlap-aware step
    time, tokens/s per device, and each recipe run's ratios to the planner's plan
    (pipeline/tools/paper/tables.py ``plans_table``)."""
    uncertainty = float(exp.cfg.costs.step_time_uncertainty)
    footer = ("<sub>Step time: one compute stream and one communication stream per mesh "
              "dim, weight all-gathers prefetched one FSDP unit ahead, gradient reductions "
              "overlapped (pipeline/costmodel/steptime.py); the plans of one cost model are "
              "ranked by it, fastest first, and plans within "
              f"{uncertainty:.0%} of the fastest of their class share its rank (tie; "
              "costs.step_time_uncertainty: not measured, a placeholder for the spread "
              "between the step-time model's variants). Step-time gap: to the certified "
              "lower bound over every plan (pipeline/solvers/step_bound.py). Objective: the "
              "additive cost the solvers minimise before the step-time search. Ratios: "
              "recipe / the planner's plan of the same cost model.</sub>\n\n<sub>")
    return _write_table_and_figure(
        every, exp, source, provs, "plans", plans_table(every, uncertainty),
        lambda t, f: plans_markdown(t, "Plans: ranked by overlapped step time", f),
        footer, plot_plans)


def make_paper(overrides: Sequence[str] = (), run_missing: bool = True) -> list[Path]:
    """Load the experiment, run what is missing (unless ``run_missing=False``), refresh
    the report and build every artifact from ``runs.parquet``."""
    exp = load_experiment(overrides)
    if run_missing:
        ensure_runs(exp)
    runs_path = refresh_report(exp)
    return build_paper(read_runs(runs_path), exp, runs_path)
