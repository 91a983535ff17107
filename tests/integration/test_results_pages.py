"""Results pages (pipeline/tools/results/): a page regenerated from its source table shows
the source's values, under a header naming the command, the revision, the machine and
the runs or cases.

A runs page is made from a toy report in ``tmp_path`` (two shared toy runs copied there,
the report stage run over them); a benchmark page from a small table in the format
``python -m pipeline.tools.bench`` writes. Each page's table is parsed back and compared,
cell by cell, with the Parquet values at the precision the page prints.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pipeline.core import runtime
from pipeline.tools.bench.table import COLUMNS as BENCH_TABLE_COLUMNS
from pipeline.tools.results import main
from pipeline.tools.results.page import GENERATED_MARK, display_command
from pipeline.tools.results.sources import BENCH_COLUMNS, RUNS_COLUMNS

#: Largest difference a printed cell may have from its source value, by cell format.
_TOLERANCE = {"int": 0.0, "s": 0.005, "us": 0.0005, "mib": 0.5, "gib": 0.005 * 2**30,
              "rate": 0.5}


def _table(text: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the page's Markdown table (the first block of ``|`` lines)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| "))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        block.append(ln)
    cells = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in block]
    return cells[0], cells[2:]


def _check_cell(fmt: str, cell: str, value: Any, where: str) -> None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        assert cell == "-", where
        return
    if fmt == "text":
        assert cell == str(value), where
    elif fmt == "hash":
        assert str(value).startswith(cell) and len(cell) == 12, where
    elif fmt == "gap":
        assert float(cell) == pytest.approx(float(value), rel=5e-3, abs=0), where
    elif fmt == "num":
        assert float(cell) == pytest.approx(float(value), rel=1e-5, abs=0), where
    else:
        shown = float(cell.replace(",", ""))
        source = float(value) / (2**30 if fmt == "gib" else 1)
        assert abs(shown - source) <= _TOLERANCE[fmt] / (2**30 if fmt == "gib" else 1) + 1e-9, \
            f"{where}: page {cell}, source {value}"


def _compare(page: Path, source: Path, columns: Any) -> list[dict[str, Any]]:
    """Assert the page's table equals the source's rows in ``columns``; the rows."""
    rows = runtime.read_parquet(source).to_pylist()
    header, cells = _table(page.read_text(encoding="utf-8"))
    shown = [c for c in columns if c.key in rows[0]]
    assert header == [c.header for c in shown]
    assert len(cells) == len(rows)
    for i, (row, line) in enumerate(zip(rows, cells, strict=True)):
        for col, cell in zip(shown, line, strict=True):
            _check_cell(col.fmt, cell, row[col.key], f"row {i} {col.key}")
    return rows


@pytest.mark.toy_runs(("mesh=8",), ("mesh=2x4",))
def test_runs_page_from_a_toy_report(toy_results, tmp_path):
    from pipeline.stages.report.stage import run_report

    results = tmp_path / "results"
    for mesh in ("mesh=8", "mesh=2x4"):
        toy_results.copy_run(results, mesh)
    run_report(results)
    source = results / "report" / "runs.parquet"
    out = tmp_path / "pages"
    assert main(["runs", str(source), "--out", str(out), "--name", "toy"]) == 0

    page = out / "toy.md"
    rows = _compare(page, source, RUNS_COLUMNS)
    text = page.read_text(encoding="utf-8")
    assert text.splitlines()[2] == GENERATED_MARK
    assert f"- page: `python -m pipeline.tools.results runs {display_command([str(source)])} " \
           "--name toy`, at git " in text
    for row in rows:  # the run ids, the revision and the machine of the runs
        assert f"- `{row['run_id']}`: `runs/" in text
        assert row["git.revision"][:10] in text.split("- git revision of the numbers: ")[1]
        assert f"- machine: {row['environment.cpu_model']}" in text
    assert "| [toy](toy.md) |" in (out / "README.md").read_text(encoding="utf-8")

    # chosen columns: a known one keeps its header and format, another is shown by name
    chosen = "run_id,objective,param_memory.high"
    assert main(["runs", str(source), "--out", str(out), "--name", "cols",
                 "--columns", chosen]) == 0
    header, cells = _table((out / "cols.md").read_text(encoding="utf-8"))
    assert header == ["run id", "objective µs", "param_memory.high"]
    for row, line in zip(rows, cells, strict=True):
        _check_cell("num", line[2], row["param_memory.high"], "param_memory.high")
    assert main(["runs", str(source), "--out", str(out), "--columns", "nope"]) == 2


def _bench_table(rows: list[dict[str, Any]]) -> pa.Table:
    types = {"int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(),
             "string": pa.string()}
    schema = pa.schema([(name, types[t]) for name, t, _ in BENCH_TABLE_COLUMNS])
    return pa.table({name: [r.get(name) for r in rows] for name, _, _ in BENCH_TABLE_COLUMNS},
                    schema=schema)


def test_bench_page_shows_the_table_and_its_provenance(tmp_path):
    rows = [
        {"case_index": 1, "case": "model=toy mesh=8 solver=approx lazy_costs=true",
         "model": "toy", "n_layers": 2, "mesh": "8", "solver": "approx", "cost_mode": "lazy",
         "nodes": 584, "groups": 309, "group_strategies": 1768, "factors_materialised": 808,
         "trace": 4.123, "topology": 0.6, "cost_build": 0.14, "factor_build": 0.37,
         "solve": 0.43, "search_total": 5.55, "wall": 13.01, "cpu": 12.5,
         "peak_rss_mib": 486.4, "objective": 2128.0361, "lower_bound": 2128.0361, "gap": 0.0,
         "status": "Optimal", "placement_hash": "93ee57ce1afe" + "0" * 52,
         "revision": "0123456789ab", "exit_code": 0},
        {"case_index": 2, "case": "model=toy mesh=8 solver=ilp solver.backend=highs",
         "model": "toy", "mesh": "8", "solver": "ilp", "backend": "highs",
         "status": "Error", "error": "exit 2: solver=foo: allowed approx, ilp, lp",
         "wall": 2.5, "exit_code": 2},
    ]
    machine = {"cpu_model": "Test CPU", "cpu_count": 2, "usable_cores": 2,
               "memory_bytes": 8 * 2**30, "platform": "Linux", "python": "3.11",
               "torch": "2.13.0", "highspy": "1.16.0", "pulp": "3.3.2",
               "git": {"revision": "0123456789abcdef", "dirty": False}}
    meta = {"suite": "tiny", "description": "two cases", "complete": True, "fresh": True,
            "cases": 2, "command": "python -m pipeline.tools.bench --suite tiny --fresh",
            "started": "then", "finished": "later", "load_start": 0.5, "load_end": 1.0,
            "machine": machine}
    source = tmp_path / "tiny.parquet"
    runtime.write_parquet(source, _bench_table(rows), metadata=meta)
    out = tmp_path / "pages"
    assert main(["bench", str(source), "--out", str(out)]) == 0

    page = out / "bench-tiny.md"
    _compare(page, source, BENCH_COLUMNS)
    text = page.read_text(encoding="utf-8")
    assert "- numbers: `python -m pipeline.tools.bench --suite tiny --fresh`" in text
    assert "- git revision of the numbers: 0123456789\n" in text
    assert "- machine: Test CPU, 2 logical CPUs (2 usable), 8.0 GiB RAM" in text
    assert "- #1 `model=toy mesh=8 solver=approx lazy_costs=true`" in text
    assert "- #2 `model=toy mesh=8 solver=ilp solver.backend=highs`: error: exit 2" in text


def test_paths_outside_the_checkout_are_not_written(tmp_path):
    shown = display_command(["python", "-m", "x", str(tmp_path / "a.parquet"),
                             f"--out={tmp_path}", f"results_dir={tmp_path}"])
    assert str(tmp_path) not in shown
    assert "<a.parquet: outside this checkout>" in shown


def test_bad_arguments_are_one_line(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "missing.parquet")]) == 2
    assert main(["--results", str(tmp_path)]) == 2
    assert main(["runs"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3
    assert lines[0].endswith("missing.parquet: no such file")
