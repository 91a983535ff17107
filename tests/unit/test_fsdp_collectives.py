"""FSDP2's collective semantics in the cost model (pipeline/costmodel/fsdp.py), by hand.

On the toy model (2 layers of 9 parameters each, the embedding, the final norm and the
head; conf/model/toy.yaml shapes) on a 1-D mesh of 8:

* units: every parameter edge and every gradient edge is assigned the unit of its
  parameter, and a unit's latency is shared by its parameters (1/9 in a layer);
* the weight edge of ``wq`` (fp32 [256, 256], the backward reads its bf16 copy) pays its
  all-gather twice (re-gather) at latency lat/9;
* the gradient edge of ``wq`` (bf16 [256, 256], Partial -> Shard(0)) pays its
  reduce-scatter on fp32 bytes (reduce dtype) at latency lat/9;
* each switch off gives back DTensor's one-collective-per-tensor cost.

The expected values use the link's latency and bus bandwidth read from the hardware
(``mesh_collective_params``; the link model is tested in its own file) and the ring
formula ``lat + (n-1)/n * S / bw`` with ``S`` worked out here from the shapes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from fixtures import traced_topology
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from pipeline.costmodel.comm import mesh_collective_params
from pipeline.costmodel.fsdp import CollectiveOptions, edge_policy, param_units
from pipeline.costmodel.hardware import COLLECTIVES, HardwareConfig
from pipeline.costmodel.model import TRANSITION_COST, CostModel
from pipeline.memory.graph import step_graph
from pipeline.stages.costs.stage import build_mrf
from pipeline.stages.topology import TopologyTables

TOY = dict(name="toy", dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim_multiplier=1.0,
           multiple_of=256, ffn_hidden_overrides={}, rope_theta=500000.0, norm_eps=1e-5,
           vocab_size=1024, seq_len=64, batch_size=16, param_dtype="bfloat16",
           reduce_dtype="float32")
N = 8
HW = HardwareConfig()


@pytest.fixture(scope="module")
def toy8(tmp_path_factory: pytest.TempPathFactory) -> TopologyTables:
    return traced_topology(tmp_path_factory.mktemp("toy8"), TOY, (N,), ("dp",))


def _link(kind: str) -> tuple[float, float]:
    params = mesh_collective_params((N,), HW)
    k = COLLECTIVES.index(kind)
    return float(params.lat[0, k]), float(params.bw[0, k])


def _ring_us(kind: str, nbytes: int, latency_share: float) -> float:
    lat, bw = _link(kind)
    return lat * latency_share + (N - 1) / N * nbytes / bw * 1e6


def _node(tt: TopologyTables, name: str) -> int:
    return list(tt.nodes["name"]).index(name)


def _param(tt: TopologyTables, fqn: str) -> int:
    n = tt.nodes
    return next(v for v in range(len(n["id"]))
                if n["role"][v] == "param" and n["fqn"][v] == fqn)


def _edge_from(cm: CostModel, u: int) -> int:
    (e,) = [k for k, (p, _, _, _) in enumerate(cm.edges) if p == u]
    return e


def _entry(cm: CostModel, e: int, src: tuple, dst: tuple) -> float:
    u, element, v, a = cm.edges[e]
    _, _, table = cm.edge_table(e)
    _, srcs = cm.out_classes(u, element)
    _, dsts = cm.in_classes(v, a)
    i = next(k for k, p in enumerate(srcs) if tuple(p) == src)
    j = next(k for k, p in enumerate(dsts) if tuple(p) == dst)
    return float(table[i, j])


def test_units_and_edge_kinds(toy8: TopologyTables) -> None:
    units = param_units(toy8)
    count: dict[str, int] = {}
    for unit in units.values():
        count[unit] = count.get(unit, 0) + 1
    assert count == {"tok_embeddings": 1, "layers.0": 9, "layers.1": 9, "norm": 1,
                     "output": 1}
    cm = CostModel(toy8, HW, memoise=True)
    policy = edge_policy(toy8, step_graph(toy8), CollectiveOptions(), cm.in_metas)
    n = toy8.nodes
    for e, (u, _, v, _) in enumerate(cm.edges):
        if u in units:  # every edge out of a parameter
            assert policy.kind[e] == "weight" and policy.unit[e] == units[u]
            assert policy.latency_scale[e] == 1.0 / count[units[u]]
        if n["role"][v] == "grad" and n["target"][v] == "output":  # into a gradient sink
            param = _param(toy8, n["fqn"][v])
            assert policy.kind[e] == "gradient" and policy.unit[e] == units[param]
        if policy.kind[e] is None:
            assert policy.latency_scale[e] == 1.0 and policy.reduce_itemsize[e] == 0
    # from each gradient sink back through the relays (cast, view, transpose, getitem) to
    # the op computing the gradient (a matmul, the fused RMSNorm backward's second
    # output, the embedding backward): every edge on the way is the parameter's
    relays = {"aten.t.default", "aten.view.default", "aten._unsafe_view.default",
              "aten._to_copy.default", "aten.transpose.int", "getitem", "output"}
    sinks = [v for v in range(len(n["id"])) if n["role"][v] == "grad"]
    assert len(sinks) == 21
    for sink in sinks:
        unit, v = units[_param(toy8, n["fqn"][sink])], sink
        while n["target"][v] in relays:
            (e,) = [k for k, (_, _, w, _) in enumerate(cm.edges) if w == v]
            assert policy.kind[e] == "gradient" and policy.unit[e] == unit, (n["fqn"][sink], e)
            v = cm.edges[e][0]
    # a backward edge carrying an activation gradient is not the parameter's
    assert any(k is None and n["phase"][u] == "bwd"
               for k, (u, _, _, _) in zip(policy.kind, cm.edges, strict=True))


@pytest.mark.parametrize("bucket,reshard", [(True, True), (False, True), (True, False)])
def test_weight_gather_bucket_share_and_regather(toy8: TopologyTables, bucket: bool,
                                                 reshard: bool) -> None:
    cm = CostModel(toy8, HW, memoise=False,
                   collectives=CollectiveOptions(reshard_after_forward=reshard, bucket=bucket))
    wq = _param(toy8, "layers.0.attention.wq.weight")
    e = _edge_from(cm, wq)  # wq (fp32 [256, 256]) -> its bf16 cast, read by the backward
    # all-gather S(0) -> R: S = the gathered bytes, 256 * 256 * 4
    one = _ring_us("all_gather", 256 * 256 * 4, 1 / 9 if bucket else 1.0)
    times = 2 if reshard else 1
    got = _entry(cm, e, (Shard(0),), (Replicate(),))
    assert got == pytest.approx(times * one + TRANSITION_COST, rel=1e-12)
    assert int(cm.edge_times[e]) == times


@pytest.mark.parametrize("reduce_dtype,itemsize", [("float32", 4), (None, 2)])
def test_gradient_reduce_scatter_in_the_reduce_dtype(toy8: TopologyTables,
                                                     reduce_dtype: str | None,
                                                     itemsize: int) -> None:
    cm = CostModel(toy8, HW, memoise=False,
                   collectives=CollectiveOptions(reduce_dtype=reduce_dtype))
    wq = _param(toy8, "layers.0.attention.wq.weight")
    sink = _node(toy8, "output:grad:layers.0.attention.wq.weight")
    # walk back from the sink to the first bf16 tensor of wq's gradient chain
    e = next(k for k, (_, _, v, _) in enumerate(cm.edges) if v == sink)
    while cm.in_metas[cm.edges[e][2]][cm.edges[e][3]]["dtype"] != "bfloat16":
        u = cm.edges[e][0]
        e = next(k for k, (_, _, v, _) in enumerate(cm.edges) if v == u)
    u, _, v, a = cm.edges[e]
    shape = cm.in_metas[v][a]["shape"]
    assert sorted(shape) == [256, 256] and wq != u
    # reduce-scatter P -> S(0): S = the unscattered input, 256 * 256 * itemsize
    want = _ring_us("reduce_scatter", 256 * 256 * itemsize, 1 / 9)
    got = _entry(cm, e, (Partial(),), (Shard(0),))
    assert got == pytest.approx(want + TRANSITION_COST, rel=1e-12)
    # an all-gather on the same edge is not a reduction: bf16 bytes either way
    gather = _entry(cm, e, (Shard(0),), (Replicate(),))
    assert gather == pytest.approx(
        _ring_us("all_gather", 256 * 256 * 2, 1 / 9) + TRANSITION_COST, rel=1e-12)


def test_lazy_and_eager_agree_with_the_policy(toy8: TopologyTables) -> None:
    opts = CollectiveOptions()
    lazy = build_mrf(toy8, HW, lazy=True, collectives=opts).mrf
    eager = build_mrf(toy8, HW, lazy=False, collectives=opts).mrf
    for a, b in zip(lazy.unary, eager.unary, strict=True):
        assert np.array_equal(a, b)
    for g in range(lazy.num_edges):
        fa, fb = lazy.factor(g), eager.factor(g)
        assert np.array_equal(fa.table, fb.table)
        assert np.array_equal(fa.row_cls, fb.row_cls)
        assert np.array_equal(fa.col_cls, fb.col_cls)


def test_bucketing_alone_never_raises_a_cost(toy8: TopologyTables) -> None:
    """Bucketing alone only takes latency away: every finite factor entry is at most its
    per-tensor counterpart, and the forbidden entries stay forbidden."""
    plain = build_mrf(toy8, HW, lazy=True).mrf
    fsdp = build_mrf(toy8, HW, lazy=True, collectives=CollectiveOptions(
        reshard_after_forward=False, reduce_dtype=None)).mrf
    # with only bucketing on, every factor entry is <= its plain counterpart
    for g in range(plain.num_edges):
        a, b = plain.factor(g).table, fsdp.factor(g).table
        finite = np.isfinite(a)
        assert np.array_equal(finite, np.isfinite(b))
        assert np.all(b[finite] <= a[finite] + 1e-9)
    assert math.isfinite(sum(float(u.min()) for u in fsdp.unary))
