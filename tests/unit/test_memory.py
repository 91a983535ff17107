"""The per-device memory model (pipeline/memory/) against torch itself and by hand.

* Saved activations: the toy model runs on CPU with real values (one process, every
  tensor whole: the plan of a 1-device mesh) and ``torch.autograd.graph.saved_tensors_hooks``
  records every tensor autograd keeps for backward; the bytes of their distinct
  storages (parameters, buffers and the token / label inputs excluded: they are held
  anyway) must equal the model's saved bytes within 1 %, without checkpointing and with
  every decoder block wrapped in ``torch.utils.checkpoint``.
* Parameters + gradients + AdamW state of toy under FSDP on 8 devices, from its
  parameter count.
* Selective checkpointing's kept bytes, and a liveness walk on a hand-built graph, worked
  out by hand.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.memory.graph import step_graph
from pipeline.memory.liveness import walk
from pipeline.memory.options import MemoryOptions, format_bytes, memory_options, parse_bytes
from pipeline.memory.terms import KINDS, linear_terms
from pipeline.stages.topology import TopologyTables, read_topology

# The toy model of conf/model/toy.yaml with a short step (2 x 64 tokens) so it runs on
# CPU in well under a second.
TOY = dict(name="toy", dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim_multiplier=1.0,
           multiple_of=256, ffn_hidden_overrides={}, rope_theta=500000.0, norm_eps=1e-5,
           vocab_size=1024, seq_len=64, batch_size=2, param_dtype="bfloat16",
           reduce_dtype="float32")
TOY_PARAMS = (
    [1024 * 256]
    + 2 * [256, 256 * 256, 128 * 256, 128 * 256, 256 * 256, 256, 768 * 256, 256 * 768,
           768 * 256]
    + [256, 1024 * 256])


def _topology(tmp: Path, model: dict, mesh: tuple[int, ...]) -> TopologyTables:
    from pipeline.stages.topology import build_topology, device_mesh, load_nodes, write_topology
    from pipeline.stages.trace.stage import trace_model

    table, _ = trace_model(model, math.prod(mesh))
    names = ("dp", "tp", "cp")[:len(mesh)]
    topo = build_topology(load_nodes(table), device_mesh(mesh, names), mesh, names,
                          {"fwd_bwd_consistency": True}, True)
    write_topology(topo, tmp, {"stage": "topology"})
    return read_topology(tmp)


@pytest.fixture(scope="module")
def toy1(tmp_path_factory: pytest.TempPathFactory) -> TopologyTables:
    return _topology(tmp_path_factory.mktemp("toy1"), TOY, (1,))


@pytest.fixture(scope="module")
def toy8(tmp_path_factory: pytest.TempPathFactory) -> TopologyTables:
    return _topology(tmp_path_factory.mktemp("toy8"), {**TOY, "batch_size": 16}, (8,))


# --------------------------------------------------------------------------- eager CPU


@contextlib.contextmanager
def _gpu_like_cpu_ops() -> Iterator[None]:
    """Make eager CPU autograd take the ops the (meta) trace records, as on a GPU.

    The model calls ``aten._scaled_dot_product_flash_attention`` (CUDA and meta kernels
    only): :func:`pipeline.dtensor.cpu_kernels.cpu_kernels` gives it a CPU kernel with the same
    outputs. ``F.rms_norm`` reaches the fused ``aten._fused_rms_norm`` on CUDA and meta
    but its composite on CPU (which saves other tensors): the model's call is routed to
    the fused op, with a CPU kernel. Autograd then saves what the derivative formulas of
    those ops name, as on a GPU.
    """
    import torch.nn.functional as F

    from pipeline.dtensor.cpu_kernels import cpu_kernels

    def fused_rms(x: torch.Tensor, shape: list[int], w: torch.Tensor | None,
                  eps: float | None) -> tuple:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + (eps or 1e-6))
        out = (xf * rstd).to(x.dtype)
        return (out * w if w is not None else out), rstd

    lib = torch.library.Library("aten", "IMPL")
    saved_rms_norm = F.rms_norm
    try:
        lib.impl("_fused_rms_norm", fused_rms, "CPU")
        F.rms_norm = lambda x, shape, weight=None, eps=None: (  # type: ignore[assignment]
            torch.ops.aten._fused_rms_norm(x, list(shape), weight, eps)[0])
        with cpu_kernels():
            yield
    finally:
        F.rms_norm = saved_rms_norm
        lib._destroy()


def _measured_saved_bytes(checkpoint: bool) -> int:
    """Bytes of the distinct storages autograd saves in one forward of the toy step."""
    from pipeline.models.llama import ModelConfig
    from pipeline.models.llama_decoder import Transformer, rope_tables

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TOY))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    cos, sin = rope_tables(TOY["dim"] // TOY["n_heads"], TOY["seq_len"], TOY["rope_theta"])
    model.freqs_cos.copy_(cos)
    model.freqs_sin.copy_(sin)
    tokens = torch.randint(0, TOY["vocab_size"], (TOY["batch_size"], TOY["seq_len"]))
    labels = torch.randint(0, TOY["vocab_size"], (TOY["batch_size"], TOY["seq_len"]))
    if checkpoint:
        import torch.utils.checkpoint as ckpt

        for layer in model.layers:
            def run(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, f: Any = layer.forward
                    ) -> torch.Tensor:
                # The reentrant form saves the block's arguments with save_for_backward,
                # so the hooks below see what it keeps.
                return ckpt.checkpoint(f, x, c, s, use_reentrant=True)
            layer.forward = run
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with _gpu_like_cpu_ops(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels)
    assert loss.isfinite()
    held = {t.untyped_storage().data_ptr()
            for t in [*model.parameters(), *model.buffers(), tokens, labels]}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in held)


def _replicated(tt: TopologyTables) -> np.ndarray:
    return np.zeros(len(tt.nodes["id"]), dtype=np.int64)


def test_saved_activations_equal_autograd_saved_tensors(toy1: TopologyTables) -> None:
    measured = _measured_saved_bytes(checkpoint=False)
    graph = step_graph(tt=toy1)
    # Without FSDP every weight copy (the bfloat16 cast autograd keeps for mm's
    # backward) stays from forward to backward: reshard_after_forward=false.
    terms = linear_terms(toy1, graph, MemoryOptions(reshard_after_forward=False))
    kinds = terms.by_kind(_replicated(toy1))
    predicted = kinds["saved_activations"] + kinds["gathered_weights"]
    assert predicted == pytest.approx(measured, rel=0.01)
    # The weight copies are the bfloat16 casts of the 2-d weights and of the norm
    # weights read by their backward: every parameter but the embedding table (read only
    # through its indices), 2 bytes per element.
    assert kinds["gathered_weights"] == 2 * (sum(TOY_PARAMS) - 1024 * 256)


def test_saved_activations_with_checkpointed_blocks(toy1: TopologyTables) -> None:
    measured = _measured_saved_bytes(checkpoint=True)
    graph = step_graph(toy1, "full")
    terms = linear_terms(toy1, graph, MemoryOptions(checkpointing="full",
                                                    reshard_after_forward=False))
    strategy = _replicated(toy1)
    activations = terms.by_kind(strategy)["saved_activations"]
    # Without FSDP, the weight casts inside a checkpointed block are recomputed too;
    # those outside (final norm, output head) are saved as before. (Under FSDP with
    # reshard_after_forward=false the gathered weights stay whatever the checkpointing:
    # FSDP, not autograd, holds them.)
    layers = set(graph.repeated_layers)
    outside = sum(float(c[strategy[v]]) for v, c in terms.terms["gathered_weights"]
                  if toy1.nodes["layer"][v] not in layers)
    assert activations + outside == pytest.approx(measured, rel=0.01)
    # By hand: each block keeps only its input h (2 x 64 x 256 bfloat16); outside the
    # blocks the final norm keeps its rstd (2 x 64 fp32), the head its 2-d input view
    # (128 x 256 bf16), the loss the log-softmax (128 x 1024 fp32) and the total weight
    # (a 0-d fp32); the last block's output is the final norm's input.
    h = 2 * 64 * 256 * 2
    assert activations == 2 * h + h + 128 * 4 + 128 * 256 * 2 + 128 * 1024 * 4 + 4
    assert outside == 2 * (1024 * 256 + 256)


def test_sac_policy_on_a_sequence_of_ops() -> None:
    """torchtitan's op-level SAC, by hand: save-list ops are saved, but the mm calls are
    counted 1, 2, 3, ... within the layer and the even ones recomputed; every other op
    is recomputed. The earlier rule saves every matmul and attention output."""
    from pipeline.memory.graph import sac_saved

    mm, bmm = "aten.mm.default", "aten.bmm.default"
    flash = "aten._scaled_dot_product_flash_attention.default"
    ops = [mm, "aten.add.Tensor", mm, flash, mm, "aten.mul.Tensor", mm, "aten.abs.default",
           "aten.max.default", bmm, mm]
    assert sac_saved(ops) == [True, False, False, True, True, False, False, True, True,
                              False, True]
    assert sac_saved(ops, "selective_all_matmuls") == [True, False, True, True, True, False,
                                                       True, False, False, True, True]
    # a Llama block: wq, wk, wv, attention, wo, w1, w3, w2
    block = [mm, mm, mm, flash, mm, mm, mm, mm]
    assert [n for n, s in zip(["wq", "wk", "wv", "attn", "wo", "w1", "w3", "w2"],
                              sac_saved(block)) if s] == ["wq", "wv", "attn", "w1", "w2"]
    with pytest.raises(ValueError, match="not a selective mode"):
        sac_saved(ops, "full")


def test_sac_policy_saves_the_ops_torch_dispatches(toy1: TopologyTables) -> None:
    """The toy step run eagerly on CPU with every block under torch's selective
    checkpointing (``create_selective_checkpoint_contexts``) and torchtitan's policy,
    written here from its description (save ``mm``, flash / efficient attention,
    ``abs``, ``max``; every second ``mm`` of the block recomputed): the ops the policy
    saves in the first block's forward, in dispatch order, are the ones the graph's
    rule saves in that layer, in graph order."""
    import torch.utils.checkpoint as ckpt

    from pipeline.models.llama import ModelConfig
    from pipeline.models.llama_decoder import Transformer, rope_tables

    save = {torch.ops.aten.mm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten.abs.default, torch.ops.aten.max.default}
    decisions: list[list[tuple[str, bool]]] = []

    def context() -> Any:
        count = {"mm": 0}
        mine: list[tuple[str, bool]] = []
        decisions.append(mine)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            if func == torch.ops.aten.mm.default:
                count["mm"] += 1
            keep = func in save and not (
                func == torch.ops.aten.mm.default and count["mm"] % 2 == 0)
            if not ctx.is_recompute:
                mine.append((str(func), keep))
            return (ckpt.CheckpointPolicy.MUST_SAVE if keep
                    else ckpt.CheckpointPolicy.PREFER_RECOMPUTE)
        return ckpt.create_selective_checkpoint_contexts(policy)

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TOY))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    cos, sin = rope_tables(TOY["dim"] // TOY["n_heads"], TOY["seq_len"], TOY["rope_theta"])
    model.freqs_cos.copy_(cos)
    model.freqs_sin.copy_(sin)
    for layer in model.layers:
        def run(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, f: Any = layer.forward
                ) -> torch.Tensor:
            return ckpt.checkpoint(f, x, c, s, use_reentrant=False, context_fn=context)
        layer.forward = run
    tokens = torch.randint(0, TOY["vocab_size"], (TOY["batch_size"], TOY["seq_len"]))
    labels = torch.randint(0, TOY["vocab_size"], (TOY["batch_size"], TOY["seq_len"]))
    with _gpu_like_cpu_ops():  # the forward decides what is saved
        assert model(tokens, labels).isfinite()
    torch_saved = [name for name, keep in decisions[0] if keep]
    assert [name for name, _ in decisions[0]].count("aten.mm.default") == 7
    assert torch_saved == ["aten.mm.default", "aten.mm.default",
                           "aten._scaled_dot_product_flash_attention.default",
                           "aten.mm.default", "aten.mm.default"]
    graph = step_graph(toy1, "selective")
    first = graph.repeated_layers[0]
    ours = [graph.target[v] for v in sorted(graph.policy_saved) if graph.layer[v] == first]
    assert ours == torch_saved


@pytest.mark.parametrize("mode", ["selective", "selective_all_matmuls"])
def test_selective_checkpointing_keeps_the_policy_outputs(toy1: TopologyTables,
                                                          mode: str) -> None:
    graph = step_graph(toy1, mode)
    terms = linear_terms(toy1, graph, MemoryOptions(checkpointing=mode))
    kinds = terms.by_kind(_replicated(toy1))
    tokens = 2 * 64
    bf16 = 2
    # Per block: the input h, the matmul outputs the policy saves (the block's mm in
    # order: q 256, k 128, v 128, wo 256, w1 768, w3 768, w2 256 wide; torchtitan's
    # SAC keeps the odd-numbered ones: q, v, w1, w2), the attention output (8 heads x
    # 32), its fp32 log-sum-exp (8 heads) and the philox seed (2 x uint64) and offset
    # (one uint64).
    widths = (256, 128, 768, 256) if mode == "selective" else (256, 128, 128, 256, 768, 768,
                                                                256)
    per_block = (tokens * 256 * bf16 + tokens * sum(widths) * bf16
                 + tokens * 8 * 32 * bf16 + tokens * 8 * 4 + 16 + 8)
    outside = 128 * 4 + 128 * 256 * 2 + 128 * 1024 * 4 + 4 + tokens * 256 * bf16
    assert kinds["saved_activations"] == 2 * per_block + outside
    # reshard_after_forward=true (default): weight copies are re-gathered in backward.
    assert kinds["gathered_weights"] == 0
    # the recomputed matmuls are the even-numbered ones of each block (SAC) or none
    mms = [v for v, t in enumerate(graph.target) if t == "aten.mm.default"
           and graph.phase[v] == "fwd" and graph.layer[v] in graph.repeated_layers]
    again = graph.recomputed_nodes()
    assert len(mms) == 14
    assert [bool(again[v]) for v in mms] == (
        [False, True] * 3 + [False]) * 2 if mode == "selective" else [False] * 14


def test_fsdp_parameter_gradient_and_adamw_bytes_on_8(toy8: TopologyTables) -> None:
    # FSDP: every parameter (and its gradient sink, tied to it) on S(0).
    strategy = _replicated(toy8)
    slist = toy8.nodes["slist"]
    for v, role in enumerate(toy8.nodes["role"]):
        if role in ("param", "grad"):
            outputs = toy8.slist_outputs[slist[v]]
            strategy[v] = outputs.index("S(0)")
    kinds = linear_terms(toy8, step_graph(toy8), MemoryOptions()).by_kind(strategy)
    count = sum(TOY_PARAMS)
    assert count == 2_098_432
    # Per device, 1/8 of: float32 parameters (4 B), float32 gradients (4 B: the reduce
    # dtype), two float32 AdamW moments (8 B) -> 16 B per element / 8 = 4,196,864 B.
    assert kinds["parameters"] == 4 * count / 8
    assert kinds["gradients"] == 4 * count / 8
    assert kinds["optimizer_state"] == 8 * count / 8
    assert kinds["parameters"] + kinds["gradients"] + kinds["optimizer_state"] == 4_196_864
    sgd = linear_terms(toy8, step_graph(toy8),
                       memory_options({"name": "sgd", "momentum": 0.9})).by_kind(strategy)
    assert sgd["optimizer_state"] == 4 * count / 8
    plain = linear_terms(toy8, step_graph(toy8),
                         memory_options({"name": "sgd", "momentum": 0.0})).by_kind(strategy)
    assert plain["optimizer_state"] == 0


def test_group_row_equals_node_terms(toy8: TopologyTables) -> None:
    """The device-memory row over groups gives the same bytes as the node terms."""
    group_of = np.asarray(toy8.nodes["group"], dtype=np.int64)
    members: dict[int, int] = {}
    for v, g in enumerate(group_of.tolist()):
        members.setdefault(g, v)
    domain = np.array([toy8.nodes["num_strategies"][members[g]] for g in sorted(members)])
    terms = linear_terms(toy8, step_graph(toy8), MemoryOptions())
    coef = terms.group_coef(group_of, domain)
    rng = np.random.default_rng(0)
    for _ in range(5):
        labels = np.array([rng.integers(k) for k in domain])
        row = sum(float(c[labels[g]]) for g, c in coef.items())
        assert row == pytest.approx(terms.total(labels[group_of]), rel=1e-12)


# --------------------------------------------------------------------------- liveness


def _hand_tables() -> TopologyTables:
    """``loss = sum(relu(x @ W))`` with its backward, on a 2-device mesh.

    x [8, 4] fp32 input (S(0) only), W [4, 4] fp32 parameter (R or S(0)); the mm
    expects W replicated, so W on S(0) is all-gathered into a 64-byte buffer.
    """
    def meta(shape: list[int]) -> dict:
        return {"shape": shape, "dtype": "float32", "stride": []}

    rows = [
        # name, target, role, phase, inputs, out shape, strategies (output, inputs)
        ("W", "placeholder", "param", "fwd", [], [4, 4], [("R", []), ("S(0)", [])]),
        ("x", "placeholder", "input", "fwd", [], [8, 4], [("S(0)", [])]),
        ("a", "aten.mm.default", "activation", "fwd", [(1, [8, 4]), (0, [4, 4])], [8, 4],
         [("S(0)", ["S(0)", "R"])]),
        ("b", "aten.relu.default", "activation", "fwd", [(2, [8, 4])], [8, 4],
         [("S(0)", ["S(0)"])]),
        ("loss", "aten.sum.default", "activation", "fwd", [(3, [8, 4])], [],
         [("P", ["S(0)"])]),
        ("tangent", "placeholder", "tangent", "bwd", [], [], [("R", [])]),
        ("gb", "aten.expand.default", "activation", "bwd", [(5, [])], [8, 4],
         [("S(0)", ["R"])]),
        ("ga", "aten.threshold_backward.default", "activation", "bwd",
         [(6, [8, 4]), (3, [8, 4])], [8, 4], [("S(0)", ["S(0)", "S(0)"])]),
        ("xt", "aten.t.default", "activation", "bwd", [(1, [8, 4])], [4, 8],
         [("S(1)", ["S(0)"])]),
        ("gW", "aten.mm.default", "activation", "bwd", [(8, [4, 8]), (7, [8, 4])], [4, 4],
         [("P", ["S(1)", "S(0)"])]),
        ("output:0", "output", "output", "bwd", [(4, [])], [], [("R", ["R"])]),
        ("output:grad:W", "output", "grad", "bwd", [(9, [4, 4])], [4, 4],
         [("R", ["R"]), ("S(0)", ["S(0)"])]),
    ]
    n = len(rows)
    group = list(range(n))
    group[11] = 0  # the gradient sink is tied to W
    nodes: dict[str, list] = {k: [] for k in (
        "id", "name", "target", "role", "layer", "phase", "fqn", "graph_idx", "group", "slist",
        "num_strategies", "fallback", "min_param_ratio", "args", "kwargs", "in_metas",
        "out_metas")}
    outputs, inputs = [], []
    edges: dict[str, list] = {"producer": [], "element": [], "consumer": [], "arg": []}
    for i, (name, target, role, phase, ins, shape, strategies) in enumerate(rows):
        for a, (u, _) in enumerate(ins):
            for key, val in zip(("producer", "element", "consumer", "arg"), (u, -1, i, a)):
                edges[key].append(val)
        for key, val in (("id", i), ("name", name), ("target", target), ("role", role),
                         ("layer", None), ("phase", phase), ("fqn", None), ("graph_idx", i),
                         ("group", group[i]), ("slist", i),
                         ("num_strategies", len(strategies)), ("fallback", False),
                         ("min_param_ratio", None),
                         ("args", json.dumps([{"node": u} for u, _ in ins])),
                         ("kwargs", "{}"),
                         ("in_metas", json.dumps([meta(s) for _, s in ins])),
                         ("out_metas", json.dumps([meta(shape)]))):
            nodes[key].append(val)
        outputs.append([o for o, _ in strategies])
        inputs.append([list(i) for _, i in strategies])
    return TopologyTables({"mesh": [2], "repeated_blocks": []}, nodes, outputs, inputs, edges)


@pytest.mark.parametrize("w_label", [0, 1])
def test_liveness_walk_by_hand(w_label: int) -> None:
    tt = _hand_tables()
    graph = step_graph(tt)
    # Saved for backward: b (relu's output, read by threshold_backward); x is read too
    # but is a model input (held anyway).
    assert [graph.slot_node[r] for r in graph.kept] == [3]
    strategy = np.zeros(12, dtype=np.int64)
    strategy[0] = strategy[11] = w_label  # W and its gradient sink: R or S(0)
    live = walk(tt, graph, MemoryOptions(optimizer="none", state_tensors=0), strategy)
    w = 64 if w_label == 0 else 32  # W [4, 4] fp32: whole, or half per device
    x = a = b = ga = 64  # [8, 4] fp32 on S(0): half per device
    gathered = 64 if w_label == 1 else 0  # W all-gathered for the mm, during a only
    g_w = w  # the reduced gradient, on W's placement, kept to the end
    expected = [
        w + x,                    # W
        w + x,                    # x
        w + x + gathered + a,     # a = mm(x, W)
        w + x + a + b,            # b = relu(a); a freed after it
        w + x + b + 4,            # loss (0-d, read by the loss sink only: freed at once)
        w + x + b + 4,            # tangent (0-d)
        w + x + b + 4,            # gb = expand(tangent): a view, no new bytes
        w + x + b + 4 + ga,       # ga = threshold_backward(gb, b); b, tangent freed after
        w + x + ga,               # xt = t(x): a view of the input
        w + x + ga + 64 + g_w,    # gW = mm(xt, ga): Partial [4, 4] whole (64 B), reduced
        w + x + g_w,              # loss sink
        w + x + g_w,              # gradient sink
    ]
    assert live.live_bytes.tolist() == expected
    assert live.peak_bytes == max(expected)
    assert live.peak_node == 9
    assert live.peak_breakdown["parameters"] == w
    assert live.peak_breakdown["buffers"] == x
    assert live.peak_breakdown["gradients"] == g_w
    assert live.peak_breakdown["transient"] == ga + 64
    # The linear model: W, its gradient, x and the saved b.
    terms = linear_terms(tt, graph, MemoryOptions(optimizer="none", state_tensors=0))
    assert terms.total(strategy) == w + g_w + x + b


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(("text", "nbytes"), [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("1.5TiB", int(1.5 * 2**40)),
    ("512MiB", 512 * 2**20), ("85899345920", 85899345920), (1024, 1024), ("8e9", 8 * 10**9)])
def test_parse_bytes(text: Any, nbytes: int) -> None:
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["-1", -1, "80GB?", "0", 0, "GiB", "80 XB", True, "1e-3"])
def test_parse_bytes_refuses(text: Any) -> None:
    with pytest.raises(ValueError, match=r"^constraints\.device_memory=.*allowed"):
        parse_bytes(text)


def test_options_refuse_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"^optimizer\.name='lion': allowed adamw, sgd, none"):
        memory_options({"name": "lion"})
    with pytest.raises(ValueError, match=r"^memory\.activation_checkpointing='some': allowed"):
        memory_options(None, {"activation_checkpointing": "some"})


def test_format_bytes() -> None:
    assert format_bytes(80 * 2**30) == "80.00 GiB"
    assert format_bytes(512) == "512 B"


def test_kinds_are_named_once() -> None:
    assert len(set(KINDS)) == len(KINDS)


def test_backward_weight_reads_and_regather_edges(toy8: TopologyTables) -> None:
    graph = step_graph(toy8)
    names, target = toy8.nodes["name"], toy8.nodes["target"]
    reads = graph.backward_weight_reads()
    # Each of the 20 weights but the embedding table is read by the backward through a
    # forward copy: the 7 + 2 norms per layer, the final norm and the head = 20 copies,
    # each read once (mm's transposed weight, the norm backward's weight).
    readers = {graph.edges[e][0] for e in reads}
    assert len(readers) == 20 == len(reads)
    for u in readers:
        assert target[u] in ("aten.t.default", "aten._to_copy.default"), names[u]
        (param,) = graph.weight_source(u)
        assert toy8.nodes["role"][param] == "param"
    # The chains param -> _to_copy (-> t): one or two edges per copy.
    chain = graph.regather_edges()
    assert chain.sum() == sum(2 if target[u] == "aten.t.default" else 1 for u in readers)
    for e in np.flatnonzero(chain):
        assert graph.weight_derived[graph.edges[e][2]]


def test_limit_below_the_peak_changes_the_plan_which_fits(toy8: TopologyTables) -> None:
    """No parameter budget: the cheapest toy plan on 8 is DDP. A device-memory limit one
    byte below its peak must move some parameters to a sharded placement."""
    from dataclasses import replace

    from pipeline.costmodel.factors import group_structure
    from pipeline.costmodel.hardware import load_hardware
    from pipeline.memory.constraint import fit_plan
    from pipeline.memory.model import memory_model
    from pipeline.solvers.ilp import solve_ilp
    from pipeline.solvers.lagrangian import solve_with_rows
    from pipeline.solvers.trws import solve_trws
    from pipeline.stages.costs.stage import build_mrf

    hw = load_hardware(str(Path(__file__).resolve().parents[2] / "conf/hardware/h100.yaml"))
    mrf = build_mrf(toy8, hw, lazy=True).mrf
    gs = group_structure(toy8)
    graph, opts = step_graph(toy8), MemoryOptions()
    terms = linear_terms(toy8, graph, opts)
    coef = terms.group_coef(gs.group_of, gs.domain)
    free = solve_trws(mrf)
    assert free.status == "Optimal"
    plan0 = np.asarray(free.labels)[gs.group_of]
    peak0 = walk(toy8, graph, opts, plan0).peak_bytes
    params = [v for v, r in enumerate(toy8.nodes["role"]) if r == "param"]
    assert all(toy8.slist_outputs[toy8.nodes["slist"][v]][plan0[v]] == "R" for v in params)

    model = memory_model(toy8, gs.group_of, gs.domain, opts)
    fit = fit_plan(lambda rows: solve_with_rows(mrf, rows, solve_trws), model.walk_labels,
                   model.peak_coef, coef, peak0 - 1, mrf.unary, f"{int(peak0 - 1)}")
    plan1 = np.asarray(fit.result.labels)[gs.group_of]
    assert (plan1 != plan0).any()
    assert fit.peak.peak_bytes <= peak0 - 1
    assert fit.result.objective >= free.objective
    assert any(toy8.slist_outputs[toy8.nodes["slist"][v]][plan1[v]] != "R" for v in params)
    # Every cut is the memory live at a node of a plan that exceeded the limit, as a row:
    # the plan it was made from violates it, the final plan satisfies it.
    for row in fit.rows:
        assert sum(float(c[fit.result.labels[g]]) for g, c in row.coef.items()) <= peak0 - 1
    # The exact program with the same rows: its optimum lies between TRW-S's bound and
    # TRW-S's plan.
    exact = solve_ilp(replace(mrf, linear_constraints=fit.rows), backend="highs")
    assert exact.status == "Optimal"
    assert fit.result.lower_bound <= exact.objective + 1e-6
    assert exact.objective <= fit.result.objective + 1e-6


def test_reserve_term_is_added_before_the_limit(toy8: TopologyTables) -> None:
    """``memory.reserve_fraction = f``: the device reserves (1 + f) x the liveness peak,
    and that is what the limit bounds. By hand with f = 0.25: the free (DDP) plan's
    reserved bytes are 1.25 x its peak; a limit one byte below that (still 25 % above the
    peak) is met by a plan whose peak is at most limit / 1.25: the same solves as
    without a reserve against limit / 1.25. The run record reports both figures."""
    from pipeline.core.errors import PlanError
    from pipeline.costmodel.factors import group_structure
    from pipeline.costmodel.hardware import load_hardware
    from pipeline.memory.constraint import check_feasible, fit_plan, reserved
    from pipeline.memory.model import memory_model
    from pipeline.memory.record import memory_record
    from pipeline.solvers.lagrangian import solve_with_rows
    from pipeline.solvers.trws import solve_trws
    from pipeline.stages.costs.stage import build_mrf

    assert reserved(10 * 2**30, 0.25) == 12.5 * 2**30
    assert reserved(10 * 2**30, 0.0) == 10 * 2**30
    hw = load_hardware(str(Path(__file__).resolve().parents[2] / "conf/hardware/h100.yaml"))
    mrf = build_mrf(toy8, hw, lazy=True).mrf
    gs = group_structure(toy8)
    opts = MemoryOptions(reserve_fraction=0.25)
    model = memory_model(toy8, gs.group_of, gs.domain, opts)
    coef = model.coef()
    free = solve_trws(mrf)
    plan0 = np.asarray(free.labels)
    peak0 = model.walk_labels(plan0).peak_bytes

    def fit(limit: float) -> Any:
        return fit_plan(lambda rows: solve_with_rows(mrf, rows, solve_trws), model.walk_labels,
                        model.peak_coef, coef, limit, mrf.unary, f"{int(limit)}",
                        reserve_fraction=0.25)

    # limit L with the reserve is the liveness check against L / 1.25, bit for bit
    limit = 1.25 * peak0 - 1  # 25 % above the free plan's peak, below its reserved bytes
    with_reserve = fit(limit)
    same = fit_plan(lambda rows: solve_with_rows(mrf, rows, solve_trws), model.walk_labels,
                    model.peak_coef, coef, limit / 1.25, mrf.unary, "x")
    assert [r.high for r in with_reserve.rows] == [r.high for r in same.rows]
    assert with_reserve.rows[0].high == limit / 1.25
    assert list(with_reserve.result.labels) == list(same.result.labels)
    assert with_reserve.peak.peak_bytes < peak0
    assert reserved(with_reserve.peak.peak_bytes, 0.25) <= limit
    strategy = plan0[gs.group_of]
    record = memory_record(model.graph, model.terms, model.walk(strategy), strategy,
                           list(toy8.nodes["name"]), 1.25 * peak0 - 1)
    assert record["peak_bytes"] == peak0 and record["reserve_fraction"] == 0.25
    assert record["reserved_bytes"] == 1.25 * peak0 and record["fits"] is False
    # a limit below 1.25 x the smallest linear memory is refused, naming the reserve
    least = check_feasible(coef, mrf.unary, 10 * peak0, "big", 0.25)
    with pytest.raises(PlanError, match=r"^constraints\.device_memory=tight: infeasible, .*"
                                        r"x 1\.25 with memory\.reserve_fraction=0\.25"):
        check_feasible(coef, mrf.unary, 1.25 * least - 1, "tight", 0.25)
    check_feasible(coef, mrf.unary, 1.25 * least, "exact", 0.25)


def test_checkpointing_pays_the_recomputed_forward_again(toy8: TopologyTables) -> None:
    """``full``: each repeated layer's forward ops (weight casts and gathers aside) and
    the redistributions into them are paid twice; lazy and eager costs agree bit for
    bit."""
    from pipeline.core.dtypes import itemsize
    from pipeline.costmodel.breakdown import plan_breakdown
    from pipeline.costmodel.factors import group_structure
    from pipeline.costmodel.hardware import load_hardware
    from pipeline.costmodel.redistribute import redistribute_us
    from pipeline.stages.costs.stage import build_mrf

    hw = load_hardware(str(Path(__file__).resolve().parents[2] / "conf/hardware/h100.yaml"))
    plain = build_mrf(toy8, hw, lazy=True, memory=MemoryOptions())
    full = build_mrf(toy8, hw, lazy=True, memory=MemoryOptions(checkpointing="full"))
    eager = build_mrf(toy8, hw, lazy=False, memory=MemoryOptions(checkpointing="full"))
    gs = group_structure(toy8)
    rng = np.random.default_rng(1)
    graph = full.memory.graph
    nodes, edges = graph.recomputed_nodes(), graph.recomputed_edges()
    layers = set(graph.repeated_layers)
    # Every forward op of a block but views of weights / casts is recomputed.
    for v in np.flatnonzero(nodes):
        assert toy8.nodes["layer"][v] in layers and toy8.nodes["phase"][v] == "fwd"
    assert nodes.sum() > 100
    for _ in range(3):
        labels = np.array([rng.integers(k) for k in gs.domain])
        strategy = labels[gs.group_of]
        a = plan_breakdown(plain.cost_model(), strategy)
        b = plan_breakdown(full.cost_model(), strategy)
        assert np.array_equal(b.compute_us, a.compute_us * (1 + nodes))
        expected_comm = a.comm_us.copy()
        cm = plain.cost_model()
        for k, (u, el, v, arg) in enumerate(graph.edges):
            if edges[k]:
                r, srcs = cm.out_classes(u, el)
                c, dsts = cm.in_classes(v, arg)
                meta = cm.in_metas[v][arg]
                expected_comm[v] += redistribute_us(
                    meta["shape"], itemsize(meta["dtype"]), srcs[r[strategy[u]]],
                    dsts[c[strategy[v]]], cm.mesh_shape, hw)
        assert b.comm_us == pytest.approx(expected_comm, rel=1e-12)
        assert full.mrf.evaluate(labels) == eager.mrf.evaluate(labels)
        assert full.mrf.evaluate(labels) == pytest.approx(
            b.compute_us.sum() + b.comm_us.sum() + b.transition_us.sum(), rel=1e-12)


def test_peak_row_prices_what_is_live_at_the_peak(toy8: TopologyTables) -> None:
    """The cut of the liveness check, evaluated at the plan it was made from, is that
    plan's peak (every live allocation, priced by its node's strategy)."""
    from pipeline.costmodel.factors import group_structure
    from pipeline.memory.model import memory_model

    gs = group_structure(toy8)
    rng = np.random.default_rng(2)
    for mode in ("none", "full"):
        for reshard in (True, False):
            model = memory_model(toy8, gs.group_of, gs.domain,
                                 MemoryOptions(checkpointing=mode, reshard_after_forward=reshard))
            for _ in range(3):
                labels = np.array([rng.integers(k) for k in gs.domain])
                live = model.walk_labels(labels)
                coef = model.peak_coef(live)
                value = sum(float(c[labels[g]]) for g, c in coef.items())
                assert value == pytest.approx(live.peak_bytes, rel=1e-12)
