"""``verify --measure``: the applied step timed on gloo processes beside the predicted step
time (pipeline/verify/timing.py), on a tiny toy at mesh 2 under the profile calibrated
on this machine (``hardware=cpu_epyc2``, ``overlap: false``).

Independent checks: the predicted time is the run record's ``step_time_us``, which
without overlap is its compute plus its comm; the statistic is recomputed here from
the per-step times; the CLI prints the line and refuses a bad ``--measure``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_resolved

ROOT = Path(__file__).resolve().parents[2]
TINY = ("model=toy", "model.dim=128", "model.n_heads=2", "model.n_kv_heads=2",
        "model.multiple_of=128", "model.vocab_size=256", "model.seq_len=32",
        "model.batch_size=4", "model.param_dtype=float32", "hardware=cpu_epyc2", "mesh=2")


def test_timing_fields_of_verify_json(tmp_path: Path) -> None:
    from pipeline.verify.run import verify

    cfg = load_resolved([*TINY, f"results_dir={tmp_path}"])
    record = verify(cfg, interpret=False, applied=False, measure=3, warmup=1)
    saved = json.loads(Path(record["path"]).read_text())
    t = saved["timing"]
    assert "error" not in t, t.get("error")
    run = json.loads((Path(record["path"]).parent / "run.json").read_text())
    # the prediction: the run's step time; without overlap it is compute + comm
    assert t["predicted_ms"] == pytest.approx(run["step_time_us"] / 1e3, rel=1e-12)
    st = run["step_time"]
    assert st["overlap"] is False and t["overlap"] is False and t["hardware"] == "cpu_epyc2"
    assert st["step_time_us"] == pytest.approx(st["compute_us"] + st["comm_us"], rel=1e-9)
    # the statistic, recomputed from the per-step times
    steps = t["step_ms"]
    assert (t["steps"], t["warmup"], len(steps)) == (3, 1, 3)
    assert all(s > 0 for s in steps)
    assert t["median_ms"] == statistics.median(steps)
    assert (t["min_ms"], t["max_ms"]) == (min(steps), max(steps))
    assert t["min_ms"] <= t["q1_ms"] <= t["median_ms"] <= t["q3_ms"] <= t["max_ms"]
    assert len(t["cpu_median_ms"]) == 2 and all(c > 0 for c in t["cpu_median_ms"])
    assert t["ratio"] == pytest.approx(t["predicted_ms"] / t["median_ms"], rel=1e-12)
    assert len(t["load_average"]["before"]) == 3 and t["load_average"]["cores"] >= 1
    assert t["profile"]["device"].startswith("cpu")


def test_bad_measure_flag_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeline.verify", *TINY,
                           f"results_dir={tmp_path}", "--measure=-1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "--measure=-1: allowed a non-negative integer"]
    assert not list(tmp_path.rglob("*.json"))
