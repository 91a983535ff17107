"""Measured hardware tables (pipeline/costmodel/profile.py) and the cost model reading
them; ring latency by algorithm steps and NCCL's tree rule (pipeline/costmodel/comm.py).
Every expected value is worked out by hand in the comment beside it."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from pipeline.costmodel.comm import (
    GroupLayout,
    collective_us,
    group_collective_params,
    group_collective_us,
    mesh_collective_params,
    mesh_collectives_us,
    ring_pass_latency_us,
    table_collective_us,
    tree_params,
)
from pipeline.costmodel.compute import roofline_us, table_rates
from pipeline.costmodel.hardware import (
    COLLECTIVES,
    HardwareConfig,
    LinkConfig,
    load_hardware,
    tables_of,
)
from pipeline.costmodel.profile import Tables, TablesError, interp_grid_log, interp_log

ROOT = Path(__file__).resolve().parents[2]

# NCCL's tuning-model hop latencies (Ring/Simple: NVLink 3.4 µs, network 14 µs) and a
# base of 6.2 µs (8 ranks in a node: 6.2 + 7 x 3.4 = 30 µs).
NCCL_HOPS = dict(intra_node=LinkConfig(390e9, 6.2, 3.4), inter_node=LinkConfig(50e9, 6.2, 14.0))


def _tables() -> dict:
    """A small valid profile: a 2x2x2 float32 matmul grid, one attention line, a memory
    table, launch, one all_gather table."""
    mm = [{"dtype": "float32", "pass": "fwd", "m": m, "n": n, "k": k, "time_us": 1.0,
           "efficiency": (1 + i + 2 * j + 4 * q) / 10}
          for i, m in enumerate((64, 256)) for j, n in enumerate((64, 256))
          for q, k in enumerate((64, 256))]
    attn = [{"dtype": "float32", "pass": "fwd", "batch_heads": 4, "seq": s, "head_dim": 64,
             "causal": True, "time_us": 5.0, "efficiency": e}
            for s, e in ((128, 0.2), (512, 0.6))]
    return {"version": 1, "date": "2026-12-03T00:00:00Z", "torch": "2.13.0", "device": "cpu",
            "method": "hand", "measured": ["matmul"], "from_constants": [],
            "matmul": mm, "attention": attn,
            "memory": [{"bytes": 1024, "time_us": 1.0, "bandwidth": 1.0},
                       {"bytes": 4096, "time_us": 1.0, "bandwidth": 3.0}],
            "launch_us": 4.0,
            "collectives": [{"kind": "all_gather", "per_node": 2, "nodes": 1, "backend": "gloo",
                             "rows": [{"size": 1024, "time_us": 1.0, "algbw": 2.0, "busbw": 1.0},
                                      {"size": 4096, "time_us": 1.0, "algbw": 8.0,
                                       "busbw": 4.0}]}]}


# --------------------------------------------------------------------------- interpolation


def test_interp_log_by_hand():
    # 2048 is half way between 1024 and 4096 in log2 (11 between 10 and 12): (1 + 3) / 2
    assert interp_log(2048, (1024, 4096), (1.0, 3.0)) == (2.0, False)
    # a quarter of the way: 2**10.5
    assert interp_log(2 ** 10.5, (1024, 4096), (1.0, 3.0))[0] == pytest.approx(1.5)
    assert interp_log(1024, (1024, 4096), (1.0, 3.0)) == (1.0, False)
    assert interp_log(512, (1024, 4096), (1.0, 3.0)) == (1.0, True)  # clamped, outside
    assert interp_log(8192, (1024, 4096), (1.0, 3.0)) == (3.0, True)


def test_interp_grid_log_by_hand():
    axes = ((64, 256), (64, 256), (64, 256))
    values = np.array([[[i + 2 * j + 4 * k for k in range(2)] for j in range(2)]
                       for i in range(2)], dtype=float)
    # half way on every axis (128 = 2**7 between 2**6 and 2**8): 0.5 + 1 + 2
    assert interp_grid_log((128, 128, 128), axes, values) == (pytest.approx(3.5), False)
    # corner values exactly; (128, 64, 256): 0.5 + 0 + 4
    assert interp_grid_log((256, 64, 256), axes, values) == (5.0, False)
    assert interp_grid_log((128, 64, 256), axes, values)[0] == pytest.approx(4.5)
    # k = 1024 is beyond 256: clamped to 256 and flagged
    assert interp_grid_log((64, 64, 1024), axes, values) == (4.0, True)


# --------------------------------------------------------------------------- format


def test_round_trip_through_a_hardware_yaml(tmp_path):
    import yaml

    from pipeline.tools.calibrate.run import write_profile

    hw = dataclasses.asdict(HardwareConfig())
    hw["name"] = "rt"
    hw["tables"] = _tables()
    write_profile(hw, tmp_path / "rt.yaml")
    back = load_hardware(str(tmp_path / "rt.yaml"))
    assert back.tables == _tables()  # values of 4 significant digits survive exactly
    assert yaml.safe_load((tmp_path / "rt.yaml").read_text())["tables"]["version"] == 1


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t["matmul"][0].pop("efficiency"),
     "hardware.tables.matmul[0].efficiency is missing"),
    (lambda t: t["matmul"][3].update(time_us=-2.0),
     "hardware.tables.matmul[3].time_us=-2.0 is invalid: must be a number > 0"),
    (lambda t: t["memory"].reverse(),
     "hardware.tables.memory: sizes 4096 then 1024 are not strictly increasing"),
    (lambda t: t["collectives"][0]["rows"].reverse(),
     "hardware.tables.collectives[0] (all_gather): sizes 4096 then 1024 are not strictly"),
    (lambda t: t["collectives"][0].update(kind="broadcast"),
     "hardware.tables.collectives[0].kind='broadcast' is invalid: allowed all_gather"),
    (lambda t: t["collectives"][0]["rows"][1].update(busbw=float("nan")),
     "hardware.tables.collectives[0].rows[1].busbw=nan is invalid"),
    (lambda t: t.pop("date"), "hardware.tables.date is missing"),
    (lambda t: t["matmul"].pop(), "hardware.tables.matmul: float32 fwd is not a full M x N x K"),
    (lambda t: t.update(launch_us=-1), "hardware.tables.launch_us=-1 is invalid"),
])
def test_bad_tables_are_one_line(change, message):
    t = copy.deepcopy(_tables())
    change(t)
    with pytest.raises(TablesError) as err:
        Tables(t)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="hardware.tables"):
        HardwareConfig(tables=t)


def test_lookups_and_counts():
    t = Tables(_tables())
    # grid value at index (i, j, k) is 0.1 (1 + i + 2j + 4k): at (128, 256, 64) half way
    # on m: 0.1 (1 + 0.5 + 2) = 0.35
    assert t.matmul_efficiency("float32", "fwd", 128, 256, 64) == pytest.approx(0.35)
    # the bwd pass is not measured: the fwd table answers it
    assert t.matmul_efficiency("float32", "bwd", 64, 64, 64) == pytest.approx(0.1)
    assert t.matmul_efficiency("bfloat16", "fwd", 64, 64, 64) is None
    # attention: seq 256 half way between 128 and 512 in log2: (0.2 + 0.6) / 2; head dim
    # 128 uses the nearest measured one (64) and counts as outside
    assert t.attention_efficiency("float32", "fwd", 256, 64, True) == pytest.approx(0.4)
    assert t.attention_efficiency("float32", "fwd", 256, 128, True) == pytest.approx(0.4)
    assert t.attention_efficiency("float32", "fwd", 256, 64, False) is None
    # memory: 2048 B half way: (1 + 3) / 2 GB/s
    assert t.memory_bandwidth(2048) == pytest.approx(2e9)
    assert t.counts == {"matmul": [2, 0], "attention": [2, 1], "memory": [1, 0]}


# --------------------------------------------------------------------------- links


def test_ring_latency_grows_with_steps_by_hand():
    hw = HardwareConfig(**NCCL_HOPS)
    # 4 ranks in a node: 6.2 + 3 x 3.4 = 16.4 µs; 8 ranks: 6.2 + 7 x 3.4 = 30 µs
    assert ring_pass_latency_us(GroupLayout(4, 4, 1), hw) == pytest.approx(16.4)
    assert ring_pass_latency_us(GroupLayout(8, 8, 1), hw) == pytest.approx(30.0)
    # 64 ranks, 8 per node on 8 nodes: 63 steps, 7 over the network:
    # 6.2 + 56 x 3.4 + 7 x 14 = 294.6 µs
    assert ring_pass_latency_us(GroupLayout(64, 8, 8), hw) == pytest.approx(294.6)
    # 8 ranks, one per node: 6.2 + 0 + 7 x 14 = 104.2 µs
    assert ring_pass_latency_us(GroupLayout(8, 1, 8), hw) == pytest.approx(104.2)
    # all-gather pays one pass, all-reduce two, all-to-all one step (6.2 + 3.4 in a node,
    # 6.2 + 14 across nodes)
    assert group_collective_params("all_gather", GroupLayout(8, 8, 1), hw)[0] == pytest.approx(30)
    assert group_collective_params("all_reduce", GroupLayout(8, 8, 1), hw)[0] == pytest.approx(60)
    assert group_collective_params("all_to_all", GroupLayout(8, 8, 1), hw)[0] == pytest.approx(9.6)
    assert group_collective_params("all_to_all", GroupLayout(16, 8, 2), hw)[0] == pytest.approx(
        20.2)
    # one link tier: 4 ranks, 30 µs base + 3 steps of 2 µs = 36 µs, + 1 MB / 1 GB/s x 3/4
    link = LinkConfig(1e9, 30.0, 2.0)
    assert collective_us("all_gather", 1e6, 4, link) == pytest.approx(36 + 750)
    # hierarchical all-reduce, 8 x 8: 2 x 6.2 + 2 x 6.2 + 2 x 7 x 3.4 + 2 x 7 x 14 = 268.4
    hier = dataclasses.replace(hw, hierarchical_all_reduce=True)
    assert group_collective_params("all_reduce", GroupLayout(64, 8, 8), hier)[0] == \
        pytest.approx(268.4)


def test_tree_all_reduce_where_nccl_would_use_it_by_hand():
    hw = HardwareConfig(**NCCL_HOPS)
    two_nodes = GroupLayout(16, 8, 2)
    # ring: 2 passes of 6.2 + 14 x 3.4 + 1 x 14 = 67.8 -> 135.6 µs; busbw min(390, 8 x 50)
    lat, bw = group_collective_params("all_reduce", two_nodes, hw)
    assert (lat, bw) == (pytest.approx(135.6), 390e9)
    # tree: 2 x 6.2 + 2 (7 x 3.4 + floor(log2 2) x 14) = 12.4 + 75.6 = 88 µs,
    # busbw 0.9 x 15/16 x 390 GB/s
    tlat, tbw = tree_params("all_reduce", two_nodes, hw)
    assert tlat == pytest.approx(88.0) and tbw == pytest.approx(0.9 * 15 / 16 * 390e9)
    # empty buffer: the tree's latency wins; 1 GiB: the ring's bandwidth wins
    assert group_collective_us("all_reduce", 0, two_nodes, hw) == pytest.approx(88.0)
    big = 2 ** 30
    ring = 135.6 + 2 * 15 / 16 * big / 390e9 * 1e6
    tree = 88.0 + 2 * big / (0.9 * 390e9) * 1e6
    assert tree > ring
    assert group_collective_us("all_reduce", big, two_nodes, hw) == pytest.approx(ring)
    # 1 MiB: ring 135.6 + 5.04 = 140.64, tree 88 + 5.98 = 93.98 -> tree
    mib = 2 ** 20
    assert group_collective_us("all_reduce", mib, two_nodes, hw) == pytest.approx(
        88.0 + 2 * mib / (0.9 * 390e9) * 1e6)
    # not considered: inside a node, for all-gather, with hierarchical all-reduce
    assert tree_params("all_reduce", GroupLayout(8, 8, 1), hw) is None
    assert tree_params("all_gather", two_nodes, hw) is None
    assert tree_params("all_reduce", two_nodes,
                       dataclasses.replace(hw, hierarchical_all_reduce=True)) is None
    # with hop latency 0 (the presets) the tree never beats the ring: same latency
    # (2 x 40 µs), less bandwidth
    preset = HardwareConfig()
    for s in (0, 1024, 2 ** 20, 2 ** 30):
        lat, bw = group_collective_params("all_reduce", two_nodes, preset)
        assert group_collective_us("all_reduce", s, two_nodes, preset) == \
            lat + 2 * 15 / 16 * s / bw * 1e6


def test_collective_table_by_hand():
    hw = HardwareConfig(tables=_tables())
    pair = GroupLayout(2, 2, 1)
    # busbw at 2048 B: half way between 1 and 4 GB/s in log2 -> 2.5 GB/s;
    # time = (n-1)/n S / busbw = 0.5 x 2048 / 2.5e9 s = 0.4096 µs
    assert group_collective_us("all_gather", 2048, pair, hw) == pytest.approx(0.4096)
    # the table's own rows come back: 4096 B at 4 GB/s: 0.5 x 4096 / 4e9 = 0.512 µs
    assert group_collective_us("all_gather", 4096, pair, hw) == pytest.approx(0.512)
    # outside: 8192 B at the last row's 4 GB/s (clamped): 1.024 µs, counted
    assert group_collective_us("all_gather", 8192, pair, hw) == pytest.approx(1.024)
    assert tables_of(hw).counts["collectives"] == [3, 1]
    # no table for reduce-scatter or for 4 ranks: the link model (30 µs + bandwidth term)
    assert group_collective_us("reduce_scatter", 2048, pair, hw) == pytest.approx(
        30 + 0.5 * 2048 / 390e9 * 1e6)
    assert group_collective_us("all_gather", 2048, GroupLayout(4, 4, 1), hw) == \
        pytest.approx(30 + 0.75 * 2048 / 390e9 * 1e6)
    # a bucket member's latency share 0.5 subtracts half the smallest row's time
    # (0.5 x 1024 / 1e9 = 0.512 µs): 0.4096 - 0.256 = 0.1536 µs
    t, outside = table_collective_us("all_gather", np.array([2048.0]), np.array([2]),
                                     (1024, 4096), (1e9, 4e9), latency_scale=0.5)
    assert t[0] == pytest.approx(0.1536) and outside == 0


def test_vectorised_equals_scalar_with_tree_and_tables():
    base = HardwareConfig(**NCCL_HOPS, gpus_per_node=4, tables=_tables())
    # 8 ranks, 4 per node: dim 1 of (4, 2) is 2 ranks in a node (the all_gather table),
    # dim 0 is ranks {0, 2, 4, 6}: 2 per node on 2 nodes (the tree considered)
    mesh = (4, 2)
    params = mesh_collective_params(mesh, base)
    sizes = np.array([0, 100, 1024, 3000, 4096, 2 ** 20, 2 ** 26], dtype=np.int64)
    for dim in (0, 1):
        for k, kind in enumerate(COLLECTIVES):
            vec = mesh_collectives_us(np.full(len(sizes), k), sizes, np.full(len(sizes), dim),
                                      params)
            for s, v in zip(sizes, vec):
                layout = GroupLayout(*((4, 2, 2) if dim == 0 else (2, 2, 1)))
                assert group_collective_us(kind, int(s), layout, base) == v


# --------------------------------------------------------------------------- compute


def test_compute_reads_the_matmul_table_by_hand():
    hw = HardwareConfig(tables=_tables(), kernel_floor_us=0.0)
    # mm [128, 64] x [64, 256]: M = 128, N = 256, K = 64: 0.1 (1 + 0.5 + 2) = 0.35
    eff, bw = table_rates("aten.mm.default", [(128, 64), (64, 256)], [], {}, 2048,
                          "float32", hw, "fwd")
    assert eff == pytest.approx(0.35) and bw == pytest.approx(2e9)
    flops = 2 * 128 * 64 * 256
    # 4.19 MFLOP / (67 TFLOP/s x 0.35) = 0.1788 µs; memory 2048 B / 2 GB/s = 1.024 µs
    assert roofline_us(flops, 2048, "float32", hw, False, eff, bw) == pytest.approx(1.024)
    assert roofline_us(flops, 0, "float32", hw, False, eff, bw) == pytest.approx(
        flops / (67e12 * 0.35) * 1e6)
    # addmm reads its matrices at args 1, 2; bmm folds the batch into M:
    # [4, 32, 64] x [4, 64, 256] is M = 128, N = 256, K = 64
    assert table_rates("aten.addmm.default", [(256,), (128, 64), (64, 256)], [], {}, 2048,
                       "float32", hw, "fwd")[0] == pytest.approx(0.35)
    assert table_rates("aten.bmm.default", [(4, 32, 64), (4, 64, 256)], [], {}, 2048,
                       "float32", hw, "fwd")[0] == pytest.approx(0.35)
    # attention: is_causal from the schema's position (arg 4 of the CPU flash op)
    q = (1, 4, 256, 64)
    eff, _ = table_rates("aten._scaled_dot_product_flash_attention_for_cpu.default",
                         [q, q, q, 0.0, True], [None, None, None, 0.0, True], {}, 2048,
                         "float32", hw, "fwd")
    assert eff == pytest.approx(0.4)
    # an op without a table: the constants (None), no profile: (None, None)
    assert table_rates("aten.add.Tensor", [(4,), (4,)], [], {}, 32, "float32", hw,
                       "fwd")[0] is None
    assert table_rates("aten.mm.default", [(2, 2), (2, 2)], [], {}, 32, "float32",
                       HardwareConfig(), "fwd") == (None, None)


def test_committed_profiles_validate():
    for name in ("cpu_epyc2", "test_tables"):
        hw = load_hardware(str(ROOT / "conf" / "hardware" / f"{name}.yaml"))
        t = tables_of(hw)
        assert t is not None and t.header["date"]
        assert math.isfinite(hw.peak_flops_fp32)
