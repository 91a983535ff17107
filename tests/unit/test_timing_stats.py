"""The statistic of ``verify --measure`` (pipeline/verify/timing.py) and the ranking check
of the predicted-versus-measured page (pipeline/tools/results/loop.py), by hand."""

from __future__ import annotations

import pytest

from pipeline.tools.results.loop import rank_agreement
from pipeline.verify.timing import summarise


def test_slowest_rank_per_step_then_median_and_quartiles() -> None:
    """Steps (s) per rank: rank 0 [0.010, 0.030, 0.020, 0.050, 0.040], rank 1 [0.012,
    0.025, 0.021, 0.045, 0.060]: slowest per step 12, 30, 21, 50, 60 ms; sorted 12 21 30
    50 60: median 30, quartiles (inclusive: positions 1 and 3 of 0..4) 21 and 50."""
    s = summarise([[0.010, 0.030, 0.020, 0.050, 0.040], [0.012, 0.025, 0.021, 0.045, 0.060]])
    assert s["step_ms"] == pytest.approx([12.0, 30.0, 21.0, 50.0, 60.0])
    assert s["median_ms"] == pytest.approx(30.0)
    assert (s["min_ms"], s["max_ms"]) == pytest.approx((12.0, 60.0))
    assert (s["q1_ms"], s["q3_ms"]) == pytest.approx((21.0, 50.0))
    with pytest.raises(ValueError, match="no timed step"):
        summarise([[], []])


def test_rank_agreement_per_mesh() -> None:
    rows = [{"mesh": "2", "plan": "a", "predicted_ms": 1.0, "median_ms": 5.0},
            {"mesh": "2", "plan": "b", "predicted_ms": 2.0, "median_ms": 9.0},
            {"mesh": "4", "plan": "a", "predicted_ms": 1.0, "median_ms": 9.0},
            {"mesh": "4", "plan": "b", "predicted_ms": 2.0, "median_ms": 5.0},
            {"mesh": "4", "plan": "c", "predicted_ms": 3.0, "median_ms": None}]
    assert rank_agreement(rows) == {"2": True, "4": False}
