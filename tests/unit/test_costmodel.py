"""Cost model: hardware config, roofline compute, alpha-beta collectives, redistribution.

Every expected number is derived by hand in the comments from the H100 values of
conf/hardware/h100.yaml: bf16 peak 989e12 FLOP/s, fp32 67e12, HBM 3.35e12 B/s, both
efficiencies 0.7 (so effective 6.923e14 FLOP/s bf16 and 2.345e12 B/s), floor 7 µs;
intra-node NVLink ring bus bandwidth 390e9 B/s + 30 µs per ring pass (all-reduce: two
passes, 60 µs); one NIC 50e9 B/s, + 40 µs per ring pass across nodes. The link model for
groups spanning nodes is tested by hand in tests/unit/test_links.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.costmodel.comm import (
    all_gather_us,
    all_reduce_us,
    all_to_all_us,
    alpha_beta_us,
    collective_us,
    mesh_collective_params,
    mesh_collective_us,
    mesh_collectives_us,
    mesh_dim_link,
    reduce_scatter_us,
)
from pipeline.costmodel.compute import is_view_op, op_flops, peak_flops, roofline_us
from pipeline.costmodel.hardware import (
    COLLECTIVES,
    HardwareConfig,
    LinkConfig,
    hardware_key,
    load_hardware,
    validate_hardware,
)
from pipeline.costmodel.redistribute import (
    StepCost,
    plan,
    redistribute_steps,
    redistribute_table,
    redistribute_us,
)
from pipeline.dtensor.placements import parse_placements as pp

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]
H100_YAML = ROOT / "conf" / "hardware" / "h100.yaml"
HBM_EFF = 3.35e12 * 0.7  # 2.345e12 B/s


@pytest.fixture(scope="module")
def hw() -> HardwareConfig:
    return load_hardware(str(H100_YAML))


# --------------------------------------------------------------------------- hardware


def test_yaml_keys_match_dataclass_exactly():
    data = OmegaConf.to_container(OmegaConf.load(H100_YAML))

    top = {f.name for f in dataclasses.fields(HardwareConfig)}
    link = {f.name for f in dataclasses.fields(LinkConfig)}
    assert set(data) == top
    assert set(data["intra_node"]) == link
    assert set(data["inter_node"]) == link


def test_yaml_equals_dataclass_defaults(hw):
    assert hw == HardwareConfig()
    assert hw.peak_flops_bf16 == 989e12 and hw.peak_flops_fp32 == 67e12
    assert hw.kernel_floor_us == 7.0 and hw.gpus_per_node == 8
    # a DictConfig built by Hydra from the schema works the same way
    cfg = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(H100_YAML))
    assert hardware_key(cfg) == hardware_key(hw)
    validate_hardware(cfg)


def test_unknown_yaml_key_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(H100_YAML.read_text() + "\nwarp_speed: 9\n")
    with pytest.raises(Exception, match="warp_speed"):
        load_hardware(str(bad))


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"compute_efficiency": 1.5}, "hardware.compute_efficiency=1.5"),
        ({"hbm_bandwidth": 0.0}, "hardware.hbm_bandwidth=0.0"),
        ({"gpus_per_node": 0}, "hardware.gpus_per_node=0"),
        ({"kernel_floor_us": -1.0}, "hardware.kernel_floor_us=-1.0"),
    ],
)
def test_validation_names_key_and_value(change, key):
    with pytest.raises(ValueError) as info:
        HardwareConfig(**change)
    assert key in str(info.value) and "\n" not in str(info.value)


def test_link_validation():
    with pytest.raises(ValueError, match="intra_node.bandwidth"):
        HardwareConfig(intra_node=LinkConfig(bandwidth=-1.0))
    with pytest.raises(ValueError, match="inter_node.latency_us"):
        HardwareConfig(inter_node=LinkConfig(latency_us=-1.0))


# --------------------------------------------------------------------------- compute


def test_matmul_roofline_by_hand(hw):
    # mm [4096,4096] x [4096,4096] bf16:
    #   FLOPs = 2 * 4096^3 = 137,438,953,472
    #   compute = 1.37438953472e11 / (989e12 * 0.7 = 6.923e14) = 1.98525e-4 s = 198.525 µs
    #   bytes = 3 * 4096^2 * 2 B = 100,663,296 B; memory = 1.0066e8 / 2.345e12 = 42.93 µs
    #   -> compute-bound: 198.525 µs
    flops = op_flops(aten.mm.default, [(4096, 4096), (4096, 4096)], {}, (4096, 4096))
    assert flops == 2 * 4096**3 == 137_438_953_472
    t = roofline_us(flops, 3 * 4096 * 4096 * 2, torch.bfloat16, hw, is_view=False)
    assert t == pytest.approx(198.52514, rel=1e-6)


def test_fp32_matmul_uses_fp32_peak(hw):
    # same mm in fp32: 1.37438953472e11 / (67e12 * 0.7 = 4.69e13) = 2930.43 µs
    assert peak_flops(torch.float32, hw) == 67e12
    assert peak_flops("bfloat16", hw) == peak_flops(torch.float16, hw) == 989e12
    t = roofline_us(2 * 4096**3, 3 * 4096 * 4096 * 4, "float32", hw, False)
    assert t == pytest.approx(2930.4681, rel=1e-6)


def test_elementwise_is_memory_bound_by_hand(hw):
    # add [4096,4096] + [4096,4096] bf16: no flop formula -> 0 FLOPs (memory-bound);
    # bytes = 2 reads + 1 write = 3 * 16,777,216 * 2 = 100,663,296 B
    # memory = 100,663,296 / 2.345e12 = 4.29268e-5 s = 42.9268 µs
    assert op_flops(aten.add.Tensor, [(4096, 4096), (4096, 4096)]) == 0.0
    t = roofline_us(0.0, 100_663_296, torch.bfloat16, hw, False)
    assert t == pytest.approx(42.92678, rel=1e-6)


def test_kernel_floor(hw):
    # add [1024] bf16: 6,144 B / 2.345e12 = 0.0026 µs -> floored at 7 µs
    assert roofline_us(0.0, 3 * 1024 * 2, torch.bfloat16, hw, False) == 7.0
    assert roofline_us(0.0, 0, torch.float32, hw, False) == 7.0


def test_roofline_vectorised(hw):
    flops = np.array([0.0, 2 * 4096**3])
    nbytes = np.array([6144, 3 * 4096 * 4096 * 2])
    out = roofline_us(flops, nbytes, torch.bfloat16, hw, False)
    assert out[0] == 7.0
    assert out[1] == roofline_us(2 * 4096**3, 3 * 4096 * 4096 * 2, torch.bfloat16, hw, False)
    assert np.all(roofline_us(flops, nbytes, torch.bfloat16, hw, True) == 0)


VIEWS = [
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.slice.Tensor,
    aten.select.int,
    aten.alias.default,
    aten.detach.default,
    aten.as_strided.default,
    aten.split.Tensor,
    aten.unbind.int,
    aten.t_.default,  # inplace_view tag
    aten.sym_size.int,  # metadata, no tensor output
    operator.getitem,
    "aten.view.default",
]
NOT_VIEWS = [
    aten.mm.default,
    aten.add.Tensor,
    aten.add_.Tensor,
    aten.copy_.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.native_layer_norm.default,
    aten._foreach_add_.List,
    "aten.mul",
]


@pytest.mark.parametrize("op", VIEWS, ids=str)
def test_views_cost_zero(op, hw):
    assert is_view_op(op)
    assert roofline_us(0.0, 1 << 30, torch.bfloat16, hw, is_view_op(op)) == 0.0


@pytest.mark.parametrize("op", NOT_VIEWS, ids=str)
def test_real_kernels_are_not_views(op):
    assert not is_view_op(op)


def test_flops_on_local_shapes():
    # SDPA flash forward, q/k/v [b=2, h=8, s=128, d=64]: 2 bmm of 2*b*h*s*s*d = 2 * 16.8M
    full = op_flops(aten._scaled_dot_product_flash_attention.default, [(2, 8, 128, 64)] * 3)
    assert full == 2 * (2 * 2 * 8 * 128 * 128 * 64)
    # heads sharded 2-way: the local op does half the work
    half = op_flops("aten._scaled_dot_product_flash_attention.default", [(2, 4, 128, 64)] * 3)
    assert half == full / 2
    # backward: 2.5x the forward matmuls (5 bmm), not causal
    bwd_args = [(2, 8, 128, 64)] * 5 + [(2, 8, 128), None, None, 128, 128, 0.0, False, None,
                                        None]
    bwd = op_flops(aten._scaled_dot_product_flash_attention_backward.default, bwd_args)
    assert bwd == 2.5 * full
    # a 'raw' formula (wants tensors): shapes are turned into meta tensors (PyTorch's
    # formula reads the shapes as [b, h, s, d] here too)
    raw = op_flops(
        aten._flash_attention_forward.default,
        [(2, 8, 128, 64)] * 3 + [None, None, 128, 128, 0.0, True, False],
    )
    assert raw == full
    # addmm with a torch.Size, a tuple and a list; bmm; TensorMeta-like objects
    assert op_flops(aten.addmm.default, [(64,), torch.Size([8, 32]), [32, 64]]) == 2 * 8 * 32 * 64
    assert op_flops(aten.bmm.default, [torch.empty(3, 4, 5, device="meta"), (3, 5, 6)]) == (
        2 * 3 * 4 * 5 * 6
    )
    conv = op_flops(
        aten.convolution.default,
        [(8, 3, 32, 32), (16, 3, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1],
        out_shape=(8, 16, 32, 32),
    )
    assert conv == 2 * 8 * 16 * 32 * 32 * 3 * 3 * 3


def test_causal_attention_counts_the_pairs_the_mask_keeps():
    """Causal attention over T = 4 keys keeps 1 + 2 + 3 + 4 = 10 of the 16 query-key
    pairs (counted by hand: query i sees keys 0..i), so the op costs 10/16 of the
    unmasked formula; at T = 8192 the fraction is 8193 / 16384, forward and backward."""
    import numpy as np

    from pipeline.costmodel.compute import causal_fraction

    mask = np.tril(np.ones((4, 4), dtype=bool))  # torch's is_causal mask, top-left
    assert causal_fraction(4) == mask.sum() / mask.size == 10 / 16
    fwd = aten._scaled_dot_product_flash_attention.default
    b, h, s, d = 2, 32, 8192, 128
    dense = 4 * b * h * s * s * d  # QK^T and PV: 2 matmuls of 2 b h s s d
    assert op_flops(fwd, [(b, h, s, d)] * 3) == dense
    assert op_flops(fwd, [(b, h, s, d)] * 3 + [0.0, True]) == dense * 8193 / 16384
    assert op_flops(fwd, [(b, h, s, d)] * 3, {"is_causal": True}) == dense * 8193 / 16384
    assert op_flops(fwd, [(b, h, s, d)] * 3 + [0.0, False]) == dense
    bwd = aten._scaled_dot_product_flash_attention_backward.default
    args = [(b, h, s, d)] * 5 + [(b, h, s), None, None, s, s, 0.0, True, None, None]
    assert op_flops(bwd, args) == 2.5 * dense * 8193 / 16384
    # the efficient kernel reads is_causal at another position
    eff = aten._scaled_dot_product_efficient_attention.default
    assert op_flops(eff, [(b, h, s, d)] * 3 + [None, True, 0.0, True]) == dense * 8193 / 16384
    with pytest.raises(ValueError, match="at least 1"):
        causal_fraction(0)


# --------------------------------------------------------------------------- comm

MIB64 = 64 * 1024 * 1024  # 67,108,864 B


def test_collectives_intra_by_hand(hw):
    link = hw.intra_node
    # n=8: 30 + 7/8 * 67,108,864 / 390e9 s = 30 + 150.5647 µs
    assert all_gather_us(MIB64, 8, link) == pytest.approx(180.56476, rel=1e-7)
    assert reduce_scatter_us(MIB64, 8, link) == pytest.approx(180.56476, rel=1e-7)
    assert all_to_all_us(MIB64, 8, link) == pytest.approx(180.56476, rel=1e-7)
    # all-reduce = reduce-scatter + all-gather: 2 * 30 + 2 * 7/8 * 67,108,864 / 390e9 s
    #   = 60 + 301.12952 µs
    assert all_reduce_us(MIB64, 8, link) == pytest.approx(361.12952, rel=1e-7)


def test_collectives_inter_by_hand(hw):
    link = hw.inter_node
    # n=2: 40 + 1/2 * 67,108,864 / 50e9 s = 40 + 671.08864 µs
    assert all_gather_us(MIB64, 2, link) == pytest.approx(711.08864, rel=1e-9)
    assert reduce_scatter_us(MIB64, 2, link) == pytest.approx(711.08864, rel=1e-9)
    assert all_to_all_us(MIB64, 2, link) == pytest.approx(711.08864, rel=1e-9)
    # 2 * 40 + 2 * 1/2 * 67,108,864 / 50e9 s = 80 + 1342.17728 µs
    assert all_reduce_us(MIB64, 2, link) == pytest.approx(1422.17728, rel=1e-9)


def test_group_of_one_is_free_and_vectorised_matches(hw):
    assert all_reduce_us(MIB64, 1, hw.intra_node) == 0.0
    sizes = np.array([0, 1024, MIB64, 3 * MIB64])
    groups = np.array([1, 2, 8, 4])
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        vec = collective_us(kind, sizes, groups, hw.inter_node)
        for k in range(len(sizes)):
            assert vec[k] == collective_us(kind, int(sizes[k]), int(groups[k]), hw.inter_node)
        assert vec[0] == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_us("broadcast", 1, 2, hw.intra_node)


@pytest.mark.parametrize(
    ("mesh", "links"),
    [
        ((8,), ("intra",)),
        ((8, 8), ("inter", "intra")),
        ((2, 4, 8), ("inter", "inter", "intra")),
        ((2, 4), ("intra", "intra")),
        ((16,), ("inter",)),
        ((4, 2, 2), ("inter", "intra", "intra")),
    ],
)
def test_mesh_dim_link(mesh, links):
    assert tuple(mesh_dim_link(mesh, m, 8) for m in range(len(mesh))) == links


def test_mesh_collective_picks_link_and_group(hw):
    # dim 0 of (8, 8) is inter-node with 8 ranks, one per node (one rail each: the NIC
    # bandwidth); dim 1 intra-node with 8 ranks
    assert mesh_collective_us("all_gather", MIB64, (8, 8), 0, hw) == all_gather_us(
        MIB64, 8, hw.inter_node
    )
    assert mesh_collective_us("all_gather", MIB64, (8, 8), 1, hw) == all_gather_us(
        MIB64, 8, hw.intra_node
    )
    with pytest.raises(ValueError, match="out of range"):
        mesh_dim_link((2, 4), 2, 8)


def test_alpha_beta_by_hand():
    # 31 + 2 * 7/8 * 67,108,864 / 270e9 s = 31 + 434.96486 µs; a group of one: 0
    assert alpha_beta_us(2.0, 31.0, 270e9, MIB64, 8) == pytest.approx(465.96486, rel=1e-7)
    assert alpha_beta_us(2.0, 31.0, 270e9, MIB64, 1) == 0.0
    vec = alpha_beta_us(np.array([2.0, 1.0]), 31.0, 270e9, np.array([MIB64, MIB64]),
                        np.array([8, 1]))
    assert vec.tolist() == [alpha_beta_us(2.0, 31.0, 270e9, MIB64, 8), 0.0]


@pytest.mark.parametrize("mesh", [(2, 4, 8), (8, 8), (1, 4), (16,)])
def test_vectorised_mesh_collectives_equal_scalar(mesh, hw):
    # every (collective, mesh dim) pair, odd sizes: the array path the redistribution
    # steps use is bit-identical to the scalar helper (groups of one cost 0)
    rng = random.Random(len(mesh))
    kinds, dims, sizes = [], [], []
    for k, m in itertools.product(range(len(COLLECTIVES)), range(len(mesh))):
        for size in (0, 1, rng.randrange(1, 1 << 30), MIB64 + 3):
            kinds.append(k)
            dims.append(m)
            sizes.append(size)
    params = mesh_collective_params(mesh, hw)
    vec = mesh_collectives_us(np.array(kinds), np.array(sizes), np.array(dims), params)
    for t, k, m, size in zip(vec.tolist(), kinds, dims, sizes, strict=True):
        assert t == mesh_collective_us(COLLECTIVES[k], size, mesh, m, hw), (k, m, size)
        assert (t == 0.0) == (mesh[m] == 1)
    # reading only the used entries gives the same values there, NaN elsewhere
    part = mesh_collective_params(mesh, hw, [(0, 2)])
    assert part.lat[0, 2] == params.lat[0, 2] and part.bw[0, 2] == params.bw[0, 2]
    assert np.isnan(part.lat).sum() == part.lat.size - 1


# --------------------------------------------------------------------------- redistribute

SHAPE = (1024, 4096)  # bf16: 8,388,608 B
FULL = 1024 * 4096 * 2
MESH = (2, 4)  # 8 GPUs: both dims intra-node


def test_shard_to_replicate_is_one_all_gather(hw):
    steps = plan(pp("S(0)R"), pp("RR"))
    assert [(s.mesh_dim, s.kind) for s in steps] == [(0, "all_gather")]
    # gathered output = the full tensor, 8,388,608 B; n = 2:
    # 30 + 1/2 * 8,388,608 / 390e9 s = 30 + 10.7546 µs; dim 0 -> no reshuffle
    t = redistribute_us(SHAPE, 2, pp("S(0)R"), pp("RR"), MESH, hw)
    assert t == all_gather_us(FULL, 2, hw.intra_node)
    assert t == pytest.approx(40.754626, rel=1e-7)


def test_partial_to_replicate_is_all_reduce(hw):
    # 2 * 30 + 2 * 1/2 * 8,388,608 / 390e9 s = 60 + 21.50925 µs
    t = redistribute_us(SHAPE, 2, pp("PR"), pp("RR"), MESH, hw)
    assert [s.kind for s in plan(pp("PR"), pp("RR"))] == ["all_reduce"]
    assert t == all_reduce_us(FULL, 2, hw.intra_node)
    assert t == pytest.approx(81.509251, rel=1e-7)


def test_partial_to_shard_is_reduce_scatter(hw):
    # input = full 8,388,608 B: 30 + 10.7546 µs
    t = redistribute_us(SHAPE, 2, pp("PR"), pp("S(0)R"), MESH, hw)
    assert [s.kind for s in plan(pp("PR"), pp("S(0)R"))] == ["reduce_scatter"]
    assert t == reduce_scatter_us(FULL, 2, hw.intra_node)


def test_shard_to_shard_is_all_to_all(hw):
    # local = 512 x 4096 x 2 B = 4,194,304 B: 30 + 1/2 * 4,194,304 / 390e9 s = 35.3773 µs,
    # + local reshuffle (target dim 1 is not leading) 2 * 4,194,304 / 2.345e12 s = 3.5773 µs
    assert [s.kind for s in plan(pp("S(0)R"), pp("S(1)R"))] == ["all_to_all"]
    t = redistribute_us(SHAPE, 2, pp("S(0)R"), pp("S(1)R"), MESH, hw)
    local = FULL // 2
    expected = all_to_all_us(local, 2, hw.intra_node) + 2 * local / HBM_EFF * 1e6
    assert t == pytest.approx(expected, rel=1e-12)
    assert t == pytest.approx(35.377313 + 3.577231, rel=1e-6)


def test_gather_on_non_leading_dim_adds_reshuffle(hw):
    t = redistribute_us(SHAPE, 2, pp("S(1)R"), pp("RR"), MESH, hw)
    assert t == pytest.approx(all_gather_us(FULL, 2, hw.intra_node) + 2 * FULL / HBM_EFF * 1e6)


def test_replicate_to_partial_is_free_and_local_slices(hw):
    assert redistribute_us(SHAPE, 2, pp("RR"), pp("PR"), MESH, hw) == 0.0
    assert redistribute_us(SHAPE, 2, pp("RR"), pp("PP"), MESH, hw) == 0.0
    assert redistribute_us(SHAPE, 2, pp("RR"), pp("S(0)R"), MESH, hw) == 0.0
    # R -> S(1): local copy of the 1024 x 2048 slice: 2 * 4,194,304 / 2.345e12 s
    t = redistribute_us(SHAPE, 2, pp("RR"), pp("S(1)R"), MESH, hw)
    assert t == pytest.approx(2 * (FULL // 2) / HBM_EFF * 1e6)
    assert redistribute_us(SHAPE, 2, pp("S(0)R"), pp("S(0)R"), MESH, hw) == 0.0


@pytest.mark.parametrize(
    ("src", "dst"),
    [("S(0)R", "PR"), ("PR", "P(max)R"), ("RS(0)", "PP"), ("P(max)P", "RR"), ("PR", "P(avg)R")],
)
def test_illegal_redistributions_are_inf(src, dst, hw):
    assert plan(pp(src), pp(dst)) is None
    assert redistribute_us(SHAPE, 2, pp(src), pp(dst), MESH, hw) == math.inf


def test_second_step_bytes_account_for_other_mesh_dim(hw):
    # (S(0), P) -> (R, S(1)) on (2, 4), fp32 [4096, 8192] (134,217,728 B). DTensor's greedy
    # planner runs mesh dim 1 first, then mesh dim 0:
    #  1. mesh dim 1 (n=4): P -> S(1) reduce-scatter; tensor sharded on dim 0 by mesh dim 0,
    #     so the input is 2048 x 8192 x 4 B = 67,108,864 B; scatter dim 1 -> reshuffle.
    #  2. mesh dim 0 (n=2): S(0) -> R all-gather; tensor dim 1 now sharded 4-way by mesh
    #     dim 1, so the gathered output is 4096 x 2048 x 4 B = 33,554,432 B (not 128 MiB).
    steps = plan(pp("S(0)P"), pp("RS(1)"))
    assert [(s.mesh_dim, s.kind) for s in steps] == [(1, "reduce_scatter"), (0, "all_gather")]
    assert steps[1].divs == ((1, 1),)
    t = redistribute_us((4096, 8192), 4, pp("S(0)P"), pp("RS(1)"), MESH, hw)
    rs_in = 2048 * 8192 * 4
    ag_out = 4096 * 2048 * 4
    expected = (
        reduce_scatter_us(rs_in, 4, hw.intra_node)
        + 2 * rs_in / HBM_EFF * 1e6
        + all_gather_us(ag_out, 2, hw.intra_node)
    )
    assert t == pytest.approx(expected, rel=1e-12)


def test_redistribute_steps_bytes_and_times(hw):
    # the two steps of test_second_step_bytes_account_for_other_mesh_dim, each costed
    # with the comm helpers (bit for bit) plus the reshuffle of the reduce-scatter input
    rs_in = 2048 * 8192 * 4
    ag_out = 4096 * 2048 * 4
    steps = redistribute_steps((4096, 8192), 4, pp("S(0)P"), pp("RS(1)"), MESH, hw)
    assert steps == [
        StepCost("reduce_scatter", 1, rs_in,
                 reduce_scatter_us(rs_in, 4, hw.intra_node) + 2 * rs_in / HBM_EFF * 1e6),
        StepCost("all_gather", 0, ag_out, all_gather_us(ag_out, 2, hw.intra_node)),
    ]
    assert steps[0].us + steps[1].us == redistribute_us(
        (4096, 8192), 4, pp("S(0)P"), pp("RS(1)"), MESH, hw)
    # a size-1 mesh dim is no step; equal placements none; illegal None
    assert redistribute_steps(SHAPE, 2, pp("PS(0)"), pp("RR"), (1, 4), hw) == [
        StepCost("all_gather", 1, FULL, all_gather_us(FULL, 4, hw.intra_node))]
    assert redistribute_steps(SHAPE, 2, pp("S(0)R"), pp("S(0)R"), MESH, hw) == []
    assert redistribute_steps(SHAPE, 2, pp("S(0)R"), pp("PR"), MESH, hw) is None


def test_inter_node_step_and_uneven_shard(hw):
    # (2, 8): mesh dim 0 crosses nodes. Full bf16 8,388,608 B: 40 + 1/2 * 8.39e6 / 50e9 s
    t = redistribute_us(SHAPE, 2, pp("S(0)R"), pp("RR"), (2, 8), hw)
    assert t == pytest.approx(40 + 0.5 * FULL / 50e9 * 1e6)
    # uneven: [7, 3] fp32 on 2 ranks, the largest shard has ceil(7/2) = 4 rows:
    # gathered (padded) buffer 2 * 4 * 3 * 4 B = 96 B
    t = redistribute_us((7, 3), 4, pp("S(0)"), pp("R"), (2,), hw)
    assert t == all_gather_us(96, 2, hw.intra_node)


def test_nested_sharding_replans_like_dtensor(hw):
    # (S(0), S(0)) -> (R, S(0)): DTensor must unshard the inner dim first
    steps = plan(pp("S(0)S(0)"), pp("RS(0)"))
    assert [(s.mesh_dim, s.kind) for s in steps] == [
        (1, "all_gather"),
        (0, "all_gather"),
        (1, "local_shard"),
    ]


def test_negative_dims_and_size_one_mesh_dims(hw):
    a = redistribute_us(SHAPE, 2, pp("S(-1)R"), pp("RR"), MESH, hw)
    b = redistribute_us(SHAPE, 2, pp("S(1)R"), pp("RR"), MESH, hw)
    assert a == b
    assert redistribute_us(SHAPE, 2, pp("PS(0)"), pp("RR"), (1, 4), hw) == all_gather_us(
        FULL, 4, hw.intra_node
    )


def test_bad_inputs_raise(hw):
    with pytest.raises(ValueError, match="3-d tensor|2-d tensor"):
        redistribute_us(SHAPE, 2, pp("S(2)R"), pp("RR"), MESH, hw)
    with pytest.raises(ValueError, match="2-d mesh"):
        redistribute_us(SHAPE, 2, pp("S(0)"), pp("R"), MESH, hw)
    with pytest.raises(ValueError, match="itemsize"):
        redistribute_us(SHAPE, 0, pp("RR"), pp("RR"), MESH, hw)


def test_plan_is_cached():
    assert plan(pp("S(0)RP"), pp("RS(1)R")) is plan(pp("S(0)RP"), pp("RS(1)R"))


def test_table_matches_scalar_bit_for_bit(hw):
    toks = ["R", "S(0)", "S(1)", "P"]
    pls = [pp("".join(c)) for c in itertools.product(toks, repeat=3)]
    rng = random.Random(0)
    srcs = rng.sample(pls, 24)
    dsts = rng.sample(pls, 24)
    mesh = (2, 4, 8)
    shape = (1000, 2047)  # uneven on purpose
    table = redistribute_table(shape, 4, srcs, dsts, mesh, hw)
    assert table.shape == (24, 24)
    for i, s in enumerate(srcs):
        for j, d in enumerate(dsts):
            assert table[i, j] == redistribute_us(shape, 4, s, d, mesh, hw), (s, d)
    sq = redistribute_table(shape, 4, pls, pls, mesh, hw)
    assert np.all(np.diag(sq) == 0.0)
    assert np.isinf(sq).any() and np.isfinite(sq).any()
    assert not np.isnan(sq).any()
    # cached compile, fresh result arrays
    sq[0, 1] = -1.0
    assert redistribute_table(shape, 4, pls, pls, mesh, hw)[0, 1] != -1.0


def test_mask_partial_redistribution(hw):
    # row-wise embedding output: _MaskPartial -> R is an all-reduce; R -> MP is local
    mp = "MP(0,128256x2048)"
    assert redistribute_us(SHAPE, 2, pp(mp + "R"), pp("RR"), MESH, hw) == all_reduce_us(
        FULL, 2, hw.intra_node
    )
    assert redistribute_us(SHAPE, 2, pp("RR"), pp(mp + "R"), MESH, hw) == 0.0
    # two separately parsed, equal-valued _MaskPartials are the same placement
    assert redistribute_us(SHAPE, 2, pp(mp + "R"), pp(mp + " R"), MESH, hw) == 0.0
    assert redistribute_us(SHAPE, 2, pp(mp + "R"), pp("PR"), MESH, hw) == math.inf


def test_plans_match_dtensor_with_a_fake_process_group():
    """Our process-group-free planning mesh gives DTensor's plans on a real (fake-PG) mesh."""
    code = textwrap.dedent(
        """
        import itertools, torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
        from pipeline.costmodel.redistribute import plan
        from pipeline.dtensor.placements import parse_placements as pp
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        mesh = init_device_mesh("cpu", (2, 4))
        meta = TensorMeta(torch.Size([64, 64]), (64, 1), torch.float32)
        toks = ["R", "S(0)", "S(1)", "P"]
        pls = [pp(a + b) for a, b in itertools.product(toks, repeat=2)]
        n = 0
        for s, d in itertools.product(pls, pls):
            ours = plan(s, d)
            if ours is None:
                continue
            ref = _gen_transform_infos_non_cached(
                DTensorSpec(mesh, s, tensor_meta=meta), DTensorSpec(mesh, d, tensor_meta=meta))
            assert [(i.mesh_dim, *i.src_dst_placements) for i in ref] == [
                (st.mesh_dim, st.src, st.dst) for st in ours], (s, d)
            n += 1
        print("OK", n)
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("OK")


def test_strided_shard_plans_use_the_real_mesh_and_shape(hw):
    # (SS(0,4), S(0)) on (2, 4) is FSDP2+TP's right-to-left sharding of dim 0: DTensor's
    # Dijkstra planner unshards it with two all-gathers, inner order first.
    src, dst = pp("SS(0,4)S(0)"), pp("RR")
    steps = plan(src, dst, MESH, SHAPE)
    assert [(s.mesh_dim, s.kind) for s in steps] == [(0, "all_gather"), (1, "all_gather")]
    # step 1 gathers over mesh dim 0 while mesh dim 1 still shards dim 0 4-way:
    # output 1024/4 rows = 2,097,152 B; step 2 gathers the full 8,388,608 B over 4 ranks
    t = redistribute_us(SHAPE, 2, src, dst, MESH, hw)
    expected = all_gather_us(FULL // 4, 2, hw.intra_node) + all_gather_us(FULL, 4, hw.intra_node)
    assert t == pytest.approx(expected, rel=1e-12)
    pls = [pp(t) for t in ("RR", "S(0)S(0)", "SS(0,4)S(0)", "PR", "RS(1)", "SS(1,4)S(1)")]
    table = redistribute_table(SHAPE, 2, pls, pls, MESH, hw)
    for i, a in enumerate(pls):
        for j, b in enumerate(pls):
            assert table[i, j] == redistribute_us(SHAPE, 2, a, b, MESH, hw)


# --------------------------------------------------------------------------- group factors

_TOY2 = dict(name="toy", dim=256, n_layers=3, n_heads=8, n_kv_heads=4,
             ffn_dim_multiplier=1.0, multiple_of=256, ffn_hidden_overrides={},
             rope_theta=500000.0, norm_eps=1e-5, vocab_size=1024, seq_len=64,
             batch_size=16, param_dtype="bfloat16", reduce_dtype="float32")


@pytest.fixture(scope="module")
def toy_2x4(tmp_path_factory):
    from fixtures import traced_topology

    return traced_topology(tmp_path_factory.mktemp("toy2x4"), _TOY2, (2, 4), ("dp", "tp"))


def test_group_factors_equal_the_dense_sum_of_their_edges(toy_2x4, hw):
    """Every lazy group factor (class form, parts added in place, memoised tables
    dropped once read) equals, bit for bit, the dense ``[K_u, K_v]`` sum of its member
    edges' tables in graph-edge order from a cost model that memoises nothing; the memo
    is empty once every factor exists."""
    from pipeline.costmodel.factors import FactorProvider, group_structure
    from pipeline.costmodel.model import CostModel

    groups = group_structure(toy_2x4)
    lazy = FactorProvider(CostModel(toy_2x4, hw, memoise=True), groups)
    plain = CostModel(toy_2x4, hw, memoise=False)
    multi = 0
    for ge, members in enumerate(groups.edge_members):
        lo, hi = (int(x) for x in groups.edges[ge])
        dense = np.zeros((int(groups.domain[lo]), int(groups.domain[hi])))
        for e, flipped in members:
            r, c, t = plain.edge_table(e)
            part = t[np.ix_(r, c)]
            dense = dense + (part.T if flipped else part)
        f = lazy.factor(ge)
        assert np.array_equal(f.table[np.ix_(f.row_cls, f.col_cls)], dense), ge
        multi += len(members) > 1
    assert multi > 0  # the repeated layers' group edges have several members
    assert lazy.cost_model._table_memo == {}


def test_as_hardware_gives_the_group_values_as_plain_attributes():
    from omegaconf import DictConfig

    from pipeline.config.compose import load_resolved
    from pipeline.costmodel.hardware import (
        HardwareConfig,
        as_hardware,
        hardware_key,
        load_hardware,
    )

    hw = load_resolved(["hardware=h100"]).hardware
    assert isinstance(hw, DictConfig)
    plain = as_hardware(hw)
    assert isinstance(plain, HardwareConfig) and as_hardware(plain) is plain
    assert hardware_key(plain) == hardware_key(hw)
    h100 = Path(__file__).resolve().parents[2] / "conf" / "hardware" / "h100.yaml"
    assert hardware_key(plain) == hardware_key(load_hardware(str(h100)))
    assert (plain.intra_node.bandwidth, plain.inter_node.latency_us) == (
        float(hw.intra_node.bandwidth), float(hw.inter_node.latency_us))
