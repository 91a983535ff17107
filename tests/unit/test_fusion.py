"""Pointwise fusion (pipeline/costmodel/fusion.py): the pairwise term by hand on the
toy step's RMSNorm tail, its bound, lazy == eager, and the plan breakdown.

The chain (toy step, 2 x 64 tokens, width 256): ``mul = x * rsqrt(...)`` (fp32),
``mul_1 = mul * weight`` (the weight cast to bf16, ``[256]``), ``_to_copy_3 = bf16(mul_1)``.
Hardware: the H100 numbers written out below.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from fixtures import traced_topology
from omegaconf import OmegaConf

from pipeline.costmodel.model import CostModel
from pipeline.stages.costs.stage import build_mrf

HW = OmegaConf.create({
    "name": "h100", "peak_flops_bf16": 989.0e12, "peak_flops_fp32": 67.0e12,
    "hbm_bandwidth": 3.35e12, "compute_efficiency": 0.7, "memory_efficiency": 0.7,
    "kernel_floor_us": 7.0, "gpus_per_node": 8, "nics_per_node": 8,
    "device_memory_bytes": 80 * 2**30, "hierarchical_all_reduce": False,
    "intra_node": {"bandwidth": 390.0e9, "latency_us": 30.0},
    "inter_node": {"bandwidth": 50.0e9, "latency_us": 40.0}})
HBM = 3.35e12 * 0.7
MESH = (2, 4)
TOY = dict(name="toy", dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim_multiplier=1.0,
           multiple_of=256, ffn_hidden_overrides={}, rope_theta=500000.0, norm_eps=1e-5,
           vocab_size=1024, seq_len=64, batch_size=2, param_dtype="bfloat16",
           reduce_dtype="float32")


def us(nbytes: float) -> float:
    return nbytes / HBM * 1e6


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory):
    return traced_topology(tmp_path_factory.mktemp("toy_fusion"), TOY, MESH, ("dp", "tp"))


def _edge(toy, producer: str, consumer: str) -> int:
    names, e = toy.nodes["name"], toy.edges
    return next(k for k, (u, v) in enumerate(zip(e["producer"], e["consumer"]))
                if names[u] == producer and names[v] == consumer)


def _entry(cm: CostModel, e: int, src: str, dst: str) -> float:
    from pipeline.dtensor.placements import format_placements

    r, c, t = cm.edge_table(e)
    _, srcs = cm.out_classes(cm.edges[e][0], cm.edges[e][1])
    _, dsts = cm.in_classes(cm.edges[e][2], cm.edges[e][3])
    i = [format_placements(p) for p in srcs].index(src)
    j = [format_placements(p) for p in dsts].index(dst)
    return float(t[i, j])


def _strategy(toy, v: int, text: str) -> int:
    return toy.slist_outputs[toy.nodes["slist"][v]].index(text)


def test_fused_rmsnorm_tail_by_hand(toy) -> None:
    """All Replicate (local = full shapes): [2, 64, 256] fp32 is 131,072 bytes, its bf16
    cast 65,536, the bf16 weight 512.

    * edge mul -> mul_1 (argument 0, designated): mul_1 moves 131,072 + 512 + 131,072 =
      262,656 bytes, below the 7 µs floor, so it saves the floor above its memory time,
      7 - us(262,656), and the read of the intermediate, us(131,072);
    * edge _to_copy_1 -> mul_1 (argument 1, the weight cast): only its read, us(512);
    * edge mul_1 -> _to_copy_3: 7 - us(131,072 + 65,536) + us(131,072).

    So in the chain mul -> mul_1 -> _to_copy_3, mul pays its 7 µs floor and the other
    two only their writes: us(131,072) and us(65,536). Edges whose placements differ
    are unchanged.
    """
    off = CostModel(toy, HW, memoise=True)
    on = CostModel(toy, HW, memoise=True, fuse_pointwise=True)
    names = toy.nodes["name"]
    assert [toy.nodes["target"][names.index(n)] for n in ("mul", "mul_1", "_to_copy_3")] \
        == ["aten.mul.Tensor", "aten.mul.Tensor", "aten._to_copy.default"]
    r = "RR"
    cases = [(("mul", "mul_1"), 7.0 - us(262_656) + us(131_072)),
             (("_to_copy_1", "mul_1"), us(512)),
             (("mul_1", "_to_copy_3"), 7.0 - us(131_072 + 65_536) + us(131_072))]
    for (u, v), saving in cases:
        e = _edge(toy, u, v)
        assert _entry(off, e, r, r) == 0.0
        assert _entry(on, e, r, r) == pytest.approx(-saving, rel=1e-12, abs=1e-12)
        # a redistribution: no fusion, the same entry with and without the term
        assert _entry(on, e, "S(0)R", r) == _entry(off, e, "S(0)R", r)
    mul_1, cast = names.index("mul_1"), names.index("_to_copy_3")
    k1, k2 = _strategy(toy, mul_1, r), _strategy(toy, cast, r)
    assert on.unary(mul_1)[k1] == on.unary(cast)[k2] == 7.0
    fused_mul_1 = on.unary(mul_1)[k1] + _entry(on, _edge(toy, "mul", "mul_1"), r, r) \
        + _entry(on, _edge(toy, "_to_copy_1", "mul_1"), r, r)
    fused_cast = on.unary(cast)[k2] + _entry(on, _edge(toy, "mul_1", "_to_copy_3"), r, r)
    assert fused_mul_1 == pytest.approx(us(131_072), rel=1e-9)
    assert fused_cast == pytest.approx(us(65_536), rel=1e-9)


def test_memory_bound_consumer_saves_only_the_read(toy) -> None:
    """With a 0.01 µs floor every one of these kernels is memory-bound: the floor part
    is 0 and the edge mul -> mul_1 saves the read of its intermediate only; sharded
    S(0)S(2) (batch over dp, width over tp): 131,072 / 8 bytes."""
    hw = OmegaConf.merge(HW, {"kernel_floor_us": 0.01})
    on = CostModel(toy, hw, memoise=True, fuse_pointwise=True)
    e = _edge(toy, "mul", "mul_1")
    assert _entry(on, e, "RR", "RR") == pytest.approx(-us(131_072), rel=1e-12)
    assert _entry(on, e, "S(0)S(2)", "S(0)S(2)") == pytest.approx(-us(131_072 / 8), rel=1e-12)


def test_fusion_is_bounded_by_what_a_fused_kernel_moves(toy) -> None:
    """For random plans, every node's unary plus the fusion terms of its in-edges stays
    at least the memory time of its output write (the bound of the module docstring)."""
    import json

    from pipeline.dtensor.placements import local_shape, parse_output, parse_placements

    on = CostModel(toy, HW, memoise=True, fuse_pointwise=True)
    off = CostModel(toy, HW, memoise=True)
    rng = np.random.default_rng(0)
    n = len(toy.nodes["id"])
    for _ in range(3):
        strat = [int(rng.integers(toy.nodes["num_strategies"][v])) for v in range(n)]
        fused = np.zeros(n)
        for e, (u, _, v, _) in enumerate(on.edges):
            r, c, t = on.edge_table(e)
            t0 = off.edge_table(e)[2]
            i, j = int(r[strat[u]]), int(c[strat[v]])
            if np.isfinite(t0[i, j]):  # (a forbidden pair stays +inf)
                fused[v] += t[i, j] - t0[i, j]
            else:
                assert t[i, j] == math.inf
        assert (fused <= 0).all() and (fused < 0).any()
        for v in np.flatnonzero(fused):
            o = toy.slist_outputs[toy.nodes["slist"][v]][strat[v]]
            metas = json.loads(toy.nodes["out_metas"][v])
            pls = parse_output(o, 2) if o.startswith("(") else [parse_placements(o, 2)]
            write = sum(math.prod(local_shape(m["shape"], p, MESH)) * (
                2 if m["dtype"] == "bfloat16" else 4) for m, p in zip(metas, pls) if m)
            assert on.unary(v)[strat[v]] + fused[v] >= us(write) * (1 - 1e-9), v


def test_lazy_and_eager_fusion_agree_and_breakdown_adds_up(toy) -> None:
    """Lazy (memoised tables by edge class) and eager (one table per edge) MRFs with the
    term give the same energies; the breakdown's parts add up to the energy, and its
    fusion part is the difference to the MRF without the term."""
    from pipeline.costmodel.breakdown import plan_breakdown
    from pipeline.costmodel.factors import group_structure

    lazy = build_mrf(toy, HW, lazy=True, fuse_pointwise=True)
    eager = build_mrf(toy, HW, lazy=False, fuse_pointwise=True)
    plain = build_mrf(toy, HW, lazy=True)
    gs = group_structure(toy)
    rng = np.random.default_rng(1)
    labels = np.zeros(len(gs.domain), dtype=np.int64)  # DTensor's replicate rules first
    assert math.isfinite(lazy.mrf.evaluate(labels))
    for _ in range(3):
        for g in rng.permutation(len(labels))[:200]:  # random finite moves
            old = labels[g]
            labels[g] = rng.integers(gs.domain[g])
            if not math.isfinite(lazy.mrf.evaluate(labels)):
                labels[g] = old
        assert lazy.mrf.evaluate(labels) == eager.mrf.evaluate(labels)
        b = plan_breakdown(lazy.cost_model(), labels[gs.group_of])
        total = b.compute_us.sum() + b.comm_us.sum() + b.transition_us.sum() + b.fusion_us.sum()
        assert lazy.mrf.evaluate(labels) == pytest.approx(total, rel=1e-12)
        assert plain.mrf.evaluate(labels) - lazy.mrf.evaluate(labels) == pytest.approx(
            -b.fusion_us.sum(), rel=1e-9)
        assert (b.fusion_us <= 0).all() and b.fusion_us.sum() < 0
