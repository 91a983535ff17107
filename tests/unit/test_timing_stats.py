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


def test_loop_page_from_a_sweep_file(tmp_path) -> None:
    """Two plans on mesh 2: a (predicted 10, median 12: ratio 0.833, within 25 %) and b
    (predicted 20, median 10: ratio 2, not within); by prediction a < b, by measurement
    b < a: not the same order."""
    import json

    from pipeline.tools.results.cli import main

    def row(plan, pred, med):
        return {"mesh": "2", "plan": plan, "verify": f"/x/{plan}/verify.json",
                "predicted_ms": pred, "median_ms": med, "min_ms": med - 1, "max_ms": med + 2,
                "q1_ms": med - 0.5, "q3_ms": med + 1, "ratio": pred / med,
                "cpu_median_ms": [5.0, 6.0], "hardware": "cpu_epyc2", "overlap": False,
                "load_average": {"before": [8.0, 8, 8], "after": [9.0, 9, 9], "cores": 2},
                "error": None}

    src = tmp_path / "predicted_vs_measured.json"
    src.write_text(json.dumps({"rows": [row("a", 10.0, 12.0), row("b", 20.0, 10.0)],
                               "meshes": ["2"], "plans": ["a", "b"], "steps": 3,
                               "warmup": 1, "overrides": ["model=toy"]}))
    assert main(["loop", str(src), "--out", str(tmp_path / "pages")]) == 0
    text = (tmp_path / "pages" / "predicted-vs-measured.md").read_text()
    assert "| 2 | a | 10 | 12 | 11.0-14.0 (11.5-13.0) | 0.833333 | 0.909091 | yes | 5.0, 6.0 |" \
        in text
    assert "| 2 | b | 20 | 10 | 9.0-12.0 (9.5-11.0) | 2 | 2.22222 | no |" in text
    assert "within 25 %: 1 of 2 plans" in text
    assert "per mesh: 2: no" in text
