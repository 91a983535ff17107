"""Kernel timings on one device: matmul, attention, a memory-bound copy, launch overhead.

One code path for CPU and CUDA: every timed region ends with :func:`sync` (a no-op on
CPU, ``torch.cuda.synchronize`` on CUDA), so a sample is wall time of finished work.

Statistic (:func:`best_us`): after a warm-up call, every call is timed alone and the
fastest kept, over at least ``samples`` calls and ``samples x min_sample_s`` seconds. On
a shared machine other processes only ever add time, so the least disturbed call is the
best estimate of what the machine does (the advice of Python's ``timeit``
documentation); medians of samples moved with the load (two runs differed up to 8x at a
load average of 36 on 2 cores), and so did minima of 20 ms samples (a sample spans
several scheduler slices). The agreement of two runs is in docs/cost-model.md.

Efficiency is ``FLOPs / (time * peak)`` with the FLOPs the cost model counts
(:func:`pipeline.costmodel.compute.op_flops`): a matmul ``[m, k] x [k, n]`` forward
``2 m n k``, its backward (both input gradients, ``dX = dY W^T`` and ``dW = X^T dY``)
``4 m n k``; attention the SDPA formulas of ``torch.utils.flop_counter`` (causal not
halved, as the cost model counts it). The peak is set by the caller (pipeline/tools/
calibrate/run.py: the best measured matmul rate of the dtype).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Settings", "attention_rows", "launch_us", "matmul_rows", "best_us",
           "memory_rows", "sync"]


@dataclass(frozen=True)
class Settings:
    """What one calibration measures and how long it samples.

    Attributes:
        min_sample_s: a sample lasts at least this long (s).
        samples: samples per entry (the fastest is kept).
        mm_sizes: the M = N = K axis of the matmul grid (every combination).
        dtypes: dtype names measured.
        attn_seqs: sequence lengths of the attention table.
        attn_head_dims: head dims of the attention table.
        attn_batch_heads: batch x heads of each attention call.
        mem_bytes: sizes (bytes of one buffer) of the copy table.
    """

    min_sample_s: float
    samples: int
    mm_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    attn_seqs: tuple[int, ...]
    attn_head_dims: tuple[int, ...]
    attn_batch_heads: int
    mem_bytes: tuple[int, ...]


def sync(device: Any) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_us(fn: Callable[[], Any], device: Any, st: Settings) -> float:
    """Per-call time of ``fn`` in µs: the fastest single call (module docstring), each
    call timed alone between device syncs, calls repeated until ``st.samples`` of them
    and ``st.samples * st.min_sample_s`` seconds have passed (after one warm-up call)."""
    fn()
    sync(device)
    budget = st.samples * st.min_sample_s
    best = math.inf
    calls = 0
    start = time.perf_counter()
    while calls < st.samples or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return best * 1e6


def matmul_rows(device: Any, st: Settings) -> list[dict[str, Any]]:
    """Time of every ``[m, k] x [k, n]`` matmul of the grid, forward and backward, per
    dtype: rows ``{dtype, pass, m, n, k, time_us, flops}`` (efficiency added later)."""
    import torch

    from pipeline.costmodel.compute import op_flops

    aten = torch.ops.aten
    rows = []
    for name in st.dtypes:
        dtype = getattr(torch, name)
        for m in st.mm_sizes:
            for n in st.mm_sizes:
                for k in st.mm_sizes:
                    x = torch.randn(m, k, device=device, dtype=dtype)
                    w = torch.randn(k, n, device=device, dtype=dtype)
                    dy = torch.randn(m, n, device=device, dtype=dtype)
                    fwd = best_us(lambda x=x, w=w: torch.mm(x, w), device, st)

                    def bwd(x=x, w=w, dy=dy) -> None:
                        torch.mm(dy, w.t())  # dX
                        torch.mm(x.t(), dy)  # dW

                    back = best_us(bwd, device, st)
                    f = op_flops(aten.mm.default, [(m, k), (k, n)])
                    b = (op_flops(aten.mm.default, [(m, n), (n, k)])
                         + op_flops(aten.mm.default, [(k, m), (m, n)]))
                    rows.append({"dtype": name, "pass": "fwd", "m": m, "n": n, "k": k,
                                 "time_us": fwd, "flops": f})
                    rows.append({"dtype": name, "pass": "bwd", "m": m, "n": n, "k": k,
                                 "time_us": back, "flops": b})
    return rows


def attention_rows(device: Any, st: Settings) -> list[dict[str, Any]]:
    """Time of ``scaled_dot_product_attention`` forward and backward per dtype, head dim,
    causal mask and sequence length (``[1, batch_heads, seq, head_dim]`` q, k, v):
    rows ``{dtype, pass, batch_heads, seq, head_dim, causal, time_us, flops}``."""
    import torch
    import torch.nn.functional as F

    from pipeline.costmodel.compute import op_flops

    aten = torch.ops.aten
    rows = []
    bh = st.attn_batch_heads
    for name in st.dtypes:
        dtype = getattr(torch, name)
        for e in st.attn_head_dims:
            for causal in (False, True):
                for L in st.attn_seqs:
                    q, k, v = (torch.randn(1, bh, L, e, device=device, dtype=dtype,
                                           requires_grad=True) for _ in range(3))
                    fwd = best_us(lambda q=q, k=k, v=v, c=causal:
                                    F.scaled_dot_product_attention(q, k, v, is_causal=c),
                                    device, st)
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    g = torch.randn_like(out)

                    def bwd(out=out, q=q, k=k, v=v, g=g) -> None:
                        torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

                    back = best_us(bwd, device, st)
                    shape = (1, bh, L, e)
                    f = op_flops(aten._scaled_dot_product_flash_attention.default,
                                 [shape, shape, shape], {}, (shape,))
                    b = op_flops(aten._scaled_dot_product_flash_attention_backward.default,
                                 [shape, shape, shape, shape, shape], {},
                                 (shape, shape, shape))
                    common = {"dtype": name, "batch_heads": bh, "seq": L, "head_dim": e,
                              "causal": causal}
                    rows.append({**common, "pass": "fwd", "time_us": fwd, "flops": f})
                    rows.append({**common, "pass": "bwd", "time_us": back, "flops": b})
    return rows


def memory_rows(device: Any, st: Settings) -> list[dict[str, Any]]:
    """A copy of ``b`` bytes into another buffer (a memory-bound kernel reading ``b`` and
    writing ``b``): rows ``{bytes (moved: 2 b), time_us, bandwidth GB/s}``."""
    import torch

    rows = []
    for b in st.mem_bytes:
        src = torch.empty(b // 4, device=device, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        t = best_us(lambda s=src, d=dst: d.copy_(s), device, st)
        moved = 2 * (b // 4) * 4
        rows.append({"bytes": moved, "time_us": t, "bandwidth": moved / t / 1e3})
    return rows


def launch_us(device: Any, st: Settings) -> float:
    """Per-kernel launch overhead: the time of an in-place add on a one-element tensor
    (µs), i.e. dispatch plus launch with no work."""
    import torch

    x = torch.zeros(1, device=device)
    return best_us(lambda: x.add_(1.0), device, st)


def efficiencies(rows: Sequence[dict[str, Any]], peaks: dict[str, float]) -> None:
    """Add ``efficiency = flops / (time * peak[dtype])`` to each row, in place (capped at
    1: a peak below a measured rate is a measured rate)."""
    for r in rows:
        r["efficiency"] = min(1.0, r["flops"] / (r["time_us"] * 1e-6 * peaks[r["dtype"]]))
