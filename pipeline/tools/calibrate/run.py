"""One calibration: measure this machine and compose its hardware profile.

The profile is a complete hardware config (:class:`~pipeline.costmodel.hardware.
HardwareConfig`: ``conf/hardware/<name>.yaml``, selected by ``hardware=<name>``) whose
``tables`` hold the measurements (:mod:`pipeline.costmodel.profile`). Its scalar keys
are derived from the tables where a measurement exists:

* ``peak_flops_fp32`` / ``peak_flops_bf16``: the best measured matmul rate of the dtype
  (forward or backward; a dtype not measured gets the other's). On a CPU no vendor peak
  applies, so the reference is the best rate this machine reached; every efficiency is
  then at most 1 and the best shape exactly 1.
* ``compute_efficiency``: the median efficiency of the forward matmul table (ops
  without a table entry, e.g. a convolution, use it).
* ``hbm_bandwidth``: the best measured copy bandwidth; ``memory_efficiency``: 1 (the
  memory table gives the bandwidth by size).
* ``kernel_floor_us``: the measured launch overhead.
* ``intra_node``: ``bandwidth`` the all-gather bus bandwidth of the largest size on the
  largest group measured, ``latency_us`` the all-gather time of the smallest size on
  the smallest group, ``hop_latency_us`` 0 (the tables carry the size dependence).
* ``gpus_per_node``: the largest group measured (one machine is one node).
* ``overlap``: false on CPU / gloo (a gloo collective blocks the thread that computes,
  pipeline/costmodel/hardware.py), true on CUDA / NCCL (collectives on their own
  stream).

From constants (listed in ``tables.from_constants``): ``device_memory_bytes`` (the
machine's memory, from the OS or the CUDA driver, not a measurement), ``nics_per_node``
(1), ``hierarchical_all_reduce`` (false) and ``inter_node`` (a copy of ``intra_node``:
one machine has no second node to measure).
"""

from __future__ import annotations

import datetime
import math
import statistics
from pathlib import Path
from typing import Any

from pipeline.costmodel.hardware import HardwareConfig
from pipeline.costmodel.profile import VERSION
from pipeline.tools.calibrate import measure
from pipeline.tools.calibrate.collectives import KINDS, collective_tables

__all__ = ["FULL", "QUICK", "calibrate", "compare_profiles", "profile_entries",
           "write_profile"]

#: Default settings: a full calibration on a 2-core CPU in under 5 minutes.
FULL = measure.Settings(min_sample_s=0.02, samples=7, mm_sizes=(32, 128, 512),
                        dtypes=("float32", "bfloat16"), attn_seqs=(64, 128, 256, 512),
                        attn_head_dims=(64,), attn_batch_heads=4,
                        mem_bytes=tuple(2**p for p in range(16, 27, 2)))
#: ``--quick``: a short calibration for CI (under a minute).
QUICK = measure.Settings(min_sample_s=0.005, samples=3, mm_sizes=(64, 256),
                         dtypes=("float32",), attn_seqs=(64, 128), attn_head_dims=(32,),
                         attn_batch_heads=2, mem_bytes=(2**16, 2**20))
FULL_SIZES = tuple(2**p for p in range(10, 25, 2))
QUICK_SIZES = (2**10, 2**16, 2**20)


def calibrate(name: str, device_name: str, backend: str, ranks: tuple[int, ...],
              quick: bool, threads: int = 1) -> dict[str, Any]:
    """Measure this machine; return the hardware config mapping (module docstring).

    On CPU the kernels run on ``threads`` threads (default 1: one gloo rank per core, as
    the collective workers and ``pipeline.verify``'s ranks run; on a shared machine more
    threads than free cores make OpenMP's barriers wait for descheduled threads, and a
    64^3 matmul took 84 ms instead of 0.08 ms here)."""
    import torch

    device = torch.device(device_name)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    st = QUICK if quick else FULL
    if device.type == "cuda" and "bfloat16" not in st.dtypes:
        st = measure.Settings(**{**st.__dict__, "dtypes": (*st.dtypes, "bfloat16")})
    clock = _Clock()
    mm = clock("matmul", measure.matmul_rows, device, st)
    attn = clock("attention", measure.attention_rows, device, st)
    mem = clock("memory", measure.memory_rows, device, st)
    launch = clock("launch", measure.launch_us, device, st)
    rates = {}
    for r in mm:
        rates[r["dtype"]] = max(rates.get(r["dtype"], 0.0), r["flops"] / (r["time_us"] * 1e-6))
    peaks = {"float32": rates.get("float32") or rates["bfloat16"],
             "bfloat16": rates.get("bfloat16") or rates["float32"]}
    measure.efficiencies(mm, peaks)
    measure.efficiencies(attn, peaks)
    for r in mm + attn:
        r.pop("flops")
    colls = []
    for n in ranks:
        colls += clock(f"collectives on {n} ranks", collective_tables, n, backend, KINDS,
                       QUICK_SIZES if quick else FULL_SIZES, st.min_sample_s, st.samples)
    gathers = [c for c in colls if c["kind"] == "all_gather"]
    big = max(gathers, key=lambda c: c["per_node"]) if gathers else None
    small = min(gathers, key=lambda c: c["per_node"]) if gathers else None
    link = {"bandwidth": big["rows"][-1]["busbw"] * 1e9 if big else 1e9,
            "latency_us": small["rows"][0]["time_us"] if small else 0.0,
            "hop_latency_us": 0.0}
    fwd = [r["efficiency"] for r in mm if r["pass"] == "fwd"]
    measured = ["matmul", "attention", "memory", "launch_us"] + (["collectives"] if colls else [])
    constants = ["device_memory_bytes", "nics_per_node", "hierarchical_all_reduce",
                 "inter_node"] + ([] if colls else ["intra_node"])
    method = (f"fastest of {st.samples} samples of >= {st.min_sample_s * 1e3:g} ms each after "
              "a warm-up (pipeline/tools/calibrate/measure.py); efficiency = FLOPs counted by "
              "the cost model / (time x peak), peak = the best measured matmul rate of the "
              "dtype; collectives: torch.distributed on spawned processes, the slowest "
              "rank's time per sample (pipeline/tools/calibrate/collectives.py)"
              + ("; --quick" if quick else ""))
    tables = {
        "version": VERSION,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": str(torch.__version__),
        "device": _describe(device),
        "method": method,
        "measured": measured,
        "from_constants": constants,
        "matmul": mm, "attention": attn, "memory": mem, "launch_us": launch,
    }
    if colls:
        tables["collectives"] = colls
    hw = {
        "name": name,
        "peak_flops_bf16": peaks["bfloat16"],
        "peak_flops_fp32": peaks["float32"],
        "hbm_bandwidth": max(r["bandwidth"] for r in mem) * 1e9,
        "device_memory_bytes": _device_memory(device),
        "compute_efficiency": statistics.median(fwd),
        "memory_efficiency": 1.0,
        "kernel_floor_us": launch,
        "gpus_per_node": max(ranks) if ranks else 1,
        "nics_per_node": 1,
        "hierarchical_all_reduce": False,
        "overlap": device.type == "cuda" and backend == "nccl",
        "intra_node": link,
        "inter_node": dict(link),
        "tables": tables,
    }
    HardwareConfig(**{**hw, "intra_node": _link(link), "inter_node": _link(link)})
    return hw


class _Clock:
    """Runs a measurement and prints how long it took (stderr)."""

    def __call__(self, what: str, fn: Any, *args: Any) -> Any:
        import sys
        import time

        t0 = time.perf_counter()
        out = fn(*args)
        print(f"calibrate: {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return out


def _link(d: dict) -> Any:
    from pipeline.costmodel.hardware import LinkConfig

    return LinkConfig(**d)


def _describe(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    import os

    from pipeline.core.runtime import cpu_model

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu: {cpu_model()}, {cpus} usable cores, {torch.get_num_threads()} threads"


def _device_memory(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def write_profile(hw: dict[str, Any], path: Path) -> None:
    """Write the profile mapping as YAML at ``path``, atomically, with a header."""
    import yaml

    from pipeline.core.runtime import atomic_path

    t = hw["tables"]
    head = (f"# Hardware profile measured by `python -m pipeline.calibrate` on {t['date']}\n"
            f"# ({t['device']}; torch {t['torch']}). Schema: pipeline.costmodel.hardware."
            "HardwareConfig;\n# tables: pipeline/costmodel/profile.py; how each key is "
            "derived: pipeline/tools/calibrate/run.py.\n")
    text = yaml.safe_dump(_rounded(hw), sort_keys=False, default_flow_style=None, width=100)
    with atomic_path(path) as tmp:
        tmp.write_text(head + text)


def _rounded(obj: Any) -> Any:
    """Floats to 4 significant digits (the measurements' own noise is larger)."""
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    if isinstance(obj, float) and obj != 0 and math.isfinite(obj):
        return float(f"{obj:.4g}")
    return obj


def profile_entries(tables: dict[str, Any]) -> dict[str, float]:
    """Every timed entry of a profile's tables by a readable key -> time in µs."""
    out = {}
    for r in tables.get("matmul", []):
        out[f"matmul {r['dtype']} {r['pass']} {r['m']}x{r['n']}x{r['k']}"] = r["time_us"]
    for r in tables.get("attention", []):
        out[f"attention {r['dtype']} {r['pass']} L={r['seq']} E={r['head_dim']} "
            f"causal={r['causal']}"] = r["time_us"]
    for r in tables.get("memory", []):
        out[f"memory {r['bytes']}"] = r["time_us"]
    if "launch_us" in tables:
        out["launch"] = tables["launch_us"]
    for c in tables.get("collectives", []):
        for r in c["rows"]:
            out[f"{c['kind']} {c['per_node']}x{c['nodes']} {r['size']}"] = r["time_us"]
    return out


def compare_profiles(a: dict[str, Any], b: dict[str, Any], above_us: float = 1000.0
                     ) -> list[tuple[str, float, float, float]]:
    """``(entry, time a, time b, |a - b| / min(a, b))`` for every entry both profiles
    have whose time is above ``above_us`` in either, largest difference first."""
    ea, eb = profile_entries(a["tables"]), profile_entries(b["tables"])
    rows = [(k, ea[k], eb[k], abs(ea[k] - eb[k]) / min(ea[k], eb[k]))
            for k in ea if k in eb and max(ea[k], eb[k]) > above_us]
    return sorted(rows, key=lambda r: -r[3])
