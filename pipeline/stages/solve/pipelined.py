"""A pipelined run priced end to end from its stage solve (docs/pipelining.md,
"Pipelined runs").

The stage solve (the config of :func:`pipeline.config.pipeline_stage.stage_config`: the
sub-mesh of the dims other than ``pp``, one microbatch) gives the per-layer profile of its
plan (:mod:`pipeline.stages.solve.profile`). Stage ``s`` of the split ``[b_0 = 0, b_1, ...,
b_S = L]`` (``S = p x v``; stage ``s`` on pp rank ``s mod p``) holds layers ``[b_s,
b_(s+1))``, plus the ``first`` segment (embedding) on stage 0 and the ``last`` (final
norm, head, loss) on stage ``S - 1``. Its :class:`~pipeline.costmodel.pipelining.StageCost`
sums its segments: ``fwd_us`` / ``bwd_us`` (compute and activation redistributions per
microbatch), ``gather_us`` (its FSDP all-gathers), ``reduce_us`` (its gradient
reductions, once per step), ``state_bytes`` (parameters, gradients, optimizer state,
buffers), ``activation_bytes`` (saved activations of one microbatch),
``unsharded_param_bytes`` and ``unsharded_grad_bytes`` (below) and ``transient_bytes``,
the largest of its segments' (the profile's rise of the live bytes within a segment).
The boundary sends are :func:`~pipeline.costmodel.pipelining.p2p_us` of one device's
hidden state ``[microbatch, seq_len, dim]`` (the pp dim's link; a send of
interleaved 1F1B from the last rank back to the first is priced as the slowest boundary).
Then :func:`~pipeline.costmodel.pipelining.pipelined_step` simulates the schedule (FSDP2
under torch's schedules with ``fsdp.reshard_after_forward``) and gives each rank's peak;
``constraints.device_memory`` bounds every rank's reserved bytes
(``(1 + memory.reserve_fraction) x peak``).

**Unsharded parameters and gradients.** Under pipelining FSDP2 keeps a stage's
gradients unsharded between microbatches (in the reduce dtype) and, with
``fsdp.reshard_after_forward=false``, its parameters gathered. Both have the shape of
what the stage's all-gathers produce, the profile's ``gathered_bytes`` (the consumers'
inputs in the compute dtype ``param_dtype``; tensor-parallel shards stay sharded):
``unsharded_param_bytes = gathered_bytes``, ``unsharded_grad_bytes = gathered_bytes x
itemsize(reduce_dtype) / itemsize(param_dtype)``; 0 for a stage that gathers nothing.

``tokens_per_s_per_device = model.batch_size x seq_len / world size / step``.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.core.dtypes import itemsize
from pipeline.core.errors import PlanError
from pipeline.costmodel.pipelining import StageCost, boundary_bytes, p2p_us, pipelined_step
from pipeline.costmodel.schedules import closed_form_bubble

__all__ = ["STATE_KINDS", "data_parallel_degree", "pipelined_record", "run_pipelined",
           "stage_costs", "stage_modules"]

#: Memory kinds that stay for the whole step (the stage's state).
STATE_KINDS = ("parameters", "gradients", "optimizer_state", "buffers")


def _segments(profile: dict[str, Any], lo: int, hi: int, first: bool,
              last: bool) -> list[dict[str, Any]]:
    per = profile["per_layer"]
    out = [{f: per[f][i] for f in ("fwd_us", "bwd_us", "gather_us", "reduce_us",
                                    "gathered_bytes", "transient_bytes")}
           | {"bytes": per["bytes"][i]} for i in range(lo, hi)]
    if first:
        out.append(profile["first"])
    if last:
        out.append(profile["last"])
    return out


def stage_costs(profile: dict[str, Any], split: list[int], param_dtype: str,
                reduce_dtype: str) -> list[StageCost]:
    """Each stage's cost from the layer profile (module docstring)."""
    n = len(split) - 1
    if len(profile["layers"]) != split[-1]:
        raise PlanError(f"pipeline.split={split}: the stage solve profiled "
                        f"{len(profile['layers'])} layers; allowed a split of them")
    scale = itemsize(reduce_dtype) / itemsize(param_dtype)
    out = []
    for s in range(n):
        segs = _segments(profile, split[s], split[s + 1], s == 0, s == n - 1)

        def total(key: str, segs: list[dict[str, Any]] = segs) -> float:
            return math.fsum(float(x[key]) for x in segs)

        def kind(k: str, segs: list[dict[str, Any]] = segs) -> float:
            return math.fsum(float(x["bytes"].get(k, 0.0)) for x in segs)

        gathered = total("gathered_bytes")
        out.append(StageCost(
            fwd_us=total("fwd_us"), bwd_us=total("bwd_us"),
            state_bytes=math.fsum(kind(k) for k in STATE_KINDS),
            activation_bytes=kind("saved_activations"),
            transient_bytes=max(float(x["transient_bytes"]) for x in segs),
            unsharded_param_bytes=gathered, unsharded_grad_bytes=gathered * scale,
            gather_us=total("gather_us"), reduce_us=total("reduce_us")))
    return out


def stage_modules(profile: dict[str, Any], split: list[int]) -> list[list[str]]:
    """The module names of each stage (llama: ``tok_embeddings``, ``layers.i``,
    ``norm``, ``output``)."""
    n = len(split) - 1
    names = profile["layers"]
    return [(["tok_embeddings"] if s == 0 else []) + list(names[split[s]:split[s + 1]])
            + (["norm", "output"] if s == n - 1 else []) for s in range(n)]


def _sends(cfg: Any, stage_batch: int, stages: int, p: int) -> list[float]:
    nbytes = boundary_bytes(stage_batch, int(cfg.model.seq_len), int(cfg.model.dim),
                            str(cfg.model.param_dtype))
    mesh = [int(d) for d in cfg.mesh]
    direct = [p2p_us(nbytes, mesh, 0, r, cfg.hardware) for r in range(p - 1)]
    slowest = max(direct, default=0.0)
    out = []
    for s in range(stages - 1):
        if (s + 1) % p == 0:
            out.append(slowest)  # the last rank back to the first (interleaved)
        else:
            out.append(direct[s % p])
    return out


def pipelined_record(cfg: Any, stage_record: dict[str, Any], local_microbatch: int,
                     stage_solves: int) -> dict[str, Any]:
    """The run record's ``pipeline`` section and top-level step fields of a pipelined
    run (module docstring): ``{"pipeline": {...}, "step_time_us", ...}``.

    Args:
        cfg: the resolved pipelined config.
        stage_record: the stage solve's ``run.json``.
        local_microbatch: samples of one microbatch on one device's pipeline.
        stage_solves: stage solves this run used (one per distinct sub-mesh and
            microbatch).

    Raises:
        PlanError: a stage over ``constraints.device_memory`` (one line).
    """
    from pipeline.memory.options import parse_bytes

    profile = stage_record["layer_profile"]
    p = int(cfg.mesh[0])
    m, v = int(cfg.pipeline.microbatches), int(cfg.pipeline.virtual_stages)
    schedule = str(cfg.pipeline.schedule)
    split = [int(b) for b in cfg.pipeline.split]
    costs = stage_costs(profile, split, str(cfg.model.param_dtype),
                        str(cfg.model.reduce_dtype))
    sends = _sends(cfg, local_microbatch, len(costs), p)
    step = pipelined_step(schedule, costs, p, m, virtual_stages=v, act_send_us=sends,
                          reshard_after_forward=bool(cfg.fsdp.reshard_after_forward))
    reserve = float(cfg.memory.get("reserve_fraction", 0.0) or 0.0)
    limit_text = cfg.constraints.get("device_memory")
    limit = parse_bytes(limit_text) if limit_text is not None else None
    modules = stage_modules(profile, split)
    ranks = []
    for r in range(p):
        mine = [s for s in range(len(costs)) if s % p == r]
        ranks.append({
            "rank": r, "stages": mine,
            "layers": [[split[s], split[s + 1]] for s in mine],
            "modules": [modules[s] for s in mine],
            "fwd_us": [costs[s].fwd_us for s in mine], "bwd_us": [costs[s].bwd_us for s in mine],
            "busy_us": step.timeline.busy_us[r], "end_us": step.timeline.end_us[r],
            "gather_us": step.gather_us[r], "reduce_us": step.reduce_us[r],
            "in_flight": step.in_flight[r], "peak_bytes": step.peak_bytes[r],
            "reserved_bytes": (1 + reserve) * step.peak_bytes[r]})
    if limit is not None:
        for row in ranks:
            if row["reserved_bytes"] > limit:
                raise PlanError(
                    f"constraints.device_memory={limit_text}: pipeline rank {row['rank']} "
                    f"(stages {row['stages']}, layers {row['layers']}) reserves "
                    f"{row['reserved_bytes'] / 2**30:.2f} GiB under {schedule} with "
                    f"{m} microbatches; allowed more memory, more pp stages or fewer "
                    "microbatches in flight")
    world = math.prod(int(d) for d in cfg.mesh)
    tokens = int(cfg.model.batch_size) * int(cfg.model.seq_len)
    per_s = tokens / world / (step.step_us * 1e-6) if step.step_us > 0 else None
    section = {
        "degree": p, "schedule": schedule, "microbatches": m, "virtual_stages": v,
        "split": split, "microbatch_size": local_microbatch,
        "stage_mesh": stage_record["mesh"], "stage_mesh_names": stage_record["mesh_names"],
        "stage_solve_dir": stage_record["solve_dir"], "stage_solves": stage_solves,
        "stage_step_time_us": stage_record["step_time_us"],
        "bubble_fraction": step.bubble_fraction,
        "closed_form_bubble": closed_form_bubble(schedule, p, m, v),
        "send_us": sends, "send_bytes": boundary_bytes(
            local_microbatch, int(cfg.model.seq_len), int(cfg.model.dim),
            str(cfg.model.param_dtype)),
        "gathers_per_step": {str(k): c for k, c in step.gathers.items()},
        "peak_bytes": step.max_peak_bytes, "ranks": ranks,
        "model": ("per-layer profile of one stage solve on the sub-mesh; the schedule's "
                  "event simulation with boundary sends, FSDP2 gathers as torch's schedules "
                  "issue them, one gradient reduction per step "
                  "(pipeline/stages/solve/pipelined.py)")}
    return {"pipeline": section, "step_time_us": step.step_us,
            "tokens_per_s_per_device": per_s, "memory_peak_bytes": step.max_peak_bytes}


def run_pipelined(cfg: Any, dirs: Any) -> None:
    """The solve stage of a pipelined config: read the stage solve (its directories from
    :func:`pipeline.config.pipeline_stage.stage_config`; the runner runs it first) and
    write, in ``dirs.solve``, the stage plan's ``solution.parquet`` and
    ``redistributions.parquet``, ``plan.json`` with a ``pipeline`` section and
    ``run.json`` (last) with the pipelined step.

    Raises:
        PlanError: the stage solve has not run, or a stage does not fit.
    """
    import json
    import shutil
    import time
    from pathlib import Path

    from omegaconf import OmegaConf

    from pipeline.config import config_hash, stage_dirs
    from pipeline.config.pipeline_stage import stage_config
    from pipeline.core import artifacts, runtime
    from pipeline.core.artifacts import PLAN, REDISTRIBUTIONS, RUN, SOLUTION

    start = time.perf_counter()
    sub = stage_config(cfg)
    sub_dirs = stage_dirs(sub)
    src = RUN.path(Path(sub_dirs.solve))
    if not src.exists():
        raise PlanError(f"{src}: the stage solve of this pipelined run has not run; run "
                        "python -m pipeline with the same overrides (it runs it first)")
    stage_record = json.loads(src.read_text())
    dp = data_parallel_degree(sub)
    fields = pipelined_record(cfg, stage_record, int(sub.model.batch_size) // dp,
                              stage_solves=1)
    out_dir = Path(dirs.solve)
    out_dir.mkdir(parents=True, exist_ok=True)
    for art in (SOLUTION, REDISTRIBUTIONS):
        with runtime.atomic_path(art.path(out_dir)) as tmp:
            shutil.copyfile(art.path(Path(sub_dirs.solve)), tmp)
    section = fields["pipeline"]
    plan = json.loads(PLAN.path(Path(sub_dirs.solve)).read_text())
    plan["pipeline"] = {
        "degree": section["degree"], "schedule": section["schedule"],
        "microbatches": section["microbatches"],
        "virtual_stages": section["virtual_stages"], "split": section["split"],
        "stages": [{"stage": s, "rank": s % section["degree"],
                    "layers": [section["split"][s], section["split"][s + 1]],
                    "modules": mods}
                   for s, mods in enumerate(stage_modules(stage_record["layer_profile"],
                                                          section["split"]))],
        "stage_mesh": section["stage_mesh"], "stage_mesh_names": section["stage_mesh_names"]}
    runtime.write_json(PLAN.path(out_dir), plan)
    record = {k: v for k, v in stage_record.items() if k not in ("layer_profile", "config")}
    record.update({
        "run_id": config_hash({"dir": str(out_dir)}), "solve_dir": str(out_dir),
        "mesh": "x".join(str(d) for d in cfg.mesh), "mesh_names": list(cfg.mesh_names),
        "stage_step_time": record.pop("step_time", None),
        "step_time_us": fields["step_time_us"],
        "tokens_per_s_per_device": fields["tokens_per_s_per_device"],
        "pipeline": section,
        "stage_memory": record.pop("memory", None)})
    reserve = float(cfg.memory.get("reserve_fraction", 0.0) or 0.0)
    record["memory"] = {"peak_bytes": fields["memory_peak_bytes"],
                        "reserved_bytes": (1 + reserve) * fields["memory_peak_bytes"],
                        "reserve_fraction": reserve}
    record["phases"] = dict(record.get("phases") or {}) | {
        "pipeline": time.perf_counter() - start}
    record["config"] = OmegaConf.to_container(cfg, resolve=True)
    artifacts.write_json(RUN, out_dir, record)


def data_parallel_degree(sub: Any) -> int:
    """The data-parallel degree of the stage config (its batch over the dims that split
    it)."""
    from pipeline.config.pipelining import data_parallel_dims

    dims = data_parallel_dims(sub.constraints.inputs, list(sub.mesh_names))
    return math.prod(int(sub.mesh[d]) for d in dims)
