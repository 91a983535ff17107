"""Stage 5 - report: aggregate every run under ``results/runs`` into Parquet tables.

* ``results/report/runs.parquet``: one row per run record (``run.json``), nested
  fields flattened with ``.`` (``phases.solve``, ``counts.groups``, ...).
* ``results/report/placements.parquet``: one row per (run, node), the union of
  every run's ``solution.parquet``.
* ``results/report/redistributions.parquet``: one row per (run, graph edge whose
  placements differ), the union of every run's ``redistributions.parquet``: the
  src/dst placements, the collectives DTensor would run (``reduce_scatter(dp)``...),
  bytes and µs.

All load with pandas, polars or duckdb. Rows are sorted by run directory so
the files are deterministic for a given set of runs. File names and schema versions:
pipeline/artifacts.py (a run record's own version is its ``schema_version`` column;
records written before versioning have none).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import artifacts, runtime
from pipeline.artifacts import (  # noqa: F401 - file names, re-exported
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
_SKIP = ("config", "bound_history")


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


def run_rows(results_dir: Path) -> list[dict[str, Any]]:
    """Flattened run records of every ``runs/**/run.json`` (sorted by path)."""
    rows = []
    for path in sorted(Path(results_dir, "runs").glob(f"**/{RUN.name}")):
        rec = json.loads(path.read_text())
        row = flatten({k: v for k, v in rec.items() if k not in _SKIP})
        row["config_json"] = json.dumps(rec.get("config", {}), sort_keys=True)
        rows.append(row)
    return rows


def run_report(results_dir: Path) -> None:
    """Write ``report/runs.parquet``, ``report/placements.parquet`` and
    ``report/redistributions.parquet`` atomically (``runs.parquet``, the sentinel,
    last); an empty results directory gives empty tables."""
    results_dir = Path(results_dir)
    out = results_dir / "report"
    rows = run_rows(results_dir)
    keys = sorted({k for r in rows for k in r})
    cols = {k: [r.get(k) for r in rows] for k in keys}
    table = pa.table({k: _column(v) for k, v in cols.items()}) if rows else pa.table({})
    placements = _union(results_dir, SOLUTION.name)
    artifacts.write_table(PLACEMENTS, out, placements, metadata={"runs": len(rows)})
    redistributions = _union(results_dir, REDISTRIBUTIONS.name)
    artifacts.write_table(REPORT_REDISTRIBUTIONS, out, redistributions,
                          metadata={"runs": len(rows)})
    artifacts.write_table(RUNS, out, table, metadata={
        "runs": len(rows), "git": runtime.git_revision()})
    log.info("report: %d runs, %d placement rows, %d redistribution rows -> %s", len(rows),
             placements.num_rows, redistributions.num_rows, out)


def _union(results_dir: Path, name: str) -> pa.Table:
    """Every run's ``name`` table, concatenated in run-directory order."""
    parts = [pq.read_table(p).replace_schema_metadata(None)
             for p in sorted(results_dir.glob(f"runs/**/{name}"))]
    return pa.concat_tables(parts, promote_options="default") if parts else pa.table({})


def _column(values: list[Any]) -> pa.Array:
    kinds = {type(v) for v in values if v is not None}
    if kinds == {int, float} or kinds == {float}:
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    if len(kinds) > 1:
        return pa.array([None if v is None else json.dumps(v) for v in values], pa.string())
    return pa.array(values)
