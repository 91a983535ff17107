"""The link model (pipeline/costmodel/comm.py): group layouts over nodes, multi-NIC rails,
all-reduce = reduce-scatter + all-gather, the same physical collective on any mesh,
hierarchical all-reduce, the hardware presets and the validation of the link keys.

Hand-worked with the H100 preset (conf/hardware/h100.yaml): NVLink ring bus bandwidth
B = 390e9 B/s, 30 µs per ring pass inside a node; one NIC b = 50e9 B/s (400 Gb/s), 40 µs
per ring pass across nodes; 8 GPUs and 8 NICs per node. S = 64 MiB = 67,108,864 B.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.config import ConfigError, load_resolved
from pipeline.costmodel.comm import (
    GroupLayout,
    all_gather_us,
    all_reduce_us,
    collective_us,
    group_collective_params,
    group_collective_us,
    mesh_collective_params,
    mesh_collective_us,
    mesh_collectives_us,
    mesh_dim_layout,
    mesh_group_layout,
    rail_bandwidth_per_rank,
    reduce_scatter_us,
)
from pipeline.costmodel.hardware import COLLECTIVES, HardwareConfig, LinkConfig, load_hardware
from pipeline.stages import runner as cli

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ("a100", "h100", "h200", "b200")
S = 64 * 1024 * 1024  # 67,108,864 B


@pytest.fixture(scope="module")
def hw() -> HardwareConfig:
    return load_hardware(str(ROOT / "conf" / "hardware" / "h100.yaml"))


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize(("mesh", "dims", "layout"), [
    # ranks row-major, 8 per node: (size, members per node, nodes spanned)
    ((64,), 0, (64, 8, 8)),
    ((8, 8), 0, (8, 1, 8)),          # dp: stride 8, one rank per node
    ((8, 8), 1, (8, 8, 1)),          # tp: ranks 8i..8i+7, one node
    ((8, 8), (0, 1), (64, 8, 8)),    # both dims: the flat 64 group
    ((2, 4, 8), 0, (2, 1, 2)),       # stride 32
    ((2, 4, 8), 1, (4, 1, 4)),       # stride 8
    ((2, 4, 8), 2, (8, 8, 1)),
    ((2, 4, 8), (0, 1), (8, 1, 8)),
    ((2, 4, 8), (1, 2), (32, 8, 4)),
    ((2, 4, 8), (0, 1, 2), (64, 8, 8)),
    ((16, 4), 0, (16, 2, 8)),        # stride 4: ranks 0, 4 on node 0, 8, 12 on node 1 ...
    ((4, 16), 1, (16, 8, 2)),
    ((4, 16), 0, (4, 1, 4)),
    ((2, 4), 0, (2, 2, 1)),          # 8 GPUs: everything inside the node
    # non-uniform: (2, 6) dim 1 has groups {0..5} on node 0 and {6..11} = 2 on node 0 +
    # 4 on node 1: priced by the narrowest node (2 members) and the most nodes (2)
    ((2, 6), 1, (6, 2, 2)),
    # dim 0 pairs {r, r+6}: {0,6}, {1,7} inside node 0, {2,8} ... across: 1 member, 2 nodes
    ((2, 6), 0, (2, 1, 2)),
])
def test_group_layout_by_hand(mesh, dims, layout):
    assert mesh_group_layout(mesh, dims, 8) == GroupLayout(*layout)


def test_group_layout_bad_dims():
    assert mesh_dim_layout((8, 8), -1, 8) == GroupLayout(8, 8, 1)
    with pytest.raises(ValueError, match="out of range"):
        mesh_group_layout((2, 4), 2, 8)
    with pytest.raises(ValueError, match="distinct"):
        mesh_group_layout((2, 4), (0, 0), 8)


# --------------------------------------------------------------------------- rails


@pytest.mark.parametrize(("mesh", "dim", "members", "busbw"), [
    # 1 member per node: one rail, 50 GB/s (no NVLink hop in the ring)
    ((8, 8), 0, 1, 50e9),
    # 2 members per node: 2 rails, 2 * 50 = 100 GB/s
    ((16, 4), 0, 2, 100e9),
    # 8 members per node: all 8 rails, 400 GB/s, but the ring's NVLink edges run at
    # 390 GB/s: min(390, 400) = 390 GB/s
    ((64,), 0, 8, 390e9),
])
def test_multi_nic_bus_bandwidth_by_members_per_node(mesh, dim, members, busbw, hw):
    layout = mesh_dim_layout(mesh, dim, 8)
    assert layout.per_node == members and layout.spans_nodes
    # each rank's rail share: min(min(m, 8) * 50 / m, 8 * 50 / 8) = 50 GB/s
    assert rail_bandwidth_per_rank(layout, hw) == 50e9
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert group_collective_params(kind, layout, hw)[1] == busbw
    # latency: 40 µs per ring pass
    assert group_collective_params("all_gather", layout, hw)[0] == 40.0
    assert group_collective_params("all_reduce", layout, hw)[0] == 80.0


def test_multi_nic_times_by_hand(hw):
    # 2 members per node, n = 16: 40 + 15/16 * 67,108,864 / 100e9 s = 40 + 629.1456 µs
    assert mesh_collective_us("all_gather", S, (16, 4), 0, hw) == pytest.approx(
        669.1456, rel=1e-12)
    # flat 64: 40 + 63/64 * 67,108,864 / 390e9 s = 40 + 169.38535 µs
    assert mesh_collective_us("all_gather", S, (64,), 0, hw) == pytest.approx(
        209.385354, rel=1e-8)
    # one member per node, n = 8: 40 + 7/8 * S / 50e9 s = 40 + 1174.40512 µs
    assert mesh_collective_us("all_gather", S, (8, 8), 0, hw) == pytest.approx(
        1214.40512, rel=1e-12)


@pytest.mark.parametrize(("nics", "busbw"), [
    # 4 NICs for 8 GPUs: every GPU of the node is in some group at once, so a rank gets
    # at most 4 * 50 / 8 = 25 GB/s: m=1 -> 25, m=2 -> 2 * min(2*50/2, 25) = 50,
    # m=8 -> 8 * min(4*50/8, 25) = 200 (below NVLink's 390)
    (4, (25e9, 50e9, 200e9)),
    # 16 NICs: a member drives at most one NIC: m=1 -> 50, m=2 -> 100, m=8 -> 390
    (16, (50e9, 100e9, 390e9)),
])
def test_rails_shared_by_concurrent_groups(nics, busbw, hw):
    h = dataclasses.replace(hw, nics_per_node=nics)
    got = tuple(group_collective_params("all_gather", mesh_dim_layout(mesh, 0, 8), h)[1]
                for mesh in ((8, 8), (16, 4), (64,)))
    assert got == busbw


def test_all_to_all_across_nodes_by_hand(hw):
    # flat 64 (m = 8): each rank sends 7/64 S over NVLink and 56/64 S over its 50 GB/s
    # rail share, concurrently: busbw = 63 / max(7 / 390e9, 56 / 50e9) = 56.25 GB/s
    layout = mesh_dim_layout((64,), 0, 8)
    assert group_collective_params("all_to_all", layout, hw) == (40.0, 63 / (56 / 50e9))
    assert group_collective_us("all_to_all", S, layout, hw) == pytest.approx(
        40 + 63 / 64 * S / 56.25e9 * 1e6, rel=1e-12)
    # one member per node: all traffic on the rail: busbw = 7 / (7 / 50e9) = 50 GB/s
    lat, bw = group_collective_params("all_to_all", mesh_dim_layout((8, 8), 0, 8), hw)
    assert bw == pytest.approx(50e9, rel=1e-15)
    # inside a node: NVLink
    assert group_collective_params("all_to_all", mesh_dim_layout((8, 8), 1, 8), hw) == (
        30.0, 390e9)


# --------------------------------------------------------------------------- all-reduce


@pytest.mark.parametrize(("mesh", "dims"), [
    ((8,), 0), ((8, 8), 0), ((8, 8), 1), ((64,), 0), ((16, 4), 0), ((2, 4, 8), 1),
    ((2, 6), 1), ((8, 8), (0, 1))])
@pytest.mark.parametrize("nbytes", [1, 4096, S, 3 * S + 7])
def test_all_reduce_is_reduce_scatter_plus_all_gather(mesh, dims, nbytes, hw):
    # ring all-reduce = reduce-scatter + all-gather of the same buffer, bit for bit
    ar = mesh_collective_us("all_reduce", nbytes, mesh, dims, hw)
    rs = mesh_collective_us("reduce_scatter", nbytes, mesh, dims, hw)
    ag = mesh_collective_us("all_gather", nbytes, mesh, dims, hw)
    assert ar == rs + ag


def test_all_reduce_by_hand(hw):
    # inside a node, n = 8: 2 * 30 + 2 * 7/8 * S / 390e9 s = 60 + 301.12952 µs
    assert mesh_collective_us("all_reduce", S, (8, 8), 1, hw) == pytest.approx(
        361.129518, rel=1e-8)
    # single-tier helpers agree with the ring on one link
    link = LinkConfig(bandwidth=390e9, latency_us=30.0)
    assert all_reduce_us(S, 8, link) == reduce_scatter_us(S, 8, link) + all_gather_us(S, 8, link)


def test_hierarchical_all_reduce_by_hand(hw):
    # flat 64 (8 nodes x 8): intra reduce-scatter 30 + 7/8 S / 390e9 = 180.56476 µs;
    # inter all-reduce of S/8 across the 8 nodes on each rail (50 GB/s per rank):
    # 80 + 2 * 7/8 * (S/8) / 50e9 = 80 + 293.60128 µs; intra all-gather 180.56476 µs
    hier = dataclasses.replace(hw, hierarchical_all_reduce=True)
    t = mesh_collective_us("all_reduce", S, (64,), 0, hier)
    intra = LinkConfig(bandwidth=390e9, latency_us=30.0)
    rail = LinkConfig(bandwidth=50e9, latency_us=40.0)
    stages = (reduce_scatter_us(S, 8, intra) + all_reduce_us(S // 8, 8, rail)
              + all_gather_us(S, 8, intra))
    assert t == pytest.approx(stages, rel=1e-12)
    assert t == pytest.approx(734.730798, rel=1e-8)
    # the flat ring overlaps the NVLink and rail edges: 80 + 2 * 63/64 * S / 390e9
    assert mesh_collective_us("all_reduce", S, (64,), 0, hw) == pytest.approx(
        418.770708, rel=1e-8)
    # with one member per node or inside a node the switch changes nothing
    for mesh, dim in (((8, 8), 0), ((8, 8), 1)):
        assert mesh_collective_us("all_reduce", S, mesh, dim, hier) == mesh_collective_us(
            "all_reduce", S, mesh, dim, hw)


# --------------------------------------------------------------------------- same plan


def test_same_physical_all_gather_costs_the_same_on_any_mesh(hw):
    """FSDP's all-gather of a parameter over all 64 ranks (8 nodes x 8): one collective
    over the same 64-rank group is the same physical operation on (64,), on both dims of
    (8, 8) and on all three of (2, 4, 8), and costs the same, bit for bit."""
    for kind in COLLECTIVES:
        flat = mesh_collective_us(kind, S, (64,), 0, hw)
        assert mesh_collective_us(kind, S, (8, 8), (0, 1), hw) == flat
        assert mesh_collective_us(kind, S, (2, 4, 8), (0, 1, 2), hw) == flat
        assert mesh_collective_us(kind, S, (4, 16), (1, 0), hw) == flat


def test_per_dim_decompositions_of_the_64_rank_all_gather(hw):
    """A mesh-dim-by-mesh-dim plan issues two collectives; their cost depends on the order.

    dp (rails) first on the 1/8 shard, then tp (NVLink) on the full buffer, the
    hierarchical all-gather: 40 + 7/8 (S/8) / 50e9 + 30 + 7/8 S / 390e9
    = 40 + 146.80064 + 30 + 150.56476 = 367.36540 µs.
    tp first, then dp on the full buffer (DTensor's order for (S(0), S(0)) -> (R, R)):
    30 + 7/8 (S/8) / 390e9 + 40 + 7/8 S / 50e9 = 30 + 18.82060 + 40 + 1174.40512
    = 1263.22572 µs: each rank sends 7/8 S on its own rail.
    The flat ring (209.38535 µs) overlaps its NVLink and rail edges.
    """
    dp_tp = (mesh_collective_us("all_gather", S // 8, (8, 8), 0, hw)
             + mesh_collective_us("all_gather", S, (8, 8), 1, hw))
    tp_dp = (mesh_collective_us("all_gather", S // 8, (8, 8), 1, hw)
             + mesh_collective_us("all_gather", S, (8, 8), 0, hw))
    flat = mesh_collective_us("all_gather", S, (64,), 0, hw)
    assert dp_tp == pytest.approx(367.365399, rel=1e-8)
    assert tp_dp == pytest.approx(1263.225715, rel=1e-8)
    assert flat < dp_tp < tp_dp


# --------------------------------------------------------------------------- vectorised


@pytest.mark.parametrize("mesh", [(64,), (16, 4), (2, 6), (2, 4, 8), (4, 2, 2, 4)])
@pytest.mark.parametrize("variant", ["h100", "hierarchical", "4nics"])
def test_vectorised_equals_scalar_on_multi_node_layouts(mesh, variant, hw):
    h = {"h100": hw, "hierarchical": dataclasses.replace(hw, hierarchical_all_reduce=True),
         "4nics": dataclasses.replace(hw, nics_per_node=4)}[variant]
    kinds, dims, sizes = [], [], []
    for k, m in itertools.product(range(len(COLLECTIVES)), range(len(mesh))):
        for size in (0, 1, 12345, S + 3):
            kinds.append(k)
            dims.append(m)
            sizes.append(size)
    params = mesh_collective_params(mesh, h)
    vec = mesh_collectives_us(np.array(kinds), np.array(sizes), np.array(dims), params)
    for t, k, m, size in zip(vec.tolist(), kinds, dims, sizes, strict=True):
        assert t == mesh_collective_us(COLLECTIVES[k], size, mesh, m, h), (k, m, size)
    # a DictConfig built by Hydra gives the same parameters
    cfg = OmegaConf.structured(h)
    again = mesh_collective_params(mesh, cfg)
    assert again.key() == params.key()


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", PRESETS)
def test_preset_keys_match_schema_and_compose(name):
    path = ROOT / "conf" / "hardware" / f"{name}.yaml"
    data = OmegaConf.to_container(OmegaConf.load(path))
    assert set(data) == {f.name for f in dataclasses.fields(HardwareConfig)}
    link = {f.name for f in dataclasses.fields(LinkConfig)}
    assert set(data["intra_node"]) == link and set(data["inter_node"]) == link
    cfg = load_resolved([f"hardware={name}"])
    assert cfg.hardware.name == name
    assert OmegaConf.to_object(cfg.hardware) == load_hardware(str(path))


def test_preset_values():
    hw = {n: load_hardware(str(ROOT / "conf" / "hardware" / f"{n}.yaml")) for n in PRESETS}
    # A100: HDR 200 Gb/s = 25e9 B/s per NIC; NVLink 3 300 GB/s one way * 390/450
    assert hw["a100"].inter_node.bandwidth == 25e9
    assert hw["a100"].intra_node.bandwidth == 260e9
    assert hw["a100"].device_memory_bytes == 80 * 2**30
    assert hw["h100"] == HardwareConfig()
    # H200: H100 compute and links, 141 GB at 4.8 TB/s
    assert (hw["h200"].peak_flops_bf16, hw["h200"].intra_node) == (
        hw["h100"].peak_flops_bf16, hw["h100"].intra_node)
    assert hw["h200"].hbm_bandwidth == 4.8e12 and hw["h200"].device_memory_bytes == 141e9
    # B200: NVLink 5 900 GB/s one way * 390/450 = 780 GB/s; 1,440 GB / 8 = 180 GB
    assert hw["b200"].intra_node.bandwidth == 780e9
    assert hw["b200"].device_memory_bytes == 180e9
    for h in hw.values():
        assert (h.gpus_per_node, h.nics_per_node, h.hierarchical_all_reduce) == (8, 8, False)
    # an A100 flat 64 all-gather: 8 rails x 25 GB/s = 200 GB/s < NVLink 260 GB/s
    assert group_collective_params("all_gather", GroupLayout(64, 8, 8), hw["a100"])[1] == 200e9
    # a B200 one: 8 x 50 = 400 GB/s < 780
    assert group_collective_params("all_gather", GroupLayout(64, 8, 8), hw["b200"])[1] == 400e9


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("override", "message"), [
    ("hardware.nics_per_node=0", "hardware.nics_per_node=0 is invalid: must be an integer >= 1"),
    ("hardware.nics_per_node=-2", "hardware.nics_per_node=-2 is invalid: must be an integer >= 1"),
    ("hardware.nics_per_node=2.5", "hardware.nics_per_node=2.5: allowed an integer"),
    ("hardware.nics_per_node=many", "hardware.nics_per_node=many: allowed an integer"),
    ("hardware.inter_node.bandwidth=0",
     "hardware.inter_node.bandwidth=0.0 is invalid: must be a number > 0 (bytes/s)"),
    ("hardware.inter_node.bandwidth=-5e10",
     "hardware.inter_node.bandwidth=-50000000000.0 is invalid: must be a number > 0 (bytes/s)"),
    ("hardware.inter_node.bandwidth=fast", "hardware.inter_node.bandwidth=fast: allowed a number"),
    ("hardware.intra_node.bandwidth=inf",
     "hardware.intra_node.bandwidth=inf: allowed a finite number (inf, -inf and nan are "
     "refused)"),
    ("hardware.intra_node.latency_us=-1",
     "hardware.intra_node.latency_us=-1.0 is invalid: must be a number >= 0 (µs)"),
    ("hardware.inter_node.latency_us=soon",
     "hardware.inter_node.latency_us=soon: allowed a number"),
    ("hardware.device_memory_bytes=0",
     "hardware.device_memory_bytes=0 is invalid: must be an integer > 0 (bytes)"),
    ("hardware.hierarchical_all_reduce=maybe",
     "hardware.hierarchical_all_reduce=maybe: allowed true, false"),
    ("hardware=tpu", "hardware=tpu: allowed a100, b200, cpu_epyc2, h100, h100_96gb, h200, "
                     "test_tables"),
])
def test_bad_link_values_are_one_line_and_exit_2(override, message, tmp_path, monkeypatch,
                                                capsys):
    with pytest.raises(ConfigError) as err:
        load_resolved([override])
    assert str(err.value) == message
    monkeypatch.chdir(tmp_path)
    code = cli.main(["costs", override, f"results_dir={tmp_path / 'results'}"])
    out, text = capsys.readouterr()
    assert code == 2 and out == "" and text.splitlines() == [message]
    assert list(tmp_path.iterdir()) == []


def test_dataclass_validation_of_link_keys():
    for change, key in (({"nics_per_node": 0}, "hardware.nics_per_node=0"),
                        ({"device_memory_bytes": -1}, "hardware.device_memory_bytes=-1"),
                        ({"inter_node": LinkConfig(bandwidth=0.0)},
                         "hardware.inter_node.bandwidth=0.0"),
                        ({"hierarchical_all_reduce": 1}, "hardware.hierarchical_all_reduce=1")):
        with pytest.raises(ValueError) as info:
            HardwareConfig(**change)
        assert str(info.value).startswith(key) and "\n" not in str(info.value)


def test_single_tier_collective_rejects_unknown_kind(hw):
    with pytest.raises(ValueError, match="unknown collective"):
        collective_us("broadcast", 1, 2, hw.intra_node)
    with pytest.raises(ValueError, match="unknown collective"):
        group_collective_params("broadcast", GroupLayout(2, 1, 2), hw)
