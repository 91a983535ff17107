"""Exposed shares of FSDP-class collectives (pipeline/costmodel/exposure.py), worked by
hand on plans small enough to simulate on paper (pipeline/costmodel/steptime.py)."""

from __future__ import annotations

import math

import pytest

from pipeline.costmodel.exposure import exposed_shares, unit_share
from pipeline.costmodel.steptime import StepInputs, simulate


def test_unit_share_by_hand():
    # a 30 µs gather hidden behind a 20 µs unit: 10 µs exposed, a third of it
    assert unit_share(30.0, 20.0) == pytest.approx(1 / 3)
    assert unit_share(30.0, 45.0) == 0.0  # fully hidden
    assert unit_share(30.0, 0.0) == 1.0  # the first unit: nothing to hide behind
    assert unit_share(0.0, 0.0) == 1.0 and unit_share(0.0, 5.0) == 0.0  # the limits


def _two_units() -> StepInputs:
    """Two forward FSDP units (layers.0, layers.1): mm0 (20 µs) reads p0 through a 5 µs
    gather, mm1 (15 µs) reads mm0 and p1 through a 30 µs gather; both on mesh dim 0."""
    return StepInputs(
        names=["p0", "p1", "x", "mm0", "mm1", "out"],
        phase=["fwd"] * 5 + ["bwd"],
        layer=["layers.0", "layers.1", None, "layers.0", "layers.1", None],
        role=["param", "param", "input", "activation", "activation", "loss"],
        placeholder=[True, True, True, False, False, False],
        sink=[False] * 5 + [True],
        weight_derived=[False] * 6,
        compute_us=[0.0, 0.0, 0.0, 20.0, 15.0, 0.0],
        edges=[(0, 3), (2, 3), (1, 4), (3, 4), (4, 5)],
        steps=[[(0, 5.0)], [], [(0, 30.0)], [], []],
        num_dims=1)


def test_one_units_gather_by_hand():
    g = _two_units()
    sim = simulate(g)
    # by hand: both gathers are issued at 0 (unit 1 is released when the stream reaches
    # unit 0) and queue on dim 0: p0's 0-5, p1's 5-35. mm0 runs 5-25, mm1 waits for p1
    # and runs 35-50. The step is 50 µs, 15 of them exposed communication.
    assert sim.step_time_us == pytest.approx(50.0)
    assert sim.exposed_comm_us == pytest.approx(15.0)
    w = exposed_shares(g, sim)
    # unit 0's gather has no window (w = 1); unit 1's 30 µs gather hides behind unit 0's
    # 20 µs of compute: max(0, 30 - 20) / 30 = 1/3. Activation edges: 1.
    assert list(w) == pytest.approx([1.0, 1.0, 1 / 3, 1.0, 1.0])
    # re-weighted, the two gathers cost 5 + 10 = 15 µs: the exposed communication here
    assert math.fsum(wi * sum(us for _, us in s) for wi, s in zip(w, g.steps)) \
        == pytest.approx(sim.exposed_comm_us)


def test_gradient_tail_by_hand():
    # f (fwd, 10 µs), b1 (bwd, 6 µs), gw (bwd, 4 µs, the weight's gradient) then a
    # 20 µs reduce-scatter into the gradient output, b2 (bwd, 12 µs) after it.
    g = StepInputs(
        names=["x", "f", "b1", "gw", "b2", "grad_w", "grad_x"],
        phase=["fwd", "fwd", "bwd", "bwd", "bwd", "bwd", "bwd"],
        layer=[None] * 7,
        role=["input", "activation", "activation", "activation", "activation", "grad",
              "grad_input"],
        placeholder=[True] + [False] * 6,
        sink=[False] * 5 + [True, True],
        weight_derived=[False] * 7,
        compute_us=[0.0, 10.0, 6.0, 4.0, 12.0, 0.0, 0.0],
        edges=[(0, 1), (1, 2), (2, 3), (2, 4), (3, 5), (4, 6)],
        steps=[[], [], [], [], [(0, 20.0)], []],
        num_dims=1)
    sim = simulate(g)
    # by hand: f 0-10, b1 10-16, gw 16-20, the reduction 20-40 beside b2 20-32: the
    # step is 40 µs, 8 exposed (the reduction's tail after the last kernel)
    assert sim.step_time_us == pytest.approx(40.0)
    w = exposed_shares(g, sim)
    # the tail: 20 µs of reduction issued at 20 with 12 µs of compute after it: X = 8,
    # shared by the one reduction: w = 8 / 20
    assert w[4] == pytest.approx(0.4)
    assert [w[e] for e in (0, 1, 2, 3, 5)] == [1.0] * 5
    assert w[4] * 20.0 == pytest.approx(sim.exposed_comm_us)
