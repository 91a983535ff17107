"""Benchmark tables: the output columns (:data:`COLUMNS`) and their units, the Parquet
table and the Markdown table of a suite.

Outputs, rewritten atomically after every case (so a long suite can be watched):
``<out>/<suite>.parquet`` (one row per case; schema metadata ``pipeline`` holds the
machine, versions, git revision, command, units and ``complete``) and ``<out>/<suite>.md``
(a Markdown table under a header with the same facts). The stdout and stderr of each
case are kept in ``<out>/logs/<suite>/<NN>-<case>.{stdout,stderr}.log``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pipeline.core import runtime
from pipeline.tools.bench.suites import Suite

__all__ = ["COLUMNS", "PHASE_COLUMNS", "UNITS"]

#: Output columns: (Parquet name, Arrow type name, Markdown header or None if the column
#: is left out of the Markdown table). Phase columns use the phase names of the run record
#: (:data:`pipeline.stages.runner.PHASES`).
COLUMNS: tuple[tuple[str, str, str | None], ...] = (
    ("case_index", "int32", "#"),
    ("case", "string", None),
    ("model", "string", "model"),
    ("n_layers", "int32", "layers"),
    ("mesh", "string", "mesh"),
    ("solver", "string", "solver"),
    ("backend", "string", "backend"),
    ("cost_mode", "string", "cost mode"),
    ("nodes", "int64", "nodes"),
    ("groups", "int64", "groups"),
    ("group_strategies", "int64", "strategies"),
    ("factors_materialised", "int64", "factors"),
    ("trace", "float64", "trace s"),
    ("topology", "float64", "topology s"),
    ("cost_build", "float64", "cost_build s"),
    ("factor_build", "float64", "factor_build s"),
    ("solve", "float64", "solve s"),
    ("search_total", "float64", "search_total s"),
    ("wall", "float64", "wall s"),
    ("cpu", "float64", "cpu s"),
    ("peak_rss_mib", "float64", "peak RSS MiB"),
    ("objective", "float64", "objective µs"),
    ("lower_bound", "float64", "lower bound µs"),
    ("gap", "float64", "gap"),
    ("status", "string", "status"),
    ("additive_status", "string", "additive status"),
    ("step_time_us", "float64", "step µs"),
    ("step_time_lower_bound_us", "float64", "step bound µs"),
    ("step_time_gap", "float64", "step gap"),
    ("placement_hash", "string", "placement hash"),
    ("time_limit_s", "float64", "time limit s"),
    ("reused", "string", "reused"),
    ("code", "string", "code"),
    ("revision", "string", None),
    ("exit_code", "int32", None),
    ("error", "string", None),
    ("load_1m", "float64", None),
    ("run_record", "string", None),
)

PHASE_COLUMNS = ("trace", "topology", "cost_build", "factor_build", "solve", "search_total")

UNITS = {
    "trace": "s", "topology": "s", "cost_build": "s", "factor_build": "s", "solve": "s",
    "search_total": "s (trace through solve, as recorded in run.json)",
    "wall": "s (process, measured by the runner)",
    "cpu": "s (user + system of the process tree)",
    "peak_rss_mib": "MiB (ru_maxrss of the process tree via os.wait4)",
    "objective": "µs (additive)", "lower_bound": "µs (additive)", "time_limit_s": "s",
    "step_time_us": "µs (simulated, pipeline/costmodel/steptime.py)",
    "step_time_lower_bound_us": "µs (over every plan, pipeline/solvers/step_bound.py)",
    "load_1m": "1-minute load average when the case started",
    "code": "hash of the stage sources when the case started (see code_hash)",
    "revision": "git revision of the run record (+dirty: uncommitted changes)",
}


def _empty_row() -> dict[str, Any]:
    return {name: None for name, _, _ in COLUMNS}


def _table(rows: list[dict[str, Any]]) -> Any:
    import pyarrow as pa

    types = {"int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(),
             "string": pa.string()}
    schema = pa.schema([(name, types[t]) for name, t, _ in COLUMNS])
    data = {name: [r.get(name) for r in rows] for name, _, _ in COLUMNS}
    return pa.table(data, schema=schema)


def _fmt_cell(name: str, value: Any) -> str:
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if name == "placement_hash":
        return str(value)[:12]
    if name in ("gap", "step_time_gap"):
        return f"{value:.2e}" if value else "0"
    if name in ("objective", "lower_bound", "step_time_us", "step_time_lower_bound_us"):
        return f"{value:.3f}"
    if name == "peak_rss_mib":
        return f"{value:.0f}"
    if name == "time_limit_s":
        return f"{value:g}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value).replace("|", "\\|")


def _fmt_load(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _markdown(suite: Suite, rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    git = m.get("git") or {}
    mem = f", {m['memory_bytes'] / 2**30:.1f} GiB RAM" if m.get("memory_bytes") else ""
    rev = (git.get("revision") or "unknown")[:10] + (" (dirty)" if git.get("dirty") else "")
    mode = ("fresh results directory per case (nothing reused)" if meta["fresh"]
            else f"shared results directory {meta['results_dir']} (reuse allowed; "
                 "reused phases as recorded in the artifacts)")
    status = ("complete" if meta["complete"]
              else f"in progress: {len(rows)} of {meta['cases']} cases")
    lines = [
        f"# Benchmark `{suite.name}`",
        "",
        f"{suite.description}.",
        "",
        f"- machine: {m['cpu_model']}, {m['cpu_count']} logical CPUs "
        f"({m['usable_cores']} usable){mem}; {m['platform']}",
        f"- versions: python {m['python']}, torch {m['torch']}, highspy {m['highspy']}, "
        f"pulp {m['pulp']}; git {rev}",
        f"- command: `{meta['command']}`; {mode}",
        f"- started {meta['started']}, {status}"
        + (f" at {meta['finished']}" if meta.get("finished") else "")
        + f"; 1-min load average {_fmt_load(meta['load_start'])} at start, "
        f"{_fmt_load(meta.get('load_end'))} at end",
        "- times in seconds (phases as recorded in each run.json; `wall` and `cpu` of the "
        "process measured by the runner), peak RSS of the process tree in MiB "
        "(os.wait4), objective and bound in µs, gap relative",
    ]
    for name, seconds in (meta.get("import_seconds") or {}).items():
        shown_s = "not installed" if seconds is None else f"{seconds:.2f} s"
        lines.append(f"- import of {name} (fresh process after `import torch`, fastest of "
                     f"3; paid by every trace of the family): {shown_s}")
    lines += [
        "",
    ]
    shown = [(name, header) for name, _, header in COLUMNS if header is not None]
    lines.append("| " + " | ".join(h for _, h in shown) + " |")
    text_columns = ("model", "mesh", "solver", "backend", "cost_mode", "status",
                    "placement_hash", "reused", "code")
    lines.append("|" + "|".join("---" if n in text_columns else "--:" for n, _ in shown)
                 + "|")
    for r in rows:
        lines.append("| " + " | ".join(_fmt_cell(n, r.get(n)) for n, _ in shown) + " |")
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["", "Errors:", ""]
        lines += [f"- #{r['case_index']} `{r['case']}`: {r['error']}" for r in errors]
    lines += ["", "Cases:", ""]
    lines += [f"- #{r['case_index']} `{r['case']}`" for r in rows]
    return "\n".join(lines) + "\n"


def _write_outputs(out: Path, suite: Suite, rows: list[dict[str, Any]],
                   meta: dict[str, Any]) -> None:
    runtime.write_parquet(out / f"{suite.name}.parquet", _table(rows), metadata=meta)
    with runtime.atomic_path(out / f"{suite.name}.md") as tmp:
        tmp.write_text(_markdown(suite, rows, meta), encoding="utf-8")

