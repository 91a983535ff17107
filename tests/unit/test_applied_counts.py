"""The applied path's collective record (pipeline/verify/applied.py): the loss's traced
nodes and the named differences, on small hand-made inputs with values worked out by
hand."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pipeline.core.ir import IRNode
from pipeline.verify.applied import (
    LOSS_REASON,
    embedding_backward_entry,
    hsdp_gradient_entry,
    loss_region,
    pair_gradient_reductions,
    unplanned_collectives,
)


def _node(idx: int, name: str, phase: str, module_path: str, refs: list[int],
          kind: str = "call_function") -> IRNode:
    fields: dict[str, Any] = {"role": "activation", "fqn": None, "layer": None,
                              "output_desc": None}
    return IRNode(idx=idx, name=name, kind=kind, target=f"aten.{name}.default", args=[],
                  kwargs={}, outputs=[], tuple_output=False, phase=phase,
                  module_path=module_path, refs=refs, **fields)


def test_loss_region_is_the_roots_tail_and_the_backward_before_any_submodule() -> None:
    nodes = [
        _node(0, "tokens", "fwd", "", [], kind="placeholder"),
        _node(1, "cast", "fwd", "", [0]),                 # root op before the layers
        _node(2, "mm", "fwd", "layers.0", [1]),
        _node(3, "log_softmax", "fwd", "", [2]),
        _node(4, "nll_loss_forward", "fwd", "", [3]),
        _node(5, "nll_loss_backward", "bwd", "", [4]),
        _node(6, "log_softmax_backward", "bwd", "", [5]),
        _node(7, "mm_backward", "bwd", "layers.0", [6]),
        _node(8, "add", "bwd", "", [7]),                 # a residual gradient sum
    ]
    assert loss_region(nodes) == {"log_softmax", "nll_loss_forward", "nll_loss_backward",
                                  "log_softmax_backward"}


def test_the_loss_difference_is_named_and_nothing_is_left() -> None:
    # toy at mesh 4: 9 gathers and 5 reduce-scatters of FSDP2 on both sides; the plan
    # gathers log-probabilities and labels (2), the step all-reduces its loss (2)
    counted = {"all_gather(dp)": 9, "all_reduce(dp)": 2, "reduce_scatter(dp)": 5}
    planned = {"all_gather(dp)": 11, "reduce_scatter(dp)": 5}
    entries, rest = unplanned_collectives(counted, planned, [
        ("loss", {"all_reduce(dp)": 2}, {"all_gather(dp)": 2}, LOSS_REASON)])
    assert entries == [{"cause": "loss", "counted": {"all_reduce(dp)": 2},
                        "planned": {"all_gather(dp)": 2}, "reason": LOSS_REASON}]
    assert rest == {}


def test_a_difference_outside_the_loss_is_left_unexplained() -> None:
    # the same loss on both sides (no entry); one extra gather over tp and one planned
    # reduce-scatter over tp not issued
    counted = {"all_gather(tp)": 3, "all_reduce(dp)": 2}
    planned = {"all_gather(tp)": 2, "all_reduce(dp)": 2, "reduce_scatter(tp)": 1}
    entries, rest = unplanned_collectives(counted, planned, [
        ("loss", {"all_reduce(dp)": 2}, {"all_reduce(dp)": 2}, LOSS_REASON)])
    assert entries == []
    assert rest == {"all_gather(tp)": 1, "reduce_scatter(tp)": -1}


def test_an_hsdp_units_gradient_is_one_reduce_scatter_and_one_all_reduce() -> None:
    units = {"layers.0": {"shard": ["tp"], "replicate": ["dp"]},
             "norm": {"shard": ["cp", "tp"], "replicate": ["dp"]},
             "output": {"shard": ["dp", "tp"], "replicate": []}}  # FSDP: not HSDP
    buckets = {"layers.0": {"reduce_scatter(dp+tp)": 1}, "norm": {"reduce_scatter(dp+tp)": 1},
               "output": {"reduce_scatter(dp+tp)": 1}}
    assert hsdp_gradient_entry(units, buckets) == (
        {"all_reduce(dp)": 2, "reduce_scatter(cp+tp)": 1, "reduce_scatter(tp)": 1},
        {"reduce_scatter(dp+tp)": 2})


def test_a_gradient_reduce_scattered_then_gathered_is_one_all_reduce() -> None:
    # toy ddp at 2x2: a weight gradient P -> S(0) on dp and tp (produced by mm_15, node
    # 40), cast, then S(0) -> R on both (produced by the cast, node 90): per mesh dim a
    # reduce-scatter then an all-gather, the ring all-reduce (given out of order)
    steps = [(90, "all_gather(dp)"), (40, "reduce_scatter(dp)"), (90, "all_gather(tp)"),
             (40, "reduce_scatter(tp)")]
    assert sorted(pair_gradient_reductions(steps)) == ["all_reduce(dp)", "all_reduce(tp)"]


def test_only_a_gather_after_a_reduce_scatter_on_the_same_dims_pairs() -> None:
    # a gather before the reduce-scatter, or on other dims, is not a ring all-reduce;
    # the flattened dims pair only with the flattened dims
    steps = [(1, "all_gather(dp)"), (2, "reduce_scatter(dp)"), (3, "all_gather(tp)"),
             (4, "reduce_scatter(dp+tp)"), (5, "all_gather(dp+tp)"), (6, "all_reduce(tp)")]
    assert pair_gradient_reductions(steps) == [
        "all_gather(dp)", "reduce_scatter(dp)", "all_gather(tp)", "all_reduce(dp+tp)",
        "all_reduce(tp)"]


def _embedding_graph() -> tuple[list[IRNode], Any]:
    """tokens, the table, the embedding; in backward the output gradient, the
    embedding's backward (module ``tok_embeddings``) and the gradient sink."""
    nodes = [_node(0, "tokens", "fwd", "", [], kind="placeholder"),
             _node(1, "primals_1", "fwd", "", [], kind="placeholder"),
             _node(2, "embedding", "fwd", "tok_embeddings", [1, 0]),
             _node(3, "grad_out", "bwd", "layers.0", [2]),
             _node(4, "embedding_dense_backward", "bwd", "tok_embeddings", [3, 0])]
    nodes[1].role, nodes[1].fqn = "param", "tok_embeddings.weight"
    out = IRNode(idx=5, name="output", kind="output", target="output",
                 args=[[{"node": 4}]], kwargs={}, outputs=[], tuple_output=False,
                 phase="bwd", module_path="", refs=[4], role="activation", fqn=None,
                 layer=None, output_desc=None)
    plan = SimpleNamespace(outputs=[{"index": 0, "kind": "grad",
                                     "grad_of": "tok_embeddings.weight"}],
                           mesh_shape=(2, 2), mesh_names=("dp", "tp"))
    return [*nodes, out], plan


def test_the_embedding_backward_entry_reads_its_module_and_its_edges() -> None:
    # ddp: the plan gathers the output gradient and the indices over dp before the
    # backward (2 all-gathers); the module's backward all-reduced its Partial gradient
    # once; another module's collectives and the embedding's forward are not its own
    nodes, plan = _embedding_graph()
    rows = [{"producer_name": "grad_out", "consumer_name": "embedding_dense_backward",
             "collectives": ["all_gather(dp)"]},
            {"producer_name": "tokens", "consumer_name": "embedding_dense_backward",
             "collectives": ["all_gather(dp)"]},
            {"producer_name": "grad_out", "consumer_name": "mm", "collectives": ["x(dp)"]}]
    counts = {"tok_embeddings": {"bwd": {"all_reduce(dp)": 1}, "fwd": {"all_gather(dp)": 3}},
              "layers.0": {"bwd": {"all_gather(dp)": 5}}}
    assert embedding_backward_entry(rows, nodes, plan, {}, {}, (), counts) == (
        {"all_reduce(dp)": 1}, {"all_gather(dp)": 2})


def test_the_embedding_backward_entry_leaves_the_fsdp_bucket_out() -> None:
    # fsdp_tp: the gradient PP -> S(1)S(0): its reduce-scatter over dp is the unit's
    # FSDP2 bucket (not DTensor's), the one over tp is DTensor's; the module's backward
    # all-gathered the output gradient over tp
    nodes, plan = _embedding_graph()
    rows = [{"producer_name": "embedding_dense_backward",
             "consumer_name": "output:grad:tok_embeddings.weight",
             "collectives": ["reduce_scatter(dp)", "reduce_scatter(tp)"]}]
    units = {"tok_embeddings.weight": "tok_embeddings"}
    counts = {"tok_embeddings": {"bwd": {"all_gather(tp)": 1}}}
    assert embedding_backward_entry(rows, nodes, plan, units,
                                    {"tok_embeddings.weight": ["dp"]}, (), counts) == (
        {"all_gather(tp)": 1}, {"reduce_scatter(tp)": 1})
