"""The split, schedule and virtual stages of a pipeline searched from one stage solve
(docs/pipelining.md, "Search").

Given a stage solve's per-layer profile (:mod:`pipeline.stages.solve.profile`; one
solve per sub-mesh and microbatch size) and a pipelined config (degree ``p``, ``m``
microbatches), each candidate ``(schedule, v)`` gets its split from the exact dynamic
program over layer boundaries (:func:`pipeline.costmodel.pipeline_split.best_split`,
Alpa's latency ``sum t_s + (m - 1) max t_s``) with

* ``t(n, first, last) = n x (mean per-layer fwd + bwd) + the first / last segment's``
  (the repeated layers are one problem: their profiled times are equal up to rounding);
* ``fits(s, n)``: stage ``s`` with ``n`` mean layers, holding the most microbatches in
  flight its rank's order gives it (:func:`stage_in_flight`: GPipe ``m``, 1F1B ``p -
  s``, interleaved per virtual stage), its state, the transient and the unsharded FSDP
  parameters and gradients (``gathered_bytes``, pipeline/stages/solve/pipelined.py),
  reserved ``(1 + memory.reserve_fraction) x`` within the device's memory
  (``constraints.device_memory``, else the hardware's ``device_memory_bytes``).

The DP's split is then priced exactly (:func:`pipeline.stages.solve.pipelined.
pipelined_record`: the event simulation, every rank's memory walk) and the candidates
ranked by the simulated step; a candidate whose simulated memory does not fit is kept
with its reason. Torch-free and cheap (no solve): the search's cost is its stage solves.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from omegaconf import OmegaConf

from pipeline.core.dtypes import itemsize
from pipeline.core.errors import PlanError
from pipeline.costmodel.pipeline_split import best_split
from pipeline.costmodel.schedules import check_schedule, rank_orders
from pipeline.stages.solve.pipelined import STATE_KINDS, pipelined_record

__all__ = ["search_pipeline", "stage_in_flight"]


def stage_in_flight(schedule: str, p: int, m: int, v: int) -> list[int]:
    """For each of the ``p v`` stages, the most microbatches whose saved activations it
    holds at once under its rank's order (forward: one more, backward: one fewer)."""
    out = [0] * (p * v)
    for order in rank_orders(schedule, p, m, v):
        live: dict[int, int] = {}
        for op in order:
            live[op.stage] = live.get(op.stage, 0) + (1 if op.kind == "F" else -1)
            out[op.stage] = max(out[op.stage], live[op.stage])
    return out


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def _limit(cfg: Any) -> float:
    from pipeline.memory.options import parse_bytes

    text = cfg.constraints.get("device_memory")
    raw = parse_bytes(text) if text is not None else int(cfg.hardware.device_memory_bytes)
    return raw / (1.0 + float(cfg.memory.get("reserve_fraction", 0.0) or 0.0))


def _dp_split(profile: dict[str, Any], cfg: Any, p: int, m: int, schedule: str,
              v: int) -> list[int] | None:
    per = profile["per_layer"]
    L = len(profile["layers"])
    t_layer = _mean([f + b for f, b in zip(per["fwd_us"], per["bwd_us"])])

    def seg_t(seg: dict[str, Any]) -> float:
        return float(seg["fwd_us"]) + float(seg["bwd_us"])

    def stage_time(n: int, first: bool, last: bool) -> float:
        return (n * t_layer + (seg_t(profile["first"]) if first else 0.0)
                + (seg_t(profile["last"]) if last else 0.0))

    def kind(seg: dict[str, Any], names: tuple[str, ...]) -> float:
        return math.fsum(float(seg["bytes"].get(k, 0.0)) for k in names)

    layer_state = _mean([kind({"bytes": b}, STATE_KINDS) for b in per["bytes"]])
    layer_act = _mean([kind({"bytes": b}, ("saved_activations",)) for b in per["bytes"]])
    scale = 1 + itemsize(str(cfg.model.reduce_dtype)) / itemsize(str(cfg.model.param_dtype))
    layer_unsharded = _mean(per["gathered_bytes"]) * scale  # parameters + gradients
    layer_transient = max(per["transient_bytes"])
    flights = stage_in_flight(schedule, p, m, v)
    limit = _limit(cfg)
    S = p * v

    def fits(s: int, n: int) -> bool:
        extra = [profile["first"]] if s == 0 else []
        extra += [profile["last"]] if s == S - 1 else []
        state = n * layer_state + sum(kind(e, STATE_KINDS) for e in extra)
        act = n * layer_act + sum(kind(e, ("saved_activations",)) for e in extra)
        unsharded = n * layer_unsharded + sum(float(e["gathered_bytes"]) for e in extra) * scale
        transient = max([layer_transient] + [float(e["transient_bytes"]) for e in extra])
        return state + flights[s] * act + unsharded + transient <= limit

    found = best_split(L, S, m, stage_time, fits)
    return list(found.boundaries) if found is not None else None


def search_pipeline(cfg: Any, stage_record: dict[str, Any], local_microbatch: int,
                    candidates: list[tuple[str, int]],
                    stage_solves: int = 1) -> list[dict[str, Any]]:
    """Each candidate ``(schedule, virtual stages)`` with its DP split priced (module
    docstring), best (smallest simulated step among those that fit) first.

    Returns rows ``{"schedule", "virtual_stages", "split", "fits", "why", "record"}``
    (``record``: :func:`pipelined_record`'s fields; ``None`` when nothing fits).
    """
    profile = stage_record["layer_profile"]
    p, m = int(cfg.mesh[0]), int(cfg.pipeline.microbatches)
    rows = []
    for schedule, v in candidates:
        row: dict[str, Any] = {"schedule": schedule, "virtual_stages": v, "split": None,
                               "fits": False, "why": None, "record": None}
        rows.append(row)
        try:
            check_schedule(schedule, p, m, v)
        except ValueError as err:
            row["why"] = str(err)
            continue
        if p * v > len(profile["layers"]):
            row["why"] = f"{p * v} stages, more than the {len(profile['layers'])} layers"
            continue
        split = _dp_split(profile, cfg, p, m, schedule, v)
        if split is None:
            row["why"] = "no split fits the device memory"
            continue
        row["split"] = split
        c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        c.pipeline.schedule, c.pipeline.virtual_stages = schedule, v
        c.pipeline.split = copy.copy(split)
        c.constraints.device_memory = cfg.constraints.get("device_memory") or int(
            cfg.hardware.device_memory_bytes)
        try:
            row["record"] = pipelined_record(c, stage_record, local_microbatch, stage_solves)
            row["fits"] = True
        except PlanError as err:
            row["why"] = str(err)
    rows.sort(key=lambda r: (not r["fits"], r["record"]["step_time_us"] if r["fits"]
                             else math.inf))
    return rows
