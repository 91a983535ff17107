"""Gradient accumulation (pipeline/costmodel/accumulation.py), worked out by hand on the
two-layer graph of tests/unit/test_steptime.py."""

from __future__ import annotations

import pytest

from pipeline.costmodel.accumulation import (
    accumulated_peak_bytes,
    accumulated_step,
    without_sync,
)
from pipeline.costmodel.steptime import StepInputs, gradient_edges


def _graph(rs: float) -> StepInputs:
    """Two layers, as test_steptime's graph: pA -> a0 (gather 4 µs on dim 0), a0 -> a1
    (all-reduce 3 µs on dim 1), pB -> a1 (gather 6 µs), a1 -> b1 -> b0, a1 -> gB, the
    weight gradient gB -> sink sB (reduce-scatter ``rs`` µs on dim 0); compute a0 10,
    a1 10, b1 20, gB 5, b0 20."""
    names = ["pA", "pB", "x", "a0", "a1", "b1", "gB", "b0", "sB", "out"]
    return StepInputs(
        names=names, phase=["fwd"] * 5 + ["bwd"] * 5,
        layer=["L0", "L1", None, "L0", "L1", "L1", "L1", "L0", "L1", None],
        role=["param", "param", "input", "activation", "activation", "activation",
              "activation", "activation", "grad", "loss"],
        placeholder=[True, True, True] + [False] * 7, sink=[False] * 8 + [True, True],
        weight_derived=[False] * 10,
        compute_us=[0.0, 0.0, 0.0, 10.0, 10.0, 20.0, 5.0, 20.0, 0.0, 0.0],
        edges=[(2, 3), (0, 3), (3, 4), (1, 4), (4, 5), (4, 6), (5, 7), (6, 8), (7, 9)],
        steps=[[], [(0, 4.0)], [(1, 3.0)], [(0, 6.0)], [], [], [], [(0, rs)], []],
        num_dims=2)


def test_gradient_edges_and_without_sync():
    g = _graph(30.0)
    assert gradient_edges(g) == [False] * 7 + [True, False]
    assert without_sync(g).steps[7] == [] and without_sync(g).steps[1] == [(0, 4.0)]
    assert g.steps[7] == [(0, 30.0)]  # not modified


def test_accumulated_step_by_hand():
    """One microbatch (test_steptime's schedule): gather 0-4, a0 4-14, all-reduce 14-17,
    a1 17-27, b1 27-47, gB 47-52, b0 52-72, and gB's reduce-scatter of 30 µs 52-82: the
    step with sync is 82 µs, without it 72 µs. Four microbatches: 3 x 72 + 82 = 298 µs,
    compute 4 x 65 = 260 µs, the reduction once (30 µs)."""
    acc = accumulated_step(_graph(30.0), 4)
    assert acc.with_sync.step_time_us == 82.0
    assert acc.without_sync.step_time_us == 72.0
    assert acc.step_us == 298.0
    assert acc.compute_us == 260.0
    assert acc.gradient_comm_us == 30.0
    one = accumulated_step(_graph(30.0), 1)
    assert one.step_us == 82.0 and one.without_sync is one.with_sync
    with pytest.raises(ValueError):
        accumulated_step(_graph(30.0), 0)


def test_accumulated_memory_by_hand():
    # 10 GiB for one microbatch, 2 GiB of unsharded fp32 gradients accumulated
    assert accumulated_peak_bytes(10 * 2**30, 2 * 2**30, 4) == 12 * 2**30
    assert accumulated_peak_bytes(10 * 2**30, 2 * 2**30, 1) == 10 * 2**30
