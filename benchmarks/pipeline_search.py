"""The joint pipeline search of issue #26, printed (docs/pipelining.md, "Search").

    PYTHONPATH=$PWD python benchmarks/pipeline_search.py [--cases llama70b,llama405b]
        [--results-dir /tmp/pp-bench] [--microbatch-sizes 1]

* llama70b on 256 H100 (tp 8): pp 1, 2, 4, 8 x data parallel, a local batch of 16 per
  tensor-parallel group (global batch 16 x dp), seq 8192, full activation checkpointing;
* llama405b on 512 H100: pp 8 x dp 8 x tp 8, global batch 256, seq 8192, full AC.

Per degree and microbatch size, one stage solve (trace, topology, costs, solve of the
whole model on the sub-mesh, one microbatch: pipeline/config/pipeline_stage.py; reused
when current); then for 1F1B and interleaved 1F1B (2 virtual stages) the split from the
DP over layer boundaries, priced by the schedule's simulation
(pipeline/stages/solve/pipeline_search.py). When no candidate of the solved stage plan
fits the device, the stage solve is repeated with torchtitan's FSDP + tensor-parallel
plan pinned (``recipe=fsdp_tp``) and searched the same way. pp 1 is the plain SPMD run
of the whole batch. FSDP under a pipeline keeps its parameters gathered for the step
(``fsdp.reshard_after_forward=false``, torchtitan's default with PP); without one it
reshards (FSDP2's default). Prints per case the split, microbatches, bubble, step,
tokens/s per GPU and the peak per pipeline rank, then the search time and the stage
solves it ran.

The same rows go to a Parquet table, ``<results-dir>/bench/pipeline_search.parquet``
(``--table PATH`` for another), rewritten atomically after each case: one row per (case,
degree, stage plan, schedule), schema metadata ``pipeline`` with the command, machine,
git revision, start and end times, load averages and ``complete``.
``python -m pipeline.tools.results pipeline <table>`` renders it
(docs/results/pipeline-search.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

CASES = {
    # name: (model, world, tp, degrees, local batch per tp group or global batch)
    "llama70b": ("llama70b", 256, 8, (1, 2, 4, 8), {"local": 16}),
    "llama405b": ("llama405b", 512, 8, (8,), {"global": 256}),
}
COMMON = ("model.seq_len=8192", "memory.activation_checkpointing=full", "hardware=h100")
CANDIDATES = [("1f1b", 1), ("interleaved_1f1b", 2)]


def _overrides(model: str, world: int, tp: int, pp: int, batch: dict, mb_size: int,
               results: str) -> tuple[list[str], int]:
    dp = world // tp // pp
    global_batch = batch.get("global", batch.get("local", 0) * dp)
    local = global_batch // dp
    base = [f"model={model}", f"model.batch_size={global_batch}", *COMMON,
            f"results_dir={results}"]
    if pp == 1:
        return [*base, f"mesh={dp},{tp}", "mesh_names=[dp,tp]"], 1
    m = local // mb_size
    return [*base, f"mesh={pp},{dp},{tp}", "mesh_names=[pp,dp,tp]",
            f"pipeline.microbatches={m}", "fsdp.reshard_after_forward=false"], m


def _row(name: str, model: str, world: int, pp: int, mesh: str, m: int, mb: int,
         recipe: str | None, took: float, solve_ran: bool, git: dict) -> dict[str, Any]:
    """The table row of one point, its search fields still empty."""
    return {"case": name, "model": model, "world": world, "pp": pp, "mesh": mesh,
            "microbatch_size": mb, "microbatches": m, "stage_plan": recipe or "solved",
            "schedule": None, "virtual_stages": None, "fits": None, "why": None,
            "split": None, "bubble": None, "closed_form_bubble": None, "step_time_us": None,
            "tokens_per_s_per_device": None, "peak_bytes_per_rank": None,
            "peak_bytes_max": None, "stage_solve_s": took, "stage_solve_ran": solve_ran,
            "case_stage_solves": None, "case_stage_solves_run": None,
            "case_search_s": None, "revision": git.get("revision"),
            "dirty": git.get("dirty")}


def _point(name: str, model: str, world: int, tp: int, pp: int, batch: dict, mb: int,
           recipe: str | None, args: argparse.Namespace, solves: set,
           table: list[dict[str, Any]], git: dict) -> tuple[bool, int]:
    """One (degree, microbatch size, stage plan) point: its stage solve and search, its
    rows appended to ``table``; (whether a candidate fits, stage solves run now)."""
    from pipeline.config import load_resolved, stage_dirs
    from pipeline.config.pipeline_stage import stage_config
    from pipeline.stages.runner import run_stage
    from pipeline.stages.solve.pipeline_search import search_pipeline
    from pipeline.stages.solve.pipelined import data_parallel_degree

    overrides, m = _overrides(model, world, tp, pp, batch, mb or 1, args.results_dir)
    if recipe is not None:
        overrides.append(f"recipe={recipe}")
    cfg = load_resolved(overrides)
    sub = cfg if pp == 1 else stage_config(cfg)
    t0 = time.perf_counter()
    ran = 0
    for stage in ("trace", "topology", "costs", "solve"):
        ran += bool(run_stage(stage, sub, stage_dirs(sub))) and stage == "solve"
    solves.add(str(stage_dirs(sub).solve))
    rec = json.loads((Path(stage_dirs(sub).solve) / "run.json").read_text())
    took = time.perf_counter() - t0
    mesh = "x".join(map(str, cfg.mesh))
    if pp == 1:
        row = _row(name, model, world, pp, mesh, m, int(cfg.model.batch_size) // (world // tp),
                   recipe, took, bool(ran), git)
        row.update(fits=True, step_time_us=rec["step_time_us"],
                   tokens_per_s_per_device=rec["tokens_per_s_per_device"],
                   peak_bytes_per_rank=[int(rec["memory"]["peak_bytes"])],
                   peak_bytes_max=int(rec["memory"]["peak_bytes"]))
        table.append(row)
        mem = rec["memory"]["peak_bytes"] / 2**30
        print(f"pp 1 mesh {rec['mesh']} batch {cfg.model.batch_size}: step "
              f"{rec['step_time_us'] / 1e3:.1f} ms, {rec['tokens_per_s_per_device']:.0f} "
              f"tokens/s/GPU, peak {mem:.1f} GiB (stage solve {took:.0f} s)")
        return True, ran
    rows = search_pipeline(cfg, rec, int(sub.model.batch_size) // data_parallel_degree(sub),
                           CANDIDATES)
    for row in rows:
        out = _row(name, model, world, pp, mesh, m, mb, recipe, took, bool(ran), git)
        out.update(schedule=row["schedule"], virtual_stages=int(row["virtual_stages"]),
                   fits=bool(row["fits"]), why=row.get("why"))
        table.append(out)
        head = (f"pp {pp} mesh {mesh} m {m} (microbatch {mb}) "
                f"stage plan {recipe or 'solved'} {row['schedule']} v "
                f"{row['virtual_stages']}")
        if not row["fits"]:
            print(f"{head}: {row['why']} (stage solve {took:.0f} s)")
            continue
        r = row["record"]
        pl = r["pipeline"]
        peaks = ", ".join(f"{x['peak_bytes'] / 2**30:.1f}" for x in pl["ranks"])
        out.update(split=",".join(map(str, pl["split"])), bubble=pl["bubble_fraction"],
                   closed_form_bubble=pl["closed_form_bubble"],
                   step_time_us=r["step_time_us"],
                   tokens_per_s_per_device=r["tokens_per_s_per_device"],
                   peak_bytes_per_rank=[int(x["peak_bytes"]) for x in pl["ranks"]],
                   peak_bytes_max=max(int(x["peak_bytes"]) for x in pl["ranks"]))
        print(f"{head}: split {pl['split']}, bubble {pl['bubble_fraction']:.4f} (closed form "
              f"{pl['closed_form_bubble']:.4f}), step {r['step_time_us'] / 1e3:.1f} ms, "
              f"{r['tokens_per_s_per_device']:.0f} tokens/s/GPU, peak GiB per rank "
              f"[{peaks}] (stage solve {took:.0f} s)")
    return any(r["fits"] for r in rows), ran


def _write_table(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """The rows as Parquet, atomically, ``meta`` in the schema metadata."""
    import pyarrow as pa

    from pipeline.core import runtime

    runtime.write_parquet(path, pa.Table.from_pylist(rows), metadata=meta)


def main() -> None:
    from pipeline.core import runtime
    from pipeline.tools.bench.runner import load_1m, machine_info, now_utc

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama70b,llama405b")
    ap.add_argument("--results-dir", default="/tmp/pp-bench")
    ap.add_argument("--microbatch-sizes", default="1")
    ap.add_argument("--table", type=Path, default=None,
                    help="the Parquet table (default <results-dir>/bench/pipeline_search.parquet)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.microbatch_sizes.split(",")]
    table_path = args.table or Path(args.results_dir) / "bench" / "pipeline_search.parquet"
    git = runtime.git_revision()
    names = args.cases.split(",")
    meta: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/pipeline_search.py", *sys.argv[1:]]),
        "description": "joint pipeline search (benchmarks/pipeline_search.py)",
        "cases": names, "microbatch_sizes": sizes, "started": now_utc(),
        "load_start": load_1m(), "machine": machine_info(), "complete": False}
    table: list[dict[str, Any]] = []
    for name in names:
        model, world, tp, degrees, batch = CASES[name]
        start = time.perf_counter()
        solves, ran = set(), 0
        print(f"== {name} on {world} H100 (tp {tp}), seq 8192, full AC")
        for pp in degrees:
            for mb in (sizes if pp > 1 else [0]):
                for recipe in (None, "fsdp_tp"):
                    fitted, n = _point(name, model, world, tp, pp, batch, mb, recipe, args,
                                       solves, table, git)
                    ran += n
                    if fitted or pp == 1:
                        break
        took = time.perf_counter() - start
        for row in table:
            if row["case"] == name:
                row.update(case_stage_solves=len(solves), case_stage_solves_run=ran,
                           case_search_s=took)
        meta.update(finished=now_utc(), load_end=load_1m(), complete=name == names[-1])
        _write_table(table_path, table, meta)
        print(f"{name}: search {took:.0f} s, {len(solves)} stage "
              f"solves ({ran} run now, the others reused); table {table_path}")


if __name__ == "__main__":
    main()
