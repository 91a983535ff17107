"""Command line of ``python -m pipeline.tools.results``.

    python -m pipeline.tools.results                                   # every table under results/
    python -m pipeline.tools.results bench results/bench/smoke.parquet
    python -m pipeline.tools.results shapes results/shapes/toy-<h8>/w8-d3/shapes.parquet
    python -m pipeline.tools.results runs results/report/runs.parquet [--columns a,b]
    python -m pipeline.tools.results loop results/loop/predicted_vs_measured.json
    python -m pipeline.tools.results pipeline results/bench/pipeline_search.parquet

Options: ``--out DIR`` (default ``docs/results``); ``--name NAME`` and ``--title TEXT``
(the page's file stem and heading; one source only); ``--results DIR`` (where the
no-argument form looks, default ``results``); ``--made-by TEXT`` (``runs``: the command
that made the runs); ``--columns A,B`` (``runs``: the columns shown).

Exit codes: 0 pages written; 2 a bad argument or an unreadable source (one line on
stderr, nothing written for that source); with no argument and nothing under
``--results``, 2 as well.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.tools.results.loop import loop_page
from pipeline.tools.results.page import display_command, write_page
from pipeline.tools.results.pipeline_search import pipeline_page
from pipeline.tools.results.sources import bench_page, discover, runs_page, shapes_page

__all__ = ["main"]

KINDS = ("bench", "shapes", "runs", "loop", "pipeline")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.tools.results",
        description="Write docs/results/<name>.md pages from the tables the tools write: "
                    "a benchmark table, a mesh-shape table, the report's runs.parquet, "
                    "a predicted-versus-measured sweep (pipeline.verify.sweep), "
                    "a pipeline search (benchmarks/pipeline_search.py).")
    p.add_argument("kind", nargs="?", choices=KINDS,
                   help="the kind of SOURCE; without it, every table under --results")
    p.add_argument("source", nargs="?", type=Path, help="the Parquet table to read")
    p.add_argument("--out", type=Path, default=Path("docs/results"),
                   help="directory of the pages (default docs/results)")
    p.add_argument("--name", default=None, help="file stem of the page (one source only)")
    p.add_argument("--title", default=None, help="heading of the page (one source only)")
    p.add_argument("--results", type=Path, default=Path("results"),
                   help="results directory searched without a SOURCE (default results)")
    p.add_argument("--columns", default=None,
                   help="runs: comma-separated runs.parquet columns (default a fixed set)")
    p.add_argument("--made-by", default=None,
                   help="runs: the command that made the runs, shown in the page's header")
    return p


def _fail(message: str) -> int:
    print(" ".join(message.split()), file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.kind is not None and args.source is None:
        return _fail(f"{args.kind}: missing SOURCE, the Parquet table to read")
    if args.kind is None:
        if args.name is not None or args.title is not None:
            return _fail("--name, --title: allowed with one SOURCE only")
        sources = discover(args.results)
        if not sources:
            return _fail(f"--results={args.results}: no benchmark, shape or runs table "
                         "under it (bench/*.parquet, bench/pipeline_search.parquet, "
                         "shapes/*/*/shapes.parquet, report/runs.parquet)")
    else:
        sources = [(args.kind, args.source)]
    columns = args.columns.split(",") if args.columns else None
    for kind, path in sources:
        if not path.is_file():
            return _fail(f"{kind} {path}: no such file")
        command = display_command(["python", "-m", "pipeline.tools.results", kind,
                                   str(path.resolve()),
                                   *(["--name", args.name] if args.name else []),
                                   *(["--title", args.title] if args.title else []),
                                   *(["--columns", args.columns] if args.columns else []),
                                   *(["--made-by", args.made_by] if args.made_by else [])])
        try:
            if kind == "bench":
                page = bench_page(path, args.name, command, args.title)
            elif kind == "shapes":
                page = shapes_page(path, args.name, command, args.title)
            elif kind == "loop":
                page = loop_page(path, args.name, command, args.title)
            elif kind == "pipeline":
                page = pipeline_page(path, args.name, command, args.title)
            else:
                page = runs_page(path, args.name, command, columns, args.made_by, args.title)
        except (OSError, ValueError, KeyError) as err:
            return _fail(f"{kind} {path}: {err}")
        written = write_page(page, args.out)
        print(f"{written}: {len(page.rows)} rows from {path}")
    return 0
