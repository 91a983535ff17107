"""The applied path's collective record (pipeline/verify/applied.py): the loss's traced
nodes and the named differences, on small hand-made inputs with values worked out by
hand."""

from __future__ import annotations

from typing import Any

from pipeline.core.ir import IRNode
from pipeline.verify.applied import (
    LOSS_REASON,
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
