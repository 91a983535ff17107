"""The pipelined step (pipeline/costmodel/pipelining.py): boundary bytes and sends, FSDP2's
gathers under torch's schedules, memory per rank, all worked out by hand."""

from __future__ import annotations

import pytest

from pipeline.config import CONF_DIR
from pipeline.costmodel.hardware import load_hardware
from pipeline.costmodel.pipelining import (
    StageCost,
    boundary_bytes,
    fsdp_state,
    p2p_us,
    pipelined_step,
    rank_memory,
)
from pipeline.costmodel.schedules import Op, closed_form_bubble, rank_orders


@pytest.fixture(scope="module")
def h100():
    return load_hardware(str(CONF_DIR / "hardware" / "h100.yaml"))


def test_boundary_bytes_by_hand():
    # llama70b, one sample of 8192 tokens per microbatch, bf16: 8192 * 8192 * 2 = 128 MiB
    assert boundary_bytes(1, 8192, 8192, "bfloat16") == 128 * 2**20
    # local batch 16 in 4 microbatches of 4 samples, sequence parallel over tp=8
    assert boundary_bytes(4, 8192, 8192, "bfloat16", shards=8) == 64 * 2**20
    with pytest.raises(ValueError):
        boundary_bytes(1, 3, 1, "bfloat16", shards=4)


def test_p2p_by_hand(h100):
    s = 128 * 2**20
    # pp outermost of 8x8x8: the peers are 64 ranks apart, on two nodes. Each GPU of a
    # node sends at once: min(50 GB/s, 8 NICs * 50 GB/s / 8 GPUs) = 50 GB/s per rank.
    lat = float(h100.inter_node.latency_us)
    assert p2p_us(s, (8, 8, 8), 0, 0, h100) == pytest.approx(lat + s / 50e9 * 1e6)
    assert p2p_us(s, (8, 8, 8), 0, 0, h100) == pytest.approx(lat + 2684.35456)
    # pp=2 of 2x4 on one node: ranks 0 and 4 over NVLink at 390 GB/s, + 30 µs
    assert p2p_us(s, (2, 4), 0, 0, h100) == pytest.approx(30 + s / 390e9 * 1e6)
    # pp=4 of 4x4 (16 GPUs): boundary 0 -> 1 is ranks 0 -> 4 (node 0), 1 -> 2 is 4 -> 8
    assert p2p_us(s, (4, 4), 0, 0, h100) == pytest.approx(30 + s / 390e9 * 1e6)
    assert p2p_us(s, (4, 4), 0, 1, h100) == pytest.approx(lat + s / 50e9 * 1e6)
    assert p2p_us(0, (4, 4), 0, 1, h100) == 0.0


def test_fsdp_gathers_by_hand():
    # GPipe, one stage, m = 4: each forward finds the stage resharded (4), the first
    # backward too (5), the next backwards find it gathered (no reshard after backward).
    gpipe = rank_orders("gpipe", 1, 4)[0]
    assert fsdp_state(gpipe, True, False)[0] == {0: 5}
    assert fsdp_state(gpipe, False, False)[0] == {0: 1}
    # 1F1B p=2, rank 0: F0 F1 B0 F2 B1 B2 -> F0, F1, B0 gather; F2 finds B0's gather and
    # reshards after itself; B1 gathers; B2 does not: 4.
    one = rank_orders("1f1b", 2, 3)[0]
    assert fsdp_state(one, True, False)[0] == {0: 4}
    assert fsdp_state(one, False, False)[0] == {0: 1}
    # Interleaved p=2, m=2, v=4, rank 0 runs stages 0 0 2 2 4 4 6 6 | 6 6 4 4 2 2 0 0;
    # the schedule keeps the next 3 distinct stages gathered: {0,2,4} at the start, 6
    # replaces 0 at F4.0, 0 comes back at B4.0: stage 0 twice, the others once.
    inter = rank_orders("interleaved_1f1b", 2, 2, 4)[0]
    gathers, during = fsdp_state(inter, False, True)
    assert gathers == {0: 2, 2: 1, 4: 1, 6: 1}
    assert during[0] == {0, 2, 4} and during[4] == {2, 4, 6} and during[10] == {0, 2, 4}


def test_rank_memory_by_hand():
    st = [StageCost(1, 2, state_bytes=100, activation_bytes=10, unsharded_param_bytes=50,
                    unsharded_grad_bytes=20)]
    # 1F1B rank 0 of p=2, m=3 (F0 F1 B0 F2 B1 B2), gathered all step: F0 160, F1 170,
    # B0 100 + 20 + 50 + 20 = 190, F2 190 (B0 freed 10, F2 adds 10), B1 190, B2 180.
    one = rank_orders("1f1b", 2, 3)[0]
    assert rank_memory(one, st * 2, fsdp_state(one, False, False)[1], 3) == 190
    # GPipe m=3: all three in flight at B0: 100 + 30 + 50 + 20 = 200
    g = rank_orders("gpipe", 1, 3)[0]
    assert rank_memory(g, st, fsdp_state(g, False, False)[1], 3) == 200
    # resharded after forward: F2 holds no gathered weights; B0 does: still 200.
    assert rank_memory(g, st, fsdp_state(g, True, False)[1], 3) == 200
    no_fsdp = [StageCost(1, 2, state_bytes=100, activation_bytes=10, transient_bytes=7)]
    assert rank_memory(g, no_fsdp, fsdp_state(g, True, False)[1], 3) == 137


def test_pipelined_step_by_hand():
    """1F1B, p=2, m=2, f=1, b=2, first gather 0.5, reduction 0.25, no send:
    rank 0 F0 [0.5,1.5] F1 [1.5,2.5]; rank 1 F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5]
    B1 [5.5,7.5] + 0.25; rank 0 B0 [4.5,6.5] B1 [7.5,9.5] + 0.25 = 9.75."""
    st = [StageCost(1.0, 2.0, gather_us=0.5, reduce_us=0.25)] * 2
    r = pipelined_step("1f1b", st, 2, 2)
    assert r.step_us == 9.75
    assert r.timeline.spans[Op("B", 0, 1)] == (7.5, 9.5)
    assert r.timeline.end_us == [9.75, 7.75]
    assert r.gathers == {0: 1, 1: 1} and r.reduce_us == [0.25, 0.25]
    assert r.bubble_fraction == pytest.approx(1 - 12 / 19.5)
    assert r.in_flight == [2, 1]


@pytest.mark.parametrize("schedule, m, v", [("gpipe", 8, 1), ("1f1b", 8, 1),
                                             ("interleaved_1f1b", 8, 2)])
def test_equal_stages_without_comm_give_the_closed_form(schedule, m, v):
    st = [StageCost(1.0 / v, 2.0 / v, activation_bytes=1.0)] * (4 * v)
    r = pipelined_step(schedule, st, 4, m, virtual_stages=v)
    assert r.bubble_fraction == pytest.approx(closed_form_bubble(schedule, 4, m, v))
    # in-flight activations of the first rank: GPipe all m; 1F1B p; interleaved rank 0
    # (v-1) * 4 + 2 * 3 warm-up forwards + 1 = 11 virtual-stage microbatches
    assert r.in_flight[0] == {"gpipe": 8, "1f1b": 4, "interleaved_1f1b": 11}[schedule]
    assert r.peak_bytes[0] == {"gpipe": 8, "1f1b": 4, "interleaved_1f1b": 11}[schedule]


def test_sends_lengthen_the_step_by_hand():
    """GPipe p=2, m=1, f=1, b=2, send 0.5: F0 [0,1], F1 [1.5,2.5], B1 [2.5,4.5],
    B0 [5,7]."""
    r = pipelined_step("gpipe", [StageCost(1.0, 2.0)] * 2, 2, 1, act_send_us=0.5)
    assert r.step_us == 7.0


def test_wrong_stage_count_is_refused():
    with pytest.raises(ValueError, match="need 4"):
        pipelined_step("1f1b", [StageCost(1, 1)] * 2, 2, 2, virtual_stages=2)
