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
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

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


def _point(name: str, model: str, world: int, tp: int, pp: int, batch: dict, mb: int,
           recipe: str | None, args: argparse.Namespace, solves: set) -> tuple[bool, int]:
    """One (degree, microbatch size, stage plan) point: its stage solve and search;
    (whether a candidate fits, stage solves run now)."""
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
    if pp == 1:
        mem = rec["memory"]["peak_bytes"] / 2**30
        print(f"pp 1 mesh {rec['mesh']} batch {cfg.model.batch_size}: step "
              f"{rec['step_time_us'] / 1e3:.1f} ms, {rec['tokens_per_s_per_device']:.0f} "
              f"tokens/s/GPU, peak {mem:.1f} GiB (stage solve {took:.0f} s)")
        return True, ran
    rows = search_pipeline(cfg, rec, int(sub.model.batch_size) // data_parallel_degree(sub),
                           CANDIDATES)
    for row in rows:
        head = (f"pp {pp} mesh {'x'.join(map(str, cfg.mesh))} m {m} (microbatch {mb}) "
                f"stage plan {recipe or 'solved'} {row['schedule']} v "
                f"{row['virtual_stages']}")
        if not row["fits"]:
            print(f"{head}: {row['why']} (stage solve {took:.0f} s)")
            continue
        r = row["record"]
        pl = r["pipeline"]
        peaks = ", ".join(f"{x['peak_bytes'] / 2**30:.1f}" for x in pl["ranks"])
        print(f"{head}: split {pl['split']}, bubble {pl['bubble_fraction']:.4f} (closed form "
              f"{pl['closed_form_bubble']:.4f}), step {r['step_time_us'] / 1e3:.1f} ms, "
              f"{r['tokens_per_s_per_device']:.0f} tokens/s/GPU, peak GiB per rank "
              f"[{peaks}] (stage solve {took:.0f} s)")
    return any(r["fits"] for r in rows), ran


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama70b,llama405b")
    ap.add_argument("--results-dir", default="/tmp/pp-bench")
    ap.add_argument("--microbatch-sizes", default="1")
    args = ap.parse_args()
    sizes = [int(x) for x in args.microbatch_sizes.split(",")]
    for name in args.cases.split(","):
        model, world, tp, degrees, batch = CASES[name]
        start = time.perf_counter()
        solves, ran = set(), 0
        print(f"== {name} on {world} H100 (tp {tp}), seq 8192, full AC")
        for pp in degrees:
            for mb in (sizes if pp > 1 else [0]):
                for recipe in (None, "fsdp_tp"):
                    fitted, n = _point(name, model, world, tp, pp, batch, mb, recipe, args,
                                       solves)
                    ran += n
                    if fitted or pp == 1:
                        break
        print(f"{name}: search {time.perf_counter() - start:.0f} s, {len(solves)} stage "
              f"solves ({ran} run now, the others reused)")


if __name__ == "__main__":
    main()
