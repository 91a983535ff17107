"""The tables a results page is read from, each turned into a :class:`~.page.Page`:

* a benchmark table, ``<out>/<suite>.parquet`` of ``python -m pipeline.tools.bench``
  (:func:`bench_page`; its schema metadata ``pipeline`` holds the command, the machine
  and the git revision, :mod:`pipeline.tools.bench.table`);
* a mesh-shape table, ``shapes.parquet`` of ``python -m pipeline.tools.shapes``
  (:func:`shapes_page`; metadata: world, max_dims, overrides, git; the machine comes
  from the run records its ``solve_dir`` column names);
* the report's ``runs.parquet`` (:func:`runs_page`; one row per run record, whose
  ``environment.*`` and ``git.*`` columns give the machine and revision);
* the pipeline search's ``bench/pipeline_search.parquet`` of
  ``benchmarks/pipeline_search.py`` (:mod:`pipeline.tools.results.pipeline_search`;
  discovered here, read there).

Nothing is recomputed: the page shows the source's values, formatted
(:data:`pipeline.tools.results.page.FORMATS`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pipeline.core import runtime
from pipeline.tools.results.page import NOT_RECORDED, Column, Page, display_command

__all__ = ["BENCH_COLUMNS", "PIPELINE_SEARCH_TABLE", "RUNS_COLUMNS", "SHAPES_COLUMNS",
           "bench_page", "discover", "runs_page", "shapes_page"]

#: File name of the pipeline search's table under ``bench/`` (a ``pipeline`` source).
PIPELINE_SEARCH_TABLE = "pipeline_search.parquet"

#: Columns of a benchmark page (the bench table's, less bookkeeping).
BENCH_COLUMNS: tuple[Column, ...] = (
    Column("case_index", "#", "int"), Column("model", "model"),
    Column("n_layers", "layers", "int"), Column("mesh", "mesh"), Column("solver", "solver"),
    Column("backend", "backend"), Column("cost_mode", "cost mode"),
    Column("nodes", "nodes", "int"), Column("groups", "groups", "int"),
    Column("group_strategies", "strategies", "int"),
    Column("factors_materialised", "factors", "int"),
    Column("trace", "trace s", "s"), Column("topology", "topology s", "s"),
    Column("cost_build", "cost_build s", "s"), Column("factor_build", "factor_build s", "s"),
    Column("solve", "solve s", "s"), Column("search_total", "search_total s", "s"),
    Column("wall", "wall s", "s"), Column("cpu", "cpu s", "s"),
    Column("peak_rss_mib", "peak RSS MiB", "mib"), Column("objective", "objective µs", "us"),
    Column("gap", "gap", "gap"), Column("status", "status"),
    Column("placement_hash", "placement hash", "hash"),
)

#: Columns of a mesh-shape page (``error`` is added when a shape was not planned).
SHAPES_COLUMNS: tuple[Column, ...] = (
    Column("rank", "rank", "int"), Column("mesh", "mesh"), Column("mesh_names", "dim names"),
    Column("step_time_us", "step time µs", "us"), Column("tie", "tie"),
    Column("step_time_gap", "step-time gap", "gap"), Column("objective", "objective µs", "us"),
    Column("compute_us", "compute µs", "us"), Column("comm_us", "comm µs", "us"),
    Column("transition_us", "transition µs", "us"), Column("status", "status"),
    Column("gap", "gap", "gap"), Column("run_id", "run id"),
)

#: Default columns of a runs page (``--columns`` picks others of ``runs.parquet``).
RUNS_COLUMNS: tuple[Column, ...] = (
    Column("run_id", "run id"), Column("model", "model"), Column("mesh", "mesh"),
    Column("hardware", "hardware"), Column("solver", "solver"),
    Column("cost_mode", "cost mode"), Column("recipe", "recipe"),
    Column("status", "status"), Column("objective", "objective µs", "us"),
    Column("gap", "gap", "gap"), Column("step_time_us", "step time µs", "us"),
    Column("exposed_comm_us", "exposed comm µs", "us"),
    Column("tokens_per_s_per_device", "tokens/s/device", "rate"),
    Column("memory.peak_bytes", "peak memory GiB", "gib"),
    Column("memory.reserved_bytes", "reserved GiB", "gib"),
    Column("phases.search_total", "search_total s", "s"),
    Column("peak_rss_bytes.max", "peak RSS GiB", "gib"),
)

def _read(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows and ``pipeline`` schema metadata of a Parquet file."""
    table = runtime.read_parquet(path)
    meta = json.loads((table.schema.metadata or {}).get(b"pipeline", b"{}"))
    return table.to_pylist(), meta


def _distinct(values: Iterable[str | None]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v for v in values if v))


def _git_text(revision: str | None, dirty: Any) -> str | None:
    if not revision:
        return None
    return str(revision)[:10] + (" (dirty)" if dirty else "")


def _machine_text(cpu_model: str | None, cpu_count: Any) -> str | None:
    if not cpu_model:
        return None
    return f"{cpu_model}, {cpu_count} logical CPUs" if cpu_count else str(cpu_model)


# --------------------------------------------------------------------------- bench


def bench_page(path: Path, name: str | None, page_command: str,
               title: str | None = None) -> Page:
    """The page of a benchmark table (``<suite>.parquet``); default name ``bench-<suite>``,
    default title ``Benchmark `<suite>```."""
    rows, meta = _read(path)
    suite = meta.get("suite") or path.stem
    m = meta.get("machine") or {}
    machine = _machine_text(m.get("cpu_model"), m.get("cpu_count"))
    if machine is not None:
        mem = f", {m['memory_bytes'] / 2**30:.1f} GiB RAM" if m.get("memory_bytes") else ""
        machine += (f" ({m.get('usable_cores')} usable){mem}; {m.get('platform')}; python "
                    f"{m.get('python')}, torch {m.get('torch')}, highspy {m.get('highspy')}, "
                    f"pulp {m.get('pulp')}")
    suite_git = m.get("git") or {}
    revisions = _distinct([_git_text(suite_git.get("revision"), suite_git.get("dirty")),
                           *(_row_revision(r.get("revision")) for r in rows)])
    mode = ("a fresh results directory per case (nothing reused)" if meta.get("fresh")
            else "one shared results directory (stages reused: see the `reused` column of "
                 "the source)")
    state = ("complete" if meta.get("complete")
             else f"incomplete: {len(rows)} of {meta.get('cases')} cases")
    notes = (
        f"suite `{suite}`: {meta.get('description', NOT_RECORDED)}; {state}; {mode}",
        f"started {meta.get('started', NOT_RECORDED)}, finished "
        f"{meta.get('finished', NOT_RECORDED)}; 1-minute load average "
        f"{_load(meta.get('load_start'))} at start, {_load(meta.get('load_end'))} at end",
        "seconds: phases as recorded in each run.json, `wall` and `cpu` of the case's "
        "process as measured by the runner; peak RSS of the process tree (os.wait4)",
    )
    listing = [f"#{r['case_index']} `{r['case']}`"
               + (f": error: {r['error']}" if r.get("error") else "") for r in rows]
    return Page(name=name or f"bench-{suite}", title=title or f"Benchmark `{suite}`",
                page_command=page_command, source=path,
                produced_by=display_command(meta.get("command") or NOT_RECORDED),
                revisions=revisions, machines=() if machine is None else (machine,),
                columns=BENCH_COLUMNS, rows=tuple(rows), notes=notes,
                listing=tuple(listing))


def _row_revision(text: str | None) -> str | None:
    """A bench row's ``revision`` (``<12 hex>[+dirty]``) as :func:`_git_text` writes it."""
    if not text:
        return None
    rev, _, dirty = str(text).partition("+")
    return _git_text(rev, dirty == "dirty")


def _load(value: Any) -> str:
    return NOT_RECORDED if value is None else f"{float(value):.2f}"


# --------------------------------------------------------------------------- shapes


def _record(solve_dir: Any) -> dict[str, Any]:
    """The run record in ``solve_dir``, ``{}`` when it cannot be read."""
    if not solve_dir:
        return {}
    try:
        return json.loads((Path(solve_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def shapes_page(path: Path, name: str | None, page_command: str,
                title: str | None = None) -> Page:
    """The page of a mesh-shape table (``.../shapes/<model>-<h8>/w<W>-d<D>/shapes.parquet``);
    default name ``shapes-<model>-w<W>-d<D>``."""
    rows, meta = _read(path)
    model = path.parent.parent.name.rsplit("-", 1)[0]
    world, max_dims = meta.get("world"), meta.get("max_dims")
    records = [_record(r.get("solve_dir")) for r in rows]
    envs = [rec.get("environment") or {} for rec in records]
    gits = [rec.get("git") or {} for rec in records]
    sweep_git = meta.get("git") or {}
    revisions = _distinct([_git_text(sweep_git.get("revision"), sweep_git.get("dirty")),
                           *(_git_text(g.get("revision"), g.get("dirty")) for g in gits)])
    machines = _distinct(_machine_text(e.get("cpu_model"), e.get("cpu_count")) for e in envs)
    argv = ["python", "-m", "pipeline.tools.shapes", f"world={world}", f"max_dims={max_dims}",
            *(meta.get("overrides") or [])]
    columns = SHAPES_COLUMNS + ((Column("error", "why not planned"),)
                                if any(r.get("error") for r in rows) else ())
    listing = [f"{r['mesh']}: run `{r['run_id']}`" if r.get("run_id")
               else f"{r['mesh']}: not planned" for r in rows]
    notes = (f"model `{model}`, world size {world}, 1 to {max_dims} mesh dims, fastest "
             "simulated step first (`tie`: within costs.step_time_uncertainty of the fastest "
             "of its rank; not measured)",)
    return Page(name=name or f"shapes-{model}-w{world}-d{max_dims}",
                title=title or f"Mesh shapes of {world} devices ({model})",
                page_command=page_command,
                source=path, produced_by=shlex.join(argv), revisions=revisions,
                machines=machines, columns=columns, rows=tuple(rows), notes=notes,
                listing_title="Runs", listing=tuple(listing))


# --------------------------------------------------------------------------- runs


def runs_page(path: Path, name: str | None, page_command: str,
              columns: Sequence[str] | None = None, produced_by: str | None = None,
              title: str | None = None) -> Page:
    """The page of the report's ``runs.parquet``: one row per run, the
    :data:`RUNS_COLUMNS` (or ``columns``, names of ``runs.parquet``) that the table has;
    default name ``runs``. ``produced_by`` names the command that made the runs (default:
    the report stage over the results directory)."""
    rows, meta = _read(path)
    present = set().union(*(r.keys() for r in rows)) if rows else set()
    if columns:
        unknown = [c for c in columns if c not in present]
        if unknown:
            raise ValueError(f"--columns={','.join(columns)}: {', '.join(unknown)} not in "
                             f"{path.name}; allowed {', '.join(sorted(present))}")
        known = {c.key: c for c in RUNS_COLUMNS}
        chosen = tuple(known.get(c) or Column(c, c, _guess_format(rows, c)) for c in columns)
    else:
        chosen = tuple(c for c in RUNS_COLUMNS if c.key in present)
    results_dir = path.parent.parent
    revisions = _distinct(_git_text(r.get("git.revision"), r.get("git.dirty")) for r in rows)
    machines = _distinct(_machine_text(r.get("environment.cpu_model"),
                                       r.get("environment.cpu_count")) for r in rows)
    made_by = produced_by or display_command(
        ["python", "-m", "pipeline.cli", "report", f"results_dir={results_dir.resolve()}"])
    listing = [f"`{r.get('run_id')}`: " + _run_key(r.get("solve_dir")) for r in rows]
    report_git = meta.get("git") or {}
    notes = (f"{len(rows)} runs; report written at git "
             f"{_git_text(report_git.get('revision'), report_git.get('dirty')) or NOT_RECORDED}",)
    return Page(name=name or "runs", title=title or f"Runs of `{path.name}`",
                page_command=page_command, source=path, produced_by=made_by,
                revisions=revisions, machines=machines, columns=chosen, rows=tuple(rows),
                notes=notes, listing_title="Runs", listing=tuple(listing))


def _guess_format(rows: list[dict[str, Any]], key: str) -> str:
    value = next((r.get(key) for r in rows if r.get(key) is not None), None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "text"
    return "int" if isinstance(value, int) else "us" if key.endswith("_us") else "num"


def _run_key(solve_dir: Any) -> str:
    """The run's directory from ``runs/`` on (``runs/<model>-<h8>/.../<solver>-<h8>``),
    whatever results directory it was solved in."""
    if not solve_dir:
        return NOT_RECORDED
    parts = Path(solve_dir).parts
    if "runs" not in parts:
        return f"`{Path(solve_dir).name}`"
    start = len(parts) - 1 - parts[::-1].index("runs")
    return "`" + "/".join(parts[start:]) + "`"


# --------------------------------------------------------------------------- discovery


def discover(results_dir: Path) -> list[tuple[str, Path]]:
    """Every source under ``results_dir``, as ``(kind, path)``: the benchmark tables
    ``bench/<suite>.parquet`` (``bench/pipeline_search.parquet`` as kind ``pipeline``),
    the shape tables ``shapes/*/*/shapes.parquet`` and the report's
    ``report/runs.parquet``, in that order."""
    found = [("pipeline" if p.name == PIPELINE_SEARCH_TABLE else "bench", p)
             for p in sorted((results_dir / "bench").glob("*.parquet"))]
    found += [("shapes", p) for p in sorted((results_dir / "shapes").glob("*/*/shapes.parquet"))]
    runs = results_dir / "report" / "runs.parquet"
    if runs.is_file():
        found.append(("runs", runs))
    return found
