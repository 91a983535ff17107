"""The paper's tables and figures, regenerated from ``runs.parquet`` only.

    python -m pipeline.paper                          # experiment paper_toy
    python -m pipeline.paper experiment=paper         # LLaMA-3 1B, full size
    python -m pipeline.paper --no-run experiment=paper_toy results_dir=/data/results
    snakemake paper [--config experiment=paper]       # the same, runs as Snakemake jobs

An *experiment* (``conf/experiment/paper*.yaml``, ``# @package _global_``) names its
runs in ``paper.runs``: run sets, each a list of Hydra overrides in the multirun grammar
(``mesh=8,2x4``) applied on top of the experiment's config (:func:`load_experiment`).
Three sets are read:

* ``eager_vs_lazy``: the eager-vs-lazy table at mesh ``paper.table_mesh``
  (:func:`eager_vs_lazy_table`; columns from the run record's phases: Optimizer init =
  topology + cost_build, Factor build = factor_build, TRW-S solve = solve, Search
  total = search_total, Peak RSS = ``peak_rss_bytes.max``; plus the delta lazy - eager
  in seconds and percent), the per-phase time figure and the peak-RSS figure;
* ``solvers``: objective and certified gap by solver and mesh;
* ``depth``: search time against the number of layers.

Missing runs are computed first, one ``python -m pipeline`` process per run so that each
run's peak RSS is its own (:func:`ensure_runs`; Snakemake runs them as jobs instead), the
report is refreshed, and everything after that reads ``<results_dir>/report/runs.parquet``
and nothing else. Outputs go to ``<results_dir>/paper/<experiment>/``: the table as
Markdown and Parquet, one PNG per figure (matplotlib, Agg). Provenance -- the run ids,
run keys (result directories below ``runs/``), config hashes (SHA-256 of the canonical
JSON of each run's resolved config, 8 hex digits) and git revisions of the runs, plus the
revision and code hash (:func:`pipeline.config.stage_code_hash` ``("paper")``) of this
module -- is in the Parquet schema metadata (key ``pipeline``), in a JSON sidecar next
to every Markdown and PNG file (``<name>.provenance.json``), and in ``provenance.json``
for the whole set. Each figure also names its configs in a footer.

Exit codes: 0 done; 2 bad configuration or an experiment the paper cannot be built from
(one line on stderr); 1 a run failed.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
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
    config_hash,
    load_resolved,
    stage_code_hash,
    stage_dirs,
    sweep_overrides,
)

log = logging.getLogger(__name__)

#: Experiment used when none is selected (fast; fits CI-size machines).
DEFAULT_EXPERIMENT = "paper_toy"

#: Run sets an experiment must define in ``paper.runs``.
RUN_SETS: tuple[str, ...] = ("eager_vs_lazy", "solvers", "depth")

#: Artifact name -> the files it consists of (in ``<results_dir>/paper/<experiment>/``).
ARTIFACTS: dict[str, tuple[str, ...]] = {
    "eager_vs_lazy": ("eager_vs_lazy.md", "eager_vs_lazy.parquet"),
    "fig_phases": ("fig_phases.png",),
    "fig_peak_rss": ("fig_peak_rss.png",),
    "fig_depth": ("fig_depth.png",),
    "fig_solvers": ("fig_solvers.png",),
}
SIDECAR_SUFFIX = ".provenance.json"
PROVENANCE_FILE = "provenance.json"

#: Phases of a search, in order (the phase names of :data:`pipeline.cli.PHASES`).
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
        grid = [str(o) for o in runs[set_name]]
        if not grid:
            raise ConfigError(f"paper.runs.{set_name}=[]: allowed a non-empty list of "
                              "overrides, e.g. [mesh=8,2x4, lazy_costs=true,false]")
        sets[set_name] = []
        for job in sweep_overrides(grid):
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
        from pipeline.config import parse_mesh

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
    from pipeline import cli

    dirs = stage_dirs(cfg)
    return all(cli._is_current(stage, dirs, stage_code_hash(stage))
               for stage in ("trace", "topology", "costs", "solve"))


def ensure_runs(exp: Experiment) -> list[str]:
    """Run the experiment's runs that are missing or stale, one ``python -m pipeline``
    process each (so a run's peak RSS is its own), one after the other.

    Returns:
        The keys of the runs that ran.

    Raises:
        subprocess.CalledProcessError: a run failed.
    """
    from pipeline.runtime import PROJECT_ROOT

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
    from pipeline.cli import run_stage, sentinel

    dirs = stage_dirs(exp.cfg)
    run_stage("report", exp.cfg, dirs)
    return sentinel(dirs, "report")


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
                         f"runs/{absent[0]}; run them first (python -m pipeline.paper "
                         "without --no-run, or snakemake paper)")
    keys = list(dict.fromkeys(keys))
    return runs.iloc[[by_key[k] for k in keys]].reset_index(drop=True)


def _config(row: Any) -> dict[str, Any]:
    text = row.get("config_json") if hasattr(row, "get") else None
    return json.loads(text) if isinstance(text, str) and text else {}


def _num(row: Any, col: str) -> float:
    value = row.get(col)
    if value is None:
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _mesh_order(mesh: str) -> tuple[int, int, str]:
    dims = [int(d) for d in str(mesh).split("x")]
    return (math.prod(dims), len(dims), str(mesh))


# --------------------------------------------------------------------------- provenance


def run_provenance(runs: Any) -> list[dict[str, Any]]:
    """Per run: id, key, config hash, git revision and dirty flag, revision label, and
    the readable config keys."""
    out = []
    for _, row in runs.iterrows():
        cfg = _config(row)
        out.append({
            "run_id": row.get("run_id"),
            "run_key": row.get("run_key"),
            "config_hash": config_hash(cfg) if cfg else None,
            "git_revision": row.get("git.revision"),
            "git_dirty": None if row.get("git.dirty") is None else bool(row.get("git.dirty")),
            "revision_label": row.get("revision_label"),
            "model": row.get("model"),
            "n_layers": cfg.get("model", {}).get("n_layers"),
            "mesh": row.get("mesh"),
            "hardware": row.get("hardware"),
            "cost_mode": row.get("cost_mode"),
            "solver": row.get("solver"),
        })
    return out


def provenance(runs: Any, artifact: str, experiment: str | None = None,
               source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The provenance record of one artifact built from the rows ``runs``."""
    from pipeline import runtime

    per_run = run_provenance(runs)
    revisions = sorted({r["git_revision"] for r in per_run if r["git_revision"]})
    return {
        "artifact": artifact,
        "experiment": experiment,
        "run_ids": [r["run_id"] for r in per_run],
        "config_hashes": [r["config_hash"] for r in per_run],
        "git_revisions": revisions,
        "runs": per_run,
        "source": source or {},
        "built_by": {"module": "pipeline.paper", "code_hash": stage_code_hash("paper"),
                     "git": runtime.git_revision()},
    }


def describe_runs(runs: Any) -> str:
    """One or two lines naming the configs of ``runs`` (the figure footer)."""
    def values(col: str) -> list[str]:
        if col not in runs:
            return []
        return [str(v) for v in dict.fromkeys(runs[col].tolist()) if v is not None]

    cfgs = [_config(row) for _, row in runs.iterrows()]
    models = []
    for row, cfg in zip(runs.to_dict("records"), cfgs):
        m = cfg.get("model", {})
        text = f"{row.get('model')} ({m.get('n_layers', '?')} layers, dim {m.get('dim', '?')})"
        if text not in models:
            models.append(text)
    meshes = sorted(values("mesh"), key=_mesh_order)
    revs = []
    for row in runs.to_dict("records"):
        rev = row.get("revision_label") or str(row.get("git.revision") or "unknown")[:8]
        rev += "+dirty" if row.get("git.dirty") and not row.get("revision_label") else ""
        if rev not in revs:
            revs.append(rev)
    parts = [
        "model " + ", ".join(models),
        "hardware " + ", ".join(values("hardware")),
        "mesh " + ", ".join(meshes),
        "solver " + ", ".join(values("solver")),
        "costs " + ", ".join(values("cost_mode")),
    ]
    ids = ", ".join(str(v) for v in runs["run_id"].tolist()) if "run_id" in runs else ""
    return "; ".join(parts) + f"\nruns {ids}; git {', '.join(revs)}"


# --------------------------------------------------------------------------- the table


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
            "optimizer_init_s": _num(row, "phases.topology") + _num(row, "phases.cost_build"),
            "factor_build_s": _num(row, "phases.factor_build"),
            "trws_solve_s": _num(row, "phases.solve"),
            "search_total_s": _num(row, "phases.search_total"),
            "peak_rss_mib": _num(row, "peak_rss_bytes.max") / MIB,
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


# --------------------------------------------------------------------------- figures


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

    from pipeline import runtime

    fig.text(0.01, 0.01, describe_runs(runs), fontsize=7, color="#444444",
             ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    meta = {"Title": prov["artifact"], "Software": "pipeline.paper",
            "Description": json.dumps({k: prov[k] for k in
                                       ("experiment", "run_ids", "config_hashes",
                                        "git_revisions")}, sort_keys=True)}
    with runtime.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=150, metadata=meta)
    plt.close(fig)
    write_sidecar(path, prov)


def sidecar_path(path: Path) -> Path:
    """``fig_phases.png`` -> ``fig_phases.provenance.json``."""
    return path.with_name(path.name.split(".")[0] + SIDECAR_SUFFIX)


def write_sidecar(path: Path, prov: dict[str, Any]) -> None:
    from pipeline import runtime

    runtime.write_json(sidecar_path(path), prov)


def _sorted_runs(runs: Any) -> Any:
    order = sorted(range(len(runs)), key=lambda i: (
        _mesh_order(runs.iloc[i]["mesh"]), str(runs.iloc[i].get("cost_mode")),
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
        vals = [max(_num(r, f"phases.{phase}"), 0.0) if math.isfinite(_num(r, f"phases.{phase}"))
                else 0.0 for _, r in runs.iterrows()]
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
    meshes = sorted(dict.fromkeys(runs["mesh"].tolist()), key=_mesh_order)
    fig, (ax,) = _figure()
    width = 0.38
    top = 0.0
    for j, mode in enumerate(("eager", "lazy")):
        vals = []
        for mesh in meshes:
            sel = runs[(runs["mesh"] == mesh) & (runs["cost_mode"] == mode)]
            vals.append(_num(sel.iloc[0], "peak_rss_bytes.max") / MIB if len(sel)
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
    layers = [int(_config(r).get("model", {}).get("n_layers", 0)) for _, r in runs.iterrows()]
    order = sorted(range(len(runs)), key=lambda i: layers[i])
    runs = runs.iloc[order].reset_index(drop=True)
    layers = [layers[i] for i in order]
    total = [_num(r, "phases.search_total") for _, r in runs.iterrows()]
    trace = [_num(r, "phases.trace") for _, r in runs.iterrows()]
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
    ax.set_xlabel("number of layers (model.n_layers)")
    ax.set_ylabel("time (s)")
    ax.set_ylim(0, max([v for v in total if math.isfinite(v)] + [1e-9]) * 1.15)
    ax.set_title("Search time vs depth")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path, runs, prov)


def plot_solvers(runs: Any, path: Path, prov: dict[str, Any]) -> None:
    """Two panels by mesh, one bar per solver: objective (ms) and certified gap (%)."""
    runs = _sorted_runs(runs)
    meshes = sorted(dict.fromkeys(runs["mesh"].tolist()), key=_mesh_order)
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
            objs.append(_num(r, "objective") / 1000.0)
            gap = 100.0 * _num(r, "gap")
            gaps.append(max(gap, 0.0) if math.isfinite(gap) else float("nan"))
            certified = bool(r.get("certified"))
            notes.append(("certified" if certified else f"{gap:.2g} %")
                         + f"\n{r.get('status')}")
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
    top = max([v for v in runs["objective"].tolist() if v is not None and math.isfinite(v)]
              + [1e-9]) / 1000.0
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


# --------------------------------------------------------------------------- building


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_paper(runs: Any, exp: Experiment, runs_path: Path | None = None) -> list[Path]:
    """Write every artifact of ``exp`` from the runs table ``runs``; return the paths.

    Raises:
        PaperError: a run of the experiment is not in ``runs``, or the eager-vs-lazy set
            lacks the eager or lazy run at ``table_mesh``.
    """
    from pipeline import runtime

    out = exp.out_dir
    source = {"runs_parquet": str(runs_path) if runs_path else None,
              "runs_parquet_sha256": _sha256(runs_path) if runs_path else None,
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
    mesh_names = _config(at_mesh.iloc[0]).get("mesh_names") or []
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

    every = select_runs(runs, [r.key for r in exp.runs()], "experiment")
    summary = provenance(every, "paper", exp.name, source)
    summary["artifacts"] = {name: list(ARTIFACTS[name]) for name in ARTIFACTS}
    summary["table_mesh"] = exp.table_mesh
    summary["run_sets"] = {name: [r.key for r in exp.sets[name]] for name in RUN_SETS}
    runtime.write_json(out / PROVENANCE_FILE, summary)
    written.append(out / PROVENANCE_FILE)
    log.info("paper: %d artifacts from %d runs -> %s", len(ARTIFACTS), len(every), out)
    return written


def make_paper(overrides: Sequence[str] = (), run_missing: bool = True) -> list[Path]:
    """Load the experiment, run what is missing (unless ``run_missing=False``), refresh
    the report and build every artifact from ``runs.parquet``."""
    exp = load_experiment(overrides)
    if run_missing:
        ensure_runs(exp)
    runs_path = refresh_report(exp)
    return build_paper(read_runs(runs_path), exp, runs_path)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pipeline.paper``; returns the exit code."""
    parser = _OneLineParser(
        prog="python -m pipeline.paper",
        description="Regenerate the paper's tables and figures from runs.parquet.")
    parser.add_argument("--no-run", action="store_true",
                        help="do not run missing runs; fail if one is missing")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides, e.g. experiment=paper results_dir=results")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    from pipeline.cli import configure_logging

    configure_logging()
    try:
        paths = make_paper(args.overrides, run_missing=not args.no_run)
    except (ConfigError, PaperError) as err:
        print(err, file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:
        print(f"a run failed: {' '.join(map(str, err.cmd))} (exit {err.returncode})",
              file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
