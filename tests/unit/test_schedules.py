"""The pipeline schedules (pipeline/costmodel/schedules.py): each rank's order against
torch's, the event simulation against the closed forms of Narayanan et al. 2021, and
the in-flight microbatches, worked out by hand."""

from __future__ import annotations

import pytest

from pipeline.costmodel.schedules import (
    Op,
    check_schedule,
    closed_form_bubble,
    closed_form_step_us,
    in_flight,
    rank_orders,
    simulate,
)


def _text(order):
    return " ".join(f"{op.kind}{op.stage}.{op.microbatch}" for op in order)


def test_orders_by_hand():
    # 1F1B, p=2, m=3: rank 0 warms up p-1-0 = 1 forward, then F B pairs, then B.
    orders = rank_orders("1f1b", 2, 3)
    assert _text(orders[0]) == "F0.0 F0.1 B0.0 F0.2 B0.1 B0.2"
    assert _text(orders[1]) == "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2"
    assert _text(rank_orders("gpipe", 2, 2)[1]) == "F1.0 F1.1 B1.0 B1.1"
    # Interleaved, p=2, m=2, v=2: one round of mpr=2; rank 0 warm-up (2-1)*2 + 2*(2-1) = 4
    # = v*m forwards (stages 0, 0, 2, 2), then its 4 backwards on stage 2 first.
    inter = rank_orders("interleaved_1f1b", 2, 2, 2)
    assert _text(inter[0]) == "F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1"
    # rank 1: warm-up (2-1)*2 + 0 = 2, then F B pairs: F3.0 B3.0 F3.1 B3.1, then B1.0 B1.1
    assert _text(inter[1]) == "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1"


CASES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 4, 1), ("gpipe", 1, 3, 1),
         ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 4, 2),
         ("interleaved_1f1b", 2, 4, 3), ("interleaved_1f1b", 4, 12, 4),
         ("interleaved_1f1b", 4, 10, 2)]


@pytest.mark.parametrize("schedule, p, m, v", CASES)
@pytest.mark.parametrize("f, b", [(1.0, 2.0), (3.0, 1.0)])
def test_simulation_equals_the_closed_forms(schedule, p, m, v, f, b):
    """Equal stages, no communication: the timeline's step and bubble are the closed
    forms (GPipe / 1F1B (p-1)/(m+p-1); interleaved (p-1)/(v m + p - 1))."""
    t = simulate(rank_orders(schedule, p, m, v), f / v, b / v)
    assert t.step_us == pytest.approx(closed_form_step_us(schedule, p, m, f, b, v), rel=1e-12)
    assert t.bubble_fraction == pytest.approx(closed_form_bubble(schedule, p, m, v), rel=1e-12)


def test_bubble_figures_by_hand():
    assert closed_form_bubble("gpipe", 4, 8) == 3 / 11
    assert closed_form_bubble("1f1b", 8, 32) == 7 / 39
    assert closed_form_bubble("interleaved_1f1b", 4, 8, 2) == 3 / 19
    # p=4, m=8, f=1, b=2: (8 + 3) * 3 = 33 µs; interleaved v=2: 8*3 + 3*3/2 = 28.5 µs
    assert simulate(rank_orders("1f1b", 4, 8), 1.0, 2.0).step_us == 33.0
    assert simulate(rank_orders("interleaved_1f1b", 4, 8, 2), 0.5, 1.0).step_us == 28.5


def test_two_stages_with_a_send_by_hand():
    """p=2, m=2, GPipe, f=1, b=2, a send of 0.5 each way, rank 0 held 1 after its last op.
    rank0: F0 [0,1] F1 [1,2]; rank1: F0 [1.5,2.5] F1 [2.5,3.5] B0 [3.5,5.5] B1 [5.5,7.5];
    rank0: B0 at 5.5 + 0.5 = 6 -> [6,8], B1 at max(8, 8) -> [8,10]; + tail 1 -> 11."""
    t = simulate(rank_orders("gpipe", 2, 2), 1.0, 2.0, act_send_us=0.5, grad_send_us=0.5,
                 hold_us={Op("B", 0, 1): 1.0})
    assert t.spans[Op("B", 0, 0)] == (6.0, 8.0)
    assert t.end_us == [11.0, 7.5] and t.step_us == 11.0
    assert t.busy_us == [6.0, 6.0]
    assert t.bubble_fraction == pytest.approx(1 - 12 / 22)
    delayed = simulate(rank_orders("gpipe", 2, 2), 1.0, 2.0, start_us=[2.0, 0.0])
    assert delayed.spans[Op("F", 1, 0)] == (3.0, 4.0)


def test_in_flight_microbatches_by_hand():
    g = rank_orders("gpipe", 4, 8)
    assert [in_flight(o) for o in g] == [8, 8, 8, 8]
    # 1F1B: rank r holds min(m, p - r): the first stage p.
    assert [in_flight(o) for o in rank_orders("1f1b", 4, 8)] == [4, 3, 2, 1]
    assert in_flight(rank_orders("1f1b", 8, 8)[0]) == 8
    # Interleaved p=4, m=8, v=2, rank 0: warm-up (2-1)*4 + 2*3 = 10 forwards, the first
    # steady F makes 11 virtual-stage activations (each half a rank's layers).
    inter = rank_orders("interleaved_1f1b", 4, 8, 2)
    assert in_flight(inter[0]) == 11
    # by hand: the 10 warm-up forwards are stage 0 x4, stage 4 x4, stage 0 x2, and the
    # first steady forward is stage 0 again ((10 // 4) % 2 = 0): 7 of stage 0 and 4 of
    # stage 4 live, 7 * 3 + 4 * 5 = 41 bytes.
    assert in_flight(inter[0], {0: 3.0, 4: 5.0}) == 41.0


@pytest.mark.parametrize("args, message", [
    (("zb", 2, 4, 1), "schedule=zb: allowed gpipe, 1f1b, interleaved_1f1b"),
    (("1f1b", 4, 2, 1), "microbatches=2: 1f1b needs at least as many microbatches as "
                        "pipeline ranks (4)"),
    (("1f1b", 4, 8, 2), "virtual_stages=2: 1f1b runs one stage per rank"),
    (("interleaved_1f1b", 4, 8, 1), "virtual_stages=1: interleaved_1f1b needs at least 2"),
    (("interleaved_1f1b", 4, 9, 2), "microbatches=9: interleaved_1f1b needs a multiple of "
                                    "its 2 rounds"),
    (("gpipe", 0, 4, 1), "stages=0: allowed an integer >= 1"),
])
def test_refused(args, message):
    with pytest.raises(ValueError) as err:
        check_schedule(*args)
    assert str(err.value).startswith(message)
