"""Collective timings through ``torch.distributed`` on spawned processes, as nccl-tests
tables (size, time, algbw, busbw).

One process per rank on this machine (gloo on CPU, NCCL on CUDA: one GPU per rank), so
the group layout is ``ranks`` members per node x 1 node. Per kind and message size each
rank runs one warm-up call, then calls each started after a barrier and timed alone, at
least ``samples`` of them and for ``samples x min_sample_s`` seconds; a call's time is
the slowest rank's (an all-reduce of MAX), the entry the fastest call (why the fastest:
pipeline/tools/calibrate/measure.py).

Sizes and bandwidths follow nccl-tests ``doc/PERFORMANCE.md``: ``size`` is the bytes of
the gathered output (all_gather), of the unscattered input (reduce_scatter), of the
buffer (all_reduce), of one rank's send buffer (all_to_all); ``algbw = size / time``;
``busbw = algbw * (n-1)/n`` (``2(n-1)/n`` for all_reduce). These are the ``S`` of
:mod:`pipeline.costmodel.comm`.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

__all__ = ["KINDS", "bus_factor", "collective_tables", "max_processes"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' ``busbw / algbw``: ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` otherwise."""
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


def max_processes(backend: str) -> int:
    """How many ranks this machine holds: NCCL one per GPU; gloo two per usable CPU core
    (what ``pipeline.verify`` runs here: a 2x2 mesh on 2 cores), and no more than the
    memory holds at 1 GiB per process (a torch process with its buffers)."""
    if backend == "nccl":
        import torch

        return torch.cuda.device_count()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    avail = _mem_available()
    by_mem = avail // 2**30 if avail else 2 * (cpus or 1)
    return int(min(2 * (cpus or 1), by_mem))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call(kind: str, n: int, size: int, device: Any) -> Any:
    """A closure issuing one ``kind`` collective of nccl-tests ``size`` bytes (float32)."""
    import torch
    import torch.distributed as dist

    count = max(n, size // 4 // n * n)  # elements, a multiple of n
    if kind == "all_gather":
        out = torch.zeros(count, device=device)
        inp = torch.ones(count // n, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if kind == "reduce_scatter":
        inp = torch.ones(count, device=device)
        out = torch.zeros(count // n, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    if kind == "all_reduce":
        buf = torch.ones(count, device=device)
        return lambda: dist.all_reduce(buf)
    inp = torch.ones(count, device=device)
    out = torch.zeros(count, device=device)
    return lambda: dist.all_to_all_single(out, inp)


def _worker(rank: int, n: int, port: int, backend: str, kinds: tuple, sizes: tuple,
            min_sample_s: float, samples: int, queue: Any) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor names: still valid
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out = []
    try:
        for kind in kinds:
            rows = []
            for size in sizes:
                fn = _call(kind, n, size, device)
                fn()
                sync()
                times: list[float] = []
                start = time.perf_counter()
                while True:  # rounds of 4 calls; every rank decides alike (MAX)
                    for _ in range(4):
                        dist.barrier()
                        t0 = time.perf_counter()
                        fn()
                        sync()
                        times.append(time.perf_counter() - t0)
                    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    if len(times) >= samples and float(took[0]) >= samples * min_sample_s:
                        break
                per_call = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(per_call, op=dist.ReduceOp.MAX)  # the slowest rank per call
                us = float(per_call.min()) * 1e6
                rows.append(_row(kind, n, size, us))
            out.append({"kind": kind, "per_node": n, "nodes": 1, "backend": backend,
                        "rows": rows})
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def _row(kind: str, n: int, size: int, time_us: float) -> dict[str, Any]:
    count = max(n, size // 4 // n * n)
    nbytes = count * 4
    algbw = nbytes / time_us / 1e3  # GB/s
    return {"size": nbytes, "time_us": time_us, "algbw": algbw,
            "busbw": algbw * bus_factor(kind, n)}


def collective_tables(ranks: int, backend: str, kinds: tuple[str, ...],
                      sizes: tuple[int, ...], min_sample_s: float,
                      samples: int) -> list[dict[str, Any]]:
    """The nccl-tests tables of ``kinds`` x ``sizes`` on ``ranks`` spawned processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, backend, kinds, sizes,
                                               min_sample_s, samples, queue))
             for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=900)
    finally:
        for p in procs:
            p.join(timeout=60)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"a collective worker exited with status {bad[0]}")
    return result
