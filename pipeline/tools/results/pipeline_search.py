"""The pipeline-search page: ``pipeline_search.parquet`` of ``benchmarks/pipeline_search.py``
(one row per case, pipeline degree, stage plan and schedule: the split of the layers
over the stages, the simulated and closed-form bubble, the simulated step, tokens/s per
device, the peak per pipeline rank; schema metadata ``pipeline``: command, machine, git,
times, load). The search time and stage solves of each case are listed under the table.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.tools.results.page import NOT_RECORDED, Column, Page, display_command, format_cell
from pipeline.tools.results.sources import _distinct, _git_text, _load, _machine_text, _read

__all__ = ["PIPELINE_COLUMNS", "REQUIRED", "pipeline_page"]

#: Columns of a pipeline-search page.
PIPELINE_COLUMNS: tuple[Column, ...] = (
    Column("case", "case"), Column("pp", "pp", "int"), Column("mesh", "mesh"),
    Column("microbatches", "microbatches", "int"),
    Column("microbatch_size", "microbatch size", "int"),
    Column("stage_plan", "stage plan"), Column("schedule", "schedule"),
    Column("virtual_stages", "v", "int"), Column("fits", "fits"),
    Column("split", "split (layer boundaries)"),
    Column("bubble", "bubble (simulated)", "frac"),
    Column("closed_form_bubble", "bubble (closed form)", "frac"),
    Column("step_time_us", "step ms", "ms"),
    Column("tokens_per_s_per_device", "tokens/s/GPU", "rate"),
    Column("peak_bytes_per_rank", "peak GiB per pp rank", "gib_list"),
    Column("stage_solve_s", "stage solve s", "s"),
    Column("stage_solve_ran", "stage solve run now"),
    Column("why", "why none fits"),
)

#: Source columns a table must have to be read as a pipeline-search table.
REQUIRED = ("case", "pp", "mesh", "stage_plan", "schedule", "fits", "step_time_us",
            "peak_bytes_per_rank")


def pipeline_page(path: Path, name: str | None, page_command: str,
                  title: str | None = None) -> Page:
    """The page of a pipeline-search table; default name ``pipeline-search``."""
    rows, meta = _read(path)
    present = set().union(*(r.keys() for r in rows)) if rows else set()
    missing = [c for c in REQUIRED if c not in present]
    if missing:
        raise ValueError(f"not a pipeline_search table: no column {', '.join(missing)} "
                         "(benchmarks/pipeline_search.py writes them)")
    m = meta.get("machine") or {}
    machine = _machine_text(m.get("cpu_model"), m.get("cpu_count"))
    if machine is not None:
        mem = f", {m['memory_bytes'] / 2**30:.1f} GiB RAM" if m.get("memory_bytes") else ""
        machine += (f" ({m.get('usable_cores')} usable){mem}; {m.get('platform')}; python "
                    f"{m.get('python')}, torch {m.get('torch')}, highspy {m.get('highspy')}")
    table_git = m.get("git") or {}
    revisions = _distinct([_git_text(table_git.get("revision"), table_git.get("dirty")),
                           *(_git_text(r.get("revision"), r.get("dirty")) for r in rows)])
    cases = list(dict.fromkeys(r["case"] for r in rows))
    state = ("complete" if meta.get("complete")
             else f"incomplete: {len(cases)} of {len(meta.get('cases') or []) or '?'} cases")
    notes = (
        f"{state}; started {meta.get('started', NOT_RECORDED)}, finished "
        f"{meta.get('finished', NOT_RECORDED)}; 1-minute load average "
        f"{_load(meta.get('load_start'))} at start, {_load(meta.get('load_end'))} at end",
        "predicted, not measured: step, bubble and peaks are the cost model's simulation "
        "of the schedule (pipeline/stages/solve/pipeline_search.py); the closed-form "
        "bubble is (p - 1) / (v m + p - 1); peak GiB per pipeline rank, first to last; "
        "pp 1 is the plain SPMD run of the whole batch",
        "seconds (stage solve, search) are wall-clock on the machine above",
    )
    listing = []
    for case in cases:
        first = next(r for r in rows if r["case"] == case)
        listing.append(
            f"`{case}`: search {format_cell('s', first.get('case_search_s'))} s, "
            f"{_count(first.get('case_stage_solves'))} stage solves "
            f"({_count(first.get('case_stage_solves_run'))} run now, the others reused)")
    return Page(name=name or "pipeline-search",
                title=title or "Pipeline search (benchmarks/pipeline_search.py)",
                page_command=page_command, source=path,
                produced_by=display_command(meta.get("command") or NOT_RECORDED),
                revisions=revisions, machines=() if machine is None else (machine,),
                columns=PIPELINE_COLUMNS, rows=tuple(rows), notes=notes,
                listing=tuple(listing))


def _count(value: object) -> str:
    return NOT_RECORDED if value is None else str(value)
