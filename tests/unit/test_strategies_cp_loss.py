"""Context-parallel attention and vocab-parallel cross-entropy
(pipeline/stages/topology/extra_strategies.py, pipeline/costmodel/op_comm.py), checked by
hand and against torch's own math on real tensors.

Hardware: the H100 numbers written out below (not read from conf/hardware), so the
hand-worked values stay those of this file.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fixtures import traced_topology
from omegaconf import OmegaConf

from pipeline.dtensor.placements import format_placements, parse_placements
from pipeline.stages.topology import IRNode, StrategyEnumerator, device_mesh

HW = OmegaConf.create({
    "name": "h100", "peak_flops_bf16": 989.0e12, "peak_flops_fp32": 67.0e12,
    "hbm_bandwidth": 3.35e12, "compute_efficiency": 0.7, "memory_efficiency": 0.7,
    "kernel_floor_us": 7.0, "gpus_per_node": 8, "nics_per_node": 8,
    "device_memory_bytes": 80 * 2**30, "hierarchical_all_reduce": False,
    # the 2 x 4 mesh fits one node: every collective runs on NVLink (bus bandwidth 390
    # GB/s, 30 µs a ring pass; an all-reduce is a reduce-scatter + an all-gather)
    "intra_node": {"bandwidth": 390.0e9, "latency_us": 30.0, "hop_latency_us": 0.0},
    "inter_node": {"bandwidth": 50.0e9, "latency_us": 40.0, "hop_latency_us": 0.0}})
MESH = (2, 4)
HBM = 3.35e12 * 0.7  # bytes/s, the roofline's memory side


def _meta(shape: list[int], dtype: str = "bfloat16") -> dict:
    stride = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    return {"shape": shape, "dtype": dtype, "stride": stride}


def _node(target: str, args: list, metas: list[dict], outputs: list,
          tuple_output: bool) -> IRNode:
    return IRNode(idx=len(metas), name=target.split(".")[1], kind="call_function",
                  target=target, args=args, kwargs={}, outputs=outputs,
                  tuple_output=tuple_output, role="activation", fqn=None, layer=None,
                  phase="fwd", output_desc=None, refs=list(range(len(metas))))


def _texts(sl) -> set[tuple]:
    out = set()
    for o, i in zip(sl.outputs, sl.inputs):
        if isinstance(o, tuple) and (o[0] is None or isinstance(o[0], tuple)):
            o_text = tuple("-" if p is None else format_placements(p) for p in o)
        else:
            o_text = (format_placements(o),)
        out.add((o_text, tuple(format_placements(p) for p in i)))
    return out


@pytest.fixture(scope="module")
def enumerator() -> StrategyEnumerator:
    return StrategyEnumerator(device_mesh(MESH, ("dp", "cp")), MESH)


# --------------------------------------------------------------------------- attention

B, H, S, D = 8, 8, 16, 8  # q, k, v [B, H, S, D], bf16
QKV = _meta([B, H, S, D])
FLASH_OUT = [QKV, _meta([B, H, S], "float32"), None, None, None, None,
             _meta([2], "uint64"), _meta([], "uint64"), _meta([0])]


def _flash_fwd_node() -> tuple[IRNode, list[dict]]:
    metas = [QKV, QKV, QKV]
    node = _node("aten._scaled_dot_product_flash_attention.default",
                 [{"node": 0}, {"node": 1}, {"node": 2}, 0.0, True], metas, FLASH_OUT, True)
    return node, metas


def _flash_bwd_node() -> tuple[IRNode, list[dict]]:
    lse = _meta([B, H, S], "float32")
    metas = [QKV, QKV, QKV, QKV, QKV, lse, _meta([2], "uint64"), _meta([], "uint64")]
    args = [{"node": 0}, {"node": 1}, {"node": 2}, {"node": 3}, {"node": 4}, {"node": 5},
            None, None, S, S, 0.0, True, {"node": 6}, {"node": 7}]
    node = _node("aten._scaled_dot_product_flash_attention_backward.default", args, metas,
                 [QKV, QKV, QKV], True)
    return node, metas


#: Per mesh dim, the single-dim rules of the forward as (out, lse, q, k, v): DTensor's
#: replicate, heads and batch rules, and the context-parallel rule.
FWD_RULES = [("R", "R", "R", "R", "R"), ("S(1)",) * 5, ("S(0)",) * 5,
             ("S(2)", "S(2)", "S(2)", "R", "R")]
#: The backward's, as (grad_q, grad_k, grad_v, grad_out, q, k, v, out, lse).
BWD_RULES = [("R",) * 9, ("S(1)",) * 9, ("S(0)",) * 9,
             ("S(2)", "P", "P", "S(2)", "S(2)", "R", "R", "S(2)", "S(2)")]


def _product(rules: list[tuple]) -> set[tuple[str, ...]]:
    """Every combination of one rule per mesh dim, as placement texts per position
    (every tensor dim here is at least 8: all of them are shardable on a 2 x 4 mesh)."""
    return {tuple("".join(r[pos] for r in combo) for pos in range(len(rules[0])))
            for combo in itertools.product(rules, repeat=len(MESH))}


def test_context_parallel_attention_strategies(enumerator: StrategyEnumerator) -> None:
    node, metas = _flash_fwd_node()
    sl = enumerator.op_strategies(node, metas)
    got = {(o[0], o[1], *i) for o, i in _texts(sl)}
    assert got == _product(FWD_RULES)
    assert len(sl) == 16  # 4 rules per mesh dim, 2 mesh dims
    # DTensor's 9 strategies (no CP) come first, unchanged
    first = {(format_placements(o[0]), format_placements(i[0])) for o, i in
             zip(sl.outputs[:9], sl.inputs[:9])}
    assert all("S(2)" not in a + b for a, b in first)
    # the CP strategy on the cp mesh dim with batch on dp
    k = next(k for k, (o, i) in enumerate(zip(sl.outputs, sl.inputs))
             if format_placements(i[0]) == "S(0)S(2)" and format_placements(i[1]) == "S(0)R")
    assert format_placements(sl.outputs[k][0]) == format_placements(sl.outputs[k][1]) \
        == "S(0)S(2)"
    assert sl.outputs[k][2:6] == (None,) * 4  # cum_seq_q/k, max_q/k: not tensors

    node, metas = _flash_bwd_node()
    sl = enumerator.op_strategies(node, metas)
    got = {(*o, *i[:6]) for o, i in _texts(sl)}
    assert {i[6:] for _, i in _texts(sl)} == {("RR", "RR")}  # the RNG state
    assert got == _product(BWD_RULES)
    assert len(sl) == 16


def test_context_parallel_kv_all_gather_and_grad_reduce_scatter_by_hand() -> None:
    """K (and V) [8, 8, 16, 8] bf16 batch-sharded on dp (size 2), sequence-sharded on cp
    (size 4) into the CP strategy's S(0)R: an all-gather over cp of the gathered local
    K, 4 * 8 * 16 * 8 * 2 = 8,192 bytes, on a non-leading dim (+ a local reshuffle of
    2 x 8,192 bytes); grad_k Partial on cp into S(0)S(2): the reduce-scatter of the same
    8,192 bytes (on dim 2: + the reshuffle)."""
    from pipeline.costmodel.redistribute import redistribute_steps

    local = (B // 2) * H * S * D * 2
    assert local == 8_192
    reshuffle = 2 * local / HBM * 1e6
    ag = 30.0 + (3 / 4) * local / 390e9 * 1e6
    rs = 30.0 + (3 / 4) * local / 390e9 * 1e6
    steps = redistribute_steps([B, H, S, D], 2, parse_placements("S(0)S(2)"),
                               parse_placements("S(0)R"), MESH, HW)
    assert [(st.kind, st.mesh_dim, st.bytes) for st in steps] == [("all_gather", 1, local)]
    assert sum(st.us for st in steps) == pytest.approx(ag + reshuffle, rel=1e-12)
    steps = redistribute_steps([B, H, S, D], 2, parse_placements("S(0)P"),
                               parse_placements("S(0)S(2)"), MESH, HW)
    assert [(st.kind, st.mesh_dim, st.bytes) for st in steps] == [
        ("reduce_scatter", 1, local)]
    assert sum(st.us for st in steps) == pytest.approx(rs + reshuffle, rel=1e-12)
    # per layer: K and V gathered, grad_k and grad_v reduce-scattered
    assert 2 * (ag + reshuffle) + 2 * (rs + reshuffle) == pytest.approx(
        4 * 30.0 + 4 * 0.75 * 8_192 / 390e9 * 1e6 + 8 * 8_192 / HBM * 1e6, rel=1e-12)


def test_context_parallel_attention_flops_are_the_full_ops_over_cp() -> None:
    """The local shapes of the CP strategy (q: S/4 rows, k, v: all S) give a quarter of
    the full op's FLOPs, forward (4 B H Sq Sk D times the causal fraction (S + 1) / (2 S)
    of the S keys) and backward: the cost is that of a load-balanced split."""
    from pipeline.costmodel.compute import op_flops

    fwd = "aten._scaled_dot_product_flash_attention.default"
    full = op_flops(fwd, [(B, H, S, D)] * 3 + [0.0, True])
    local = op_flops(fwd, [(B, H, S // 4, D), (B, H, S, D), (B, H, S, D), 0.0, True])
    assert full == 4 * B * H * S * S * D * (S + 1) / (2 * S)
    assert local == full / 4
    bwd = "aten._scaled_dot_product_flash_attention_backward.default"
    q, kv, lse = (B, H, S // 4, D), (B, H, S, D), (B, H, S // 4)
    local = op_flops(bwd, [q, q, kv, kv, q, lse, None, None, S // 4, S, 0.0, True, (2,), ()])
    full = op_flops(bwd, [kv, kv, kv, kv, kv, (B, H, S), None, None, S, S, 0.0, True,
                          (2,), ()])
    assert full > 0 and local == full / 4


def _offset_mask(rows: torch.Tensor, keys: int) -> torch.Tensor:
    """Causal mask of query rows at global positions ``rows`` against all keys."""
    return torch.arange(keys)[None, :] <= rows[:, None]


def test_sequence_sharded_attention_with_full_kv_is_exact() -> None:
    """Each rank's query chunk against the full K/V, with the causal mask offset by the
    chunk's position, gives exactly the rows (output and log-sum-exp) of the full causal
    attention, for contiguous and zig-zag chunks; the op's own top-left ``is_causal``
    is right on rank 0 only. Backward: grad_q of the chunk is exact and the sum over
    ranks of each rank's grad_k / grad_v is the full gradient (the Partial)."""
    torch.manual_seed(0)
    n, b, h, s, d = 4, 2, 3, 16, 8
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    g = torch.randn(b, h, s, d, dtype=torch.float64)
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    full, full_lse = cpu_flash(q, k, v, 0.0, True)
    assert torch.allclose(full, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    gq, gk, gv = torch.autograd.grad((full * g).sum(), (q, k, v))
    c = s // n
    chunks = {"contiguous": [torch.arange(r * c, (r + 1) * c) for r in range(n)],
              "zig-zag": [torch.cat([torch.arange(r * c // 2, (r + 1) * c // 2),
                                     torch.arange((2 * n - 1 - r) * c // 2,
                                                  (2 * n - r) * c // 2)])
                          for r in range(n)]}
    for name, rows_of in chunks.items():
        sum_gk, sum_gv = torch.zeros_like(k), torch.zeros_like(v)
        for r, rows in enumerate(rows_of):
            q_r = q[:, :, rows]
            mask = torch.zeros(len(rows), s, dtype=q.dtype).masked_fill(
                ~_offset_mask(rows, s), -math.inf)  # the flash op takes an additive mask
            out, lse = cpu_flash(q_r, k, v, 0.0, False, attn_mask=mask)
            assert torch.allclose(out, full[:, :, rows], atol=1e-12), (name, r)
            assert torch.allclose(lse, full_lse[:, :, rows], atol=1e-12), (name, r)
            lq, lk, lv = torch.autograd.grad((out * g[:, :, rows]).sum(), (q, k, v))
            assert torch.allclose(lq[:, :, rows], gq[:, :, rows], atol=1e-12)
            sum_gk += lk
            sum_gv += lv
        assert torch.allclose(sum_gk, gk, atol=1e-12) and torch.allclose(sum_gv, gv,
                                                                         atol=1e-12)
        # zig-zag: every rank sees the same number of (query, key) pairs under the mask
        work = [int(_offset_mask(rows, s).sum()) for rows in rows_of]
        if name == "zig-zag":
            assert len(set(work)) == 1 and sum(work) == s * (s + 1) // 2
        else:
            assert work == [sum(range(r * c + 1, (r + 1) * c + 1)) for r in range(n)]
    top_left = [cpu_flash(q[:, :, r * c:(r + 1) * c], k, v, 0.0, True)[0] for r in range(n)]
    assert torch.allclose(top_left[0], full[:, :, :c], atol=1e-12)
    assert not any(torch.allclose(top_left[r], full[:, :, r * c:(r + 1) * c])
                   for r in range(1, n))


# --------------------------------------------------------------------------- cross-entropy

N, V = 64, 1024  # tokens, vocabulary


def test_vocab_parallel_loss_strategies(enumerator: StrategyEnumerator) -> None:
    logits, target = _meta([N, V], "float32"), _meta([N], "int64")
    node = _node("aten._log_softmax.default", [{"node": 0}, -1, False], [logits], [logits],
                 False)
    got = _texts(enumerator.op_strategies(node, [logits]))
    assert (("S(0)S(1)",), ("S(0)S(1)",)) in got and (("S(1)S(1)",), ("S(1)S(1)",)) in got
    loss = _meta([], "float32")
    node = _node("aten.nll_loss_forward.default", [{"node": 0}, {"node": 1}, None, 1, -100],
                 [logits, target], [loss, loss], True)
    got = _texts(enumerator.op_strategies(node, [logits, target]))
    # vocab on cp: the loss is Partial there (its out-edge all-reduces it), total_weight
    # Replicate; with the batch on dp, DTensor's P(avg) / P there
    assert (("RP", "RR"), ("RS(1)", "RR")) in got
    assert (("P(avg)P", "PR"), ("S(0)S(1)", "S(0)R")) in got
    node = _node("aten.nll_loss_backward.default",
                 [{"node": 0}, {"node": 1}, {"node": 2}, None, 1, -100, {"node": 3}],
                 [loss, logits, target, loss], [logits], False)
    got = _texts(enumerator.op_strategies(node, [loss, logits, target, loss]))
    assert (("RS(1)",), ("RR", "RS(1)", "RR", "RR")) in got
    node = _node("aten._log_softmax_backward_data.default",
                 [{"node": 0}, {"node": 1}, -1, {"dtype": "float32"}], [logits, logits],
                 [logits], False)
    got = _texts(enumerator.op_strategies(node, [logits, logits]))
    assert (("S(0)S(1)",), ("S(0)S(1)", "S(0)S(1)")) in got


def test_vocab_parallel_all_reduces_by_hand() -> None:
    """Logits [64, 1024] fp32 as S(0)S(1) on the 2 x 4 mesh: 32 local rows, so the
    softmax all-reduces 32 maxima and 32 sums of exponentials over cp (4 ranks, 128
    bytes each): 2 x (2 * 30 + 2 * 3/4 * 128 / 390e9 * 1e6) µs; its backward one all-reduce
    of the 32 row sums of the gradient; batch-sharded logits (S(0)R) none."""
    from pipeline.costmodel.op_comm import op_collectives, op_comm_us

    one = 2 * 30.0 + 2 * (3 / 4) * 128 / 390e9 * 1e6
    pl = parse_placements("S(0)S(1)")
    fwd = op_collectives("aten._log_softmax.default", [None, -1, False], [N, V], pl,
                         (32, 256), 4)
    assert fwd == [("all_reduce", 128, 1), ("all_reduce", 128, 1)]
    assert op_comm_us(fwd, MESH, HW) == pytest.approx(2 * one, rel=1e-12)
    bwd = op_collectives("aten._log_softmax_backward_data.default", [None, None, -1, None],
                         [N, V], pl, (32, 256), 4)
    assert op_comm_us(bwd, MESH, HW) == pytest.approx(one, rel=1e-12)
    assert op_collectives("aten._log_softmax.default", [None, -1, False], [N, V],
                          parse_placements("S(0)R"), (32, 1024), 4) == []
    # sharded on both mesh dims: each reduces its 64 rows (256 bytes)
    both = op_collectives("aten._log_softmax.default", [None, 1, False], [N, V],
                          parse_placements("S(1)S(1)"), (64, 128), 4)
    assert both == [("all_reduce", 256, 0)] * 2 + [("all_reduce", 256, 1)] * 2


def test_vocab_parallel_cross_entropy_is_exact() -> None:
    """Simulated vocabulary shards: local max and sum of exponentials all-reduced give
    the full log_softmax; the local target picks summed over shards (the Partial loss)
    give the full loss; the backward with the all-reduced row sum of the gradient gives
    the full gradient of the logits."""
    torch.manual_seed(1)
    n = 4
    x = torch.randn(N, V, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[3] = -100  # an ignored token
    logp = torch.log_softmax(x, -1)
    loss = F.nll_loss(logp, t, ignore_index=-100)
    (grad_x,) = torch.autograd.grad(loss, x)
    shards = x.detach().chunk(n, dim=1)
    row_max = torch.stack([s.max(-1).values for s in shards]).max(0).values  # all-reduce
    sum_exp = sum((s - row_max[:, None]).exp().sum(-1) for s in shards)  # all-reduce
    local_logp = [s - row_max[:, None] - sum_exp.log()[:, None] for s in shards]
    assert torch.allclose(torch.cat(local_logp, 1), logp, atol=1e-12)
    valid = t != -100
    total_weight = valid.sum().double()  # every rank: the target is Replicate
    width = V // n
    partial = []
    grads_logp = []
    for r, lp in enumerate(local_logp):
        in_range = valid & (t >= r * width) & (t < (r + 1) * width)
        local_t = (t - r * width).clamp(0, width - 1)
        picked = torch.where(in_range, lp.gather(1, local_t[:, None])[:, 0], 0.0)
        partial.append(-picked.sum() / total_weight)
        g = torch.zeros_like(lp)  # nll_loss_backward, local vocabulary range
        g[in_range, local_t[in_range]] = -1.0 / total_weight
        grads_logp.append(g)
    assert torch.allclose(sum(partial), loss, atol=1e-12)
    row_sum = sum(g.sum(-1) for g in grads_logp)  # _log_softmax_backward_data's all-reduce
    local_grad = [g - lp.exp() * row_sum[:, None] for g, lp in zip(grads_logp, local_logp)]
    assert torch.allclose(torch.cat(local_grad, 1), grad_x, atol=1e-12)


# --------------------------------------------------------------------------- the toy step


TOY = dict(name="toy", dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim_multiplier=1.0,
           multiple_of=256, ffn_hidden_overrides={}, rope_theta=500000.0, norm_eps=1e-5,
           vocab_size=1024, seq_len=64, batch_size=2, param_dtype="bfloat16",
           reduce_dtype="float32")


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory):
    return traced_topology(tmp_path_factory.mktemp("toy_cp"), TOY, MESH, ("dp", "cp"))


def test_toy_softmax_unary_holds_its_all_reduces(toy) -> None:
    """In the traced toy step (2 x 64 tokens, vocabulary 1024, fp32 logits) on 2 x 4,
    the log_softmax under S(0)S(1) costs its roofline on [64, 256] (7 µs floor: 2 x 64
    KiB moved) plus two all-reduces of 64 fp32 values over cp; the backward one."""
    from pipeline.costmodel.model import CostModel

    cm = CostModel(toy, HW, memoise=True)
    target = toy.nodes["target"]
    one = 2 * 30.0 + 2 * (3 / 4) * 256 / 390e9 * 1e6
    for op, count in (("aten._log_softmax.default", 2),
                      ("aten._log_softmax_backward_data.default", 1)):
        v = target.index(op)
        k = toy.slist_outputs[toy.nodes["slist"][v]].index("S(0)S(1)")
        moved = (2 if count == 2 else 3) * 64 * 256 * 4
        roof = max(moved / HBM * 1e6, 7.0)
        assert cm.unary(v)[k] == pytest.approx(roof + count * one, rel=1e-12)
        assert cm.op_comm(v)[k] == pytest.approx(count * one, rel=1e-12)
        r = toy.slist_outputs[toy.nodes["slist"][v]].index("S(0)R")
        assert cm.op_comm(v)[r] == 0.0
    assert np.isfinite(cm.unary(target.index("aten.nll_loss_forward.default"))).all()
