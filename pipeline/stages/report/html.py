"""HTML pages of the result tables, for Snakemake's HTML report (``snakemake --report``).

A Snakemake report shows a result in the page only when it is HTML, PNG, JPEG, SVG or
PDF; a Parquet or Markdown file is a download. So the tables the report holds are also
written as small self-contained HTML pages:

* ``results/report/runs.html``: ``runs.parquet`` (one row per run record) as a table of
  the columns a reader compares runs by (:data:`RUN_COLUMNS`: model, mesh, solver, cost
  mode, objective, bound, gap, status, search time, peak RSS, placement hash, run
  directory), sorted by model, device count, mesh, solver and cost mode;
* ``<results_dir>/paper/<experiment>/<table>.html`` beside each of the paper's Markdown
  tables (a bold title, one pipe table, ``<sub>`` footers), with its column alignment.

    python -m pipeline.stages.report.html runs results/report/runs.parquet results/report/runs.html
    python -m pipeline.stages.report.html table results/paper/paper_toy/eager_vs_lazy.md  # + .html

Pages are written atomically. A missing or unreadable input: one line on stderr, exit
status 2, nothing written.
"""

from __future__ import annotations

import html
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.core import runtime

#: (runs.parquet column, header, format) of the runs page, in order; a column no run
#: has is left out.
RUN_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("model", "model", "text"),
    ("mesh", "mesh", "text"),
    ("mesh_names", "mesh dims", "names"),
    ("solver", "solver", "text"),
    ("cost_mode", "costs", "text"),
    ("hardware", "hardware", "text"),
    ("objective", "objective (µs)", "float3"),
    ("lower_bound", "lower bound (µs)", "float3"),
    ("gap", "gap", "gap"),
    ("status", "status", "text"),
    ("phases.search_total", "search total (s)", "float2"),
    ("peak_rss_bytes.max", "peak RSS (MiB)", "mib"),
    ("placement_hash", "placement hash", "hash"),
    ("run_id", "run", "text"),
    ("solve_dir", "run directory", "text"),
)

_STYLE = ("body{font-family:sans-serif;font-size:14px;margin:1em}"
          "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:3px 8px}"
          "th{background:#f0f0f0}td.r{text-align:right;font-variant-numeric:tabular-nums}"
          "caption{text-align:left;font-weight:bold;padding:4px 0}")


class PageError(ValueError):
    """An input the pages cannot be made from (one-line message)."""


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}"
            f"</title><style>{_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n")


def _cell(value: Any, kind: str) -> tuple[str, bool]:
    """(escaped text, right-aligned) of one value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "", False
    if kind == "names":  # a list, or its JSON text (runs.parquet flattens lists to JSON)
        names = json.loads(value) if isinstance(value, str) and value.startswith("[") else value
        return html.escape(",".join(str(v) for v in names) if isinstance(names, list)
                           else str(names)), False
    if kind == "float3":
        return f"{float(value):,.3f}", True
    if kind == "float2":
        return f"{float(value):.2f}", True
    if kind == "gap":
        return f"{float(value):.2g}", True
    if kind == "mib":
        return f"{float(value) / 2**20:,.0f}", True
    if kind == "hash":
        return html.escape(str(value)[:16]), False
    return html.escape(str(value)), False


def _mesh_key(mesh: Any) -> tuple[int, int, str]:
    dims = [int(d) for d in str(mesh).split("x") if d.isdigit()]
    return (math.prod(dims) if dims else 0, len(dims), str(mesh))


def runs_page(rows: Sequence[dict[str, Any]]) -> str:
    """The runs page of ``rows`` (``runs.parquet`` records)."""
    cols = [c for c in RUN_COLUMNS if any(c[0] in r for r in rows)]
    rows = sorted(rows, key=lambda r: (str(r.get("model")), _mesh_key(r.get("mesh")),
                                       str(r.get("solver")), str(r.get("cost_mode"))))
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _ in cols)
    body = []
    for r in rows:
        cells = []
        for key, _, kind in cols:
            text, right = _cell(r.get(key), kind)
            cells.append(f"<td class=\"r\">{text}</td>" if right else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    caption = f"Runs ({len(rows)})"
    table = (f"<table id=\"runs\"><caption>{caption}</caption><thead><tr>{head}</tr></thead>"
             f"<tbody>\n" + "\n".join(body) + "\n</tbody></table>")
    return _page("runs", table)


def _inline(text: str) -> str:
    """Escaped Markdown inline text: ``**bold**`` and the ``<sub>`` tags kept."""
    out = html.escape(text, quote=False)
    out = out.replace("&lt;sub&gt;", "<sub>").replace("&lt;/sub&gt;", "</sub>")
    return re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)


def _split_row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def markdown_page(text: str, title: str) -> str:
    """A Markdown table file (paragraphs and pipe tables, the paper's form) as a page.

    Raises:
        PageError: the text has no pipe table.
    """
    blocks, table, para = [], [], []

    def flush_para() -> None:
        if para:
            blocks.append("<p>" + _inline(" ".join(para)) + "</p>")
            para.clear()

    def flush_table() -> None:
        if not table:
            return
        header, rule, *rows = table
        aligns = ["r" if c.endswith(":") else "" for c in _split_row(rule)]
        head = "".join(f"<th>{_inline(c)}</th>" for c in _split_row(header))
        lines = []
        for row in rows:
            cells = _split_row(row)
            lines.append("<tr>" + "".join(
                f"<td class=\"{aligns[i] if i < len(aligns) else ''}\">{_inline(c)}</td>"
                for i, c in enumerate(cells)) + "</tr>")
        blocks.append(f"<table><thead><tr>{head}</tr></thead><tbody>\n"
                      + "\n".join(lines) + "\n</tbody></table>")
        table.clear()

    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            flush_para()
            table.append(line)
        elif not line.strip():
            flush_para()
            flush_table()
        else:
            flush_table()
            para.append(line.strip())
    flush_para()
    flush_table()
    if not any(b.startswith("<table>") for b in blocks):
        raise PageError(f"{title}: no Markdown table in the text")
    return _page(title, "\n".join(blocks))


def write_runs_page(runs_parquet: Path | str, out: Path | str) -> Path:
    """Write :func:`runs_page` of ``runs_parquet`` to ``out`` (atomically)."""

    try:
        rows = runtime.read_parquet(runs_parquet).to_pylist()
    except (OSError, ValueError) as err:
        raise PageError(f"runs={runs_parquet}: not a readable runs.parquet "
                        f"({' '.join(str(err).split())})") from err
    with runtime.atomic_path(out) as tmp:
        tmp.write_text(runs_page(rows), encoding="utf-8")
    return Path(out)


def write_markdown_page(markdown: Path | str, out: Path | str) -> Path:
    """Write :func:`markdown_page` of the Markdown file ``markdown`` to ``out``."""
    try:
        text = Path(markdown).read_text(encoding="utf-8")
    except OSError as err:
        raise PageError(f"table={markdown}: not readable ({err.strerror})") from err
    page = markdown_page(text, Path(markdown).stem)
    with runtime.atomic_path(out) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return Path(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.stages.report.html runs RUNS.parquet OUT.html`` or
    ``... table TABLE.md [TABLE.md ...]`` (each page beside its table); the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    ok = (len(args) == 3 and args[0] == "runs") or (len(args) >= 2 and args[0] == "table")
    if not ok:
        print(f"python -m pipeline.stages.report.html {' '.join(args)}: allowed "
              f"'runs RUNS.parquet OUT.html' or 'table TABLE.md [TABLE.md ...]'",
              file=sys.stderr)
        return 2
    try:
        if args[0] == "runs":
            write_runs_page(args[1], args[2])
        else:
            pages = [(md, Path(md).with_suffix(".html")) for md in args[1:]]
            for md, _ in pages:  # every input readable before any page is written
                if not Path(md).is_file():
                    raise PageError(f"table={md}: not readable (No such file or directory)")
            for md, page in pages:
                write_markdown_page(md, page)
    except PageError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
