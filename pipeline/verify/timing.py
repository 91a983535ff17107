"""The measured step of verify's ``--measure``: the plan applied to the real module and
timed on the gloo processes, beside the step time the cost model predicted.

What is timed (:func:`time_rank`, on every rank): the model built with the seeded
weights and parallelized as planned (:func:`pipeline.apply.parallelize`, the plan's own
mixed precision and the run's activation checkpointing), then ``warmup`` untimed steps
and ``steps`` timed ones. One step is what the cost model prices: ``zero_grad``, the
forward with the loss, ``backward()`` (no optimizer step: the traced joint graph has
none). Every rank enters a barrier before the step and another after it; the rank's
time is from leaving the first barrier to the end of its backward (``perf_counter``),
so the barrier's own latency is not counted. Beside the wall time, the rank's CPU time
of the step (``time.process_time``: the time the process ran, all its threads) is
recorded: wall minus CPU is time the rank did not run (descheduled on a loaded machine,
or blocked in a collective waiting for a slower rank).

Statistic (:func:`summarise`): a step's time is its slowest rank's (the step ends when
every rank has finished, as calibrate's collective samples do); reported are the
median of the timed steps, their minimum, maximum and interquartile range (quartiles of
``statistics.quantiles(..., n=4, method="inclusive")``).

Predicted (:func:`predicted_step`): the run record's ``step_time_us`` (``run.json``
beside the plan), i.e. the step time under the run's ``hardware``; compare it with the
measurement only when that is the profile of the machine that ran verify
(``hardware=cpu_epyc2`` here, calibrated with ``python -m pipeline.calibrate``, with
``overlap: false`` for gloo). ``verify.json`` names that hardware, its tables' device
and date, and the machine's load average around the measurement (a loaded machine
inflates the measured times; docs/cost-model.md).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_WARMUP", "load_average", "predicted_step", "summarise", "time_rank",
           "timing_record"]

#: Untimed steps before the timed ones (first-call allocations, FSDP2 lazy init).
DEFAULT_WARMUP = 2


def time_rank(rank: int, job: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """Time the applied step on this rank (module docstring): ``{"step_s": [...]}``."""
    import torch.distributed as dist

    from pipeline.apply.parallelize import parallelize
    from pipeline.verify.models import build_real_model, real_inputs

    model = build_real_model(job["model_cfg"], job["seed"])
    inputs = real_inputs(job["model_cfg"], job["seed"])
    parallelize(model, job["plan"], mesh, nodes=job["nodes"],
                activation_checkpointing=job.get("activation_checkpointing", "none"))
    times, cpu = [], []
    for i in range(int(job["warmup"]) + int(job["measure"])):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        model.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        took, ran = time.perf_counter() - t0, time.process_time() - c0
        dist.barrier()
        if i >= int(job["warmup"]):
            times.append(took)
            cpu.append(ran)
    return {"step_s": times, "cpu_s": cpu}


def summarise(per_rank: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The statistic of the module docstring over ``per_rank[r][i]`` (seconds): each
    step's slowest rank, then median, min, max and quartiles, in ms."""
    steps = [max(ts) * 1e3 for ts in zip(*per_rank, strict=True)]
    if not steps:
        raise ValueError("timing: no timed step")
    q1, _, q3 = (statistics.quantiles(steps, n=4, method="inclusive") if len(steps) > 1
                 else (steps[0], steps[0], steps[0]))
    return {"steps": len(steps), "step_ms": steps, "median_ms": statistics.median(steps),
            "min_ms": min(steps), "max_ms": max(steps), "q1_ms": q1, "q3_ms": q3}


def predicted_step(solve_dir: Path, hardware: Any) -> dict[str, Any]:
    """The run's predicted step (``run.json`` ``step_time_us``) and the hardware it was
    predicted under (name, ``overlap``, the tables' device and date, or constants)."""
    path = Path(solve_dir) / "run.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    us = record.get("step_time_us")
    tables = getattr(hardware, "tables", None)
    return {
        "predicted_ms": float(us) / 1e3 if isinstance(us, (int, float)) else None,
        "predicted_source": f"{path} step_time_us" if us is not None else
        "none (the run record has no step time)",
        "hardware": str(hardware.name),
        "overlap": bool(getattr(hardware, "overlap", True)),
        "profile": ({"device": str(tables["device"]), "date": str(tables["date"])}
                    if tables is not None else "constants (no measured tables)"),
    }


def timing_record(ranks: Sequence[dict[str, Any]], warmup: int, predicted: dict[str, Any],
                  load: dict[str, Any]) -> dict[str, Any]:
    """``verify.json``'s ``timing``: the measured statistic beside the prediction and
    ``ratio = predicted / measured median``; ``error`` when a rank failed to time."""
    errors = [r["timing"]["error"] for r in ranks if "error" in r.get("timing", {})]
    out: dict[str, Any] = {"warmup": int(warmup), **predicted, "load_average": load,
                           "what": "slowest rank per step of zero_grad + forward + loss + "
                                   "backward of the applied module, barrier before and "
                                   "after each step (pipeline/verify/timing.py)"}
    if errors:
        out["error"] = errors[0]
        return out
    out.update(summarise([r["timing"]["step_s"] for r in ranks]))
    # per rank, the median CPU time of its steps (ms): the work the rank itself ran
    out["cpu_median_ms"] = [statistics.median(r["timing"]["cpu_s"]) * 1e3 for r in ranks]
    p = out.get("predicted_ms")
    out["ratio"] = p / out["median_ms"] if p is not None and out["median_ms"] > 0 else None
    return out


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (``os.getloadavg``)."""
    return [round(x, 2) for x in os.getloadavg()]
