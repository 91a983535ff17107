"""Flattened collectives (pipeline/costmodel/redistribute/flatten.py), by hand.

H100 numbers (conf/hardware/h100.yaml, HardwareConfig defaults): NVLink bus bandwidth
B = 390 GB/s and 30 µs per ring pass inside a node; NIC b = 50 GB/s, 8 NICs and 8 GPUs
per node, 40 µs per ring pass across nodes. A 64-rank group with 8 members on each of
8 nodes rings at min(B, 8 * min(8 b / 8, 8 b / 8)) = min(390, 400) = 390 GB/s; a group
of one member per node at b = 50 GB/s.

The weight is bf16 [4096, 4096]: S = 33,554,432 bytes gathered.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from pipeline.costmodel.hardware import HardwareConfig
from pipeline.costmodel.redistribute import (
    redistribute_steps,
    redistribute_table,
    redistribute_us,
)
from pipeline.costmodel.redistribute.interner import PlacementInterner
from pipeline.verify.applied import dtensor_collectives

HW = HardwareConfig()
S = 4096 * 4096 * 2
R, P = Replicate(), Partial()


def ring(factor: float, passes: int, lat: float, n: int, nbytes: float, bw: float) -> float:
    return passes * lat + factor * (n - 1) / n * nbytes / bw * 1e6


FLAT64_AG = ring(1, 1, 40.0, 64, S, 390e9)  # 40 + 63/64 * S / 390e9 s = 124.69 µs


def test_hand_values() -> None:
    assert FLAT64_AG == pytest.approx(124.6927, abs=1e-4)
    # DTensor on 8x8: gather the inner 8 in the node (S/8), then the outer 8 on one rail
    per_dim = ring(1, 1, 30.0, 8, S / 8, 390e9) + ring(1, 1, 40.0, 8, S, 50e9)
    assert per_dim == pytest.approx(666.6129, abs=1e-4)
    assert redistribute_us((4096, 4096), 2, (Shard(0), Shard(0)), (R, R), (8, 8), HW,
                           flatten=False) == pytest.approx(per_dim, rel=1e-12)


@pytest.mark.parametrize("mesh", [(64,), (8, 8), (2, 4, 8), (4, 16)])
def test_the_same_weight_gather_costs_the_same_on_any_factorisation(mesh: tuple) -> None:
    n = len(mesh)
    shape = (4096, 4096)
    ag = redistribute_us(shape, 2, (Shard(0),) * n, (R,) * n, mesh, HW, flatten=True)
    rs = redistribute_us(shape, 2, (P,) * n, (Shard(0),) * n, mesh, HW, flatten=True)
    ar = redistribute_us(shape, 2, (P,) * n, (R,) * n, mesh, HW, flatten=True)
    assert ag == pytest.approx(FLAT64_AG, rel=1e-12)
    assert rs == pytest.approx(FLAT64_AG, rel=1e-12)  # reduce-scatter: same ring, S in
    # all-reduce = reduce-scatter + all-gather: two passes, twice the volume
    assert ar == pytest.approx(ring(2, 2, 40.0, 64, S, 390e9), rel=1e-12)
    # an activation all-to-all S(2) -> S(0) of bf16 [64, 2048, 2048] over 64 ranks:
    # L = 512 MiB / 64 local bytes; (n - m)/n of it leaves the node at the rail share b,
    # (m - 1)/n over NVLink, concurrently: busbw = 63 / max(7/390e9, 56/50e9); on a
    # non-leading dim plus the local reshuffle 2 L / (hbm * memory_efficiency)
    act = (64, 2048, 2048)
    loc = math.prod(act) * 2 / 64
    a2a = 40.0 + 63 / 64 * loc / (63 / max(7 / 390e9, 56 / 50e9)) * 1e6 \
        + 2 * loc / (HW.hbm_bandwidth * HW.memory_efficiency) * 1e6
    got = redistribute_us(act, 2, (Shard(2),) * n, (Shard(0),) * n, mesh, HW, flatten=True)
    assert got == pytest.approx(a2a, rel=1e-12)
    [step] = redistribute_steps(shape, 2, (Shard(0),) * n, (R,) * n, mesh, HW, flatten=True)
    assert step.kind == "all_gather" and step.mesh_dims == tuple(range(n))
    assert step.bytes == S


def test_runs_inside_a_plan_and_what_is_not_merged() -> None:
    shape = (4096, 4096)
    mesh = (2, 4, 8)  # dp, cp, tp: dp x cp = 8 ranks, one per node
    # FSDP over dp x cp + TP: gather dims (dp, cp) of dim 0, the tp shard stays
    src, dst = (Shard(0), Shard(0), Shard(1)), (R, R, Shard(1))
    [step] = redistribute_steps(shape, 2, src, dst, mesh, HW, flatten=True)
    assert step.mesh_dims == (0, 1) and step.bytes == S // 8
    assert step.us == pytest.approx(ring(1, 1, 40.0, 8, S / 8, 50e9), rel=1e-12)
    # HSDP gradient: all-reduce over dp, reduce-scatter over tp: two kinds, two steps
    steps = redistribute_steps(shape, 2, (P, P), (R, Shard(0)), (8, 8), HW, flatten=True)
    assert [(s.kind, s.mesh_dims) for s in steps] == redistribute_steps_dims(
        shape, (P, P), (R, Shard(0)), (8, 8))
    # gathers of two different tensor dims are two collectives
    a = redistribute_us(shape, 2, (Shard(0), Shard(1)), (R, R), (8, 8), HW, flatten=True)
    b = redistribute_us(shape, 2, (Shard(0), Shard(1)), (R, R), (8, 8), HW, flatten=False)
    assert a == b
    # a mesh dim of size 1 changes nothing
    assert redistribute_us(shape, 2, (Shard(0), Shard(0)), (R, R), (1, 64), HW,
                           flatten=True) == pytest.approx(FLAT64_AG, rel=1e-12)


def redistribute_steps_dims(shape: tuple, src: tuple, dst: tuple, mesh: tuple) -> list:
    return [(s.kind, s.mesh_dims) for s in
            redistribute_steps(shape, 2, src, dst, mesh, HW, flatten=False)]


def test_table_equals_the_scalar_cost_bit_for_bit() -> None:
    mesh, shape = (2, 4, 8), (64, 32, 16)
    pl = [R, Shard(0), Shard(1), Shard(2), P]
    every = list(itertools.product(pl, repeat=3))
    dsts = [p for p in every if P not in p] + [(P, P, P)]
    interner = PlacementInterner()
    for scale in (1.0, 1 / 9):
        table = redistribute_table(shape, 2, every, dsts, mesh, HW, interner=interner,
                                   latency_scale=scale, flatten=True)
        for i, s in enumerate(every):
            for j, d in enumerate(dsts):
                want = redistribute_us(shape, 2, s, d, mesh, HW, latency_scale=scale,
                                       flatten=True, interner=interner)
                assert table[i, j] == want or (np.isinf(want) and np.isinf(table[i, j]))


def test_verify_counts_what_dtensor_runs() -> None:
    row = {"shape": [4096, 4096], "dtype": "bfloat16", "src_placement": "S(2)S(2)",
           "dst_placement": "S(0)S(0)", "collectives": ["all_to_all(dp+tp)"]}
    row["shape"] = [64, 32, 16]
    # DTensor: gather the inner shard, all-to-all over the outer dim, slice locally
    assert dtensor_collectives(row, (8, 8), ("dp", "tp")) == ["all_gather(tp)",
                                                               "all_to_all(dp)"]
    plain = {**row, "collectives": ["all_gather(dp)"]}
    assert dtensor_collectives(plain, (8, 8), ("dp", "tp")) == ["all_gather(dp)"]


def test_verify_keeps_a_flattened_collective_where_fsdp2_made_the_mesh() -> None:
    """DTensor merges the per-dim all-reduces of ``PP -> RR`` into one over ``dp+tp`` only
    when a flattened ``dp_tp`` mesh exists (FSDP2 makes one for a unit's shard dims)."""
    row = {"shape": [], "dtype": "float32", "src_placement": "PP", "dst_placement": "RR",
           "collectives": ["all_reduce(dp+tp)"]}
    assert dtensor_collectives(row, (2, 2), ("dp", "tp")) == ["all_reduce(dp)",
                                                             "all_reduce(tp)"]
    assert dtensor_collectives(row, (2, 2), ("dp", "tp"),
                               [frozenset({"dp", "tp"})]) == ["all_reduce(dp+tp)"]
