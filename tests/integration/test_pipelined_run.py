"""Pipelined runs end to end through ``python -m pipeline`` (docs/pipelining.md,
"Pipelined runs"): toy on mesh ``2,2`` named ``pp,dp`` (1F1B, 8 microbatches) and on
mesh ``2`` named ``pp`` (GPipe, 4 microbatches). The record's pipeline section is checked
against values worked out here from the stage solve's own record: the stage times as
sums of its per-layer profile (whose totals are the stage solve's simulated compute and
comm), the GPipe step of two stages by hand, the 1F1B bubble as the ranks' idle share,
the closed forms, the boundary send, and each rank's peak as state + in-flight
activations + transient + unsharded FSDP buffers. Bad input: one line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from pipeline.config import load_resolved, stage_dirs

ROOT = Path(__file__).resolve().parents[2]
PPDP = ("model=toy", "mesh=2,2", "mesh_names=[pp,dp]")
PP = ("model=toy", "mesh=2", "mesh_names=[pp]", "pipeline.schedule=gpipe",
      "pipeline.microbatches=4")
STATE = ("parameters", "gradients", "optimizer_state", "buffers")


def _run(tmp: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", f"results_dir={tmp}", *overrides],
        cwd=tmp, capture_output=True, text=True, timeout=900,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp),
             "PIPELINE_PROGRESS": "0"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp")
    out = {}
    for key, overrides in (("ppdp", PPDP), ("pp", PP)):
        proc = _run(tmp, *overrides)
        assert proc.returncode == 0, proc.stderr[-3000:]
        cfg = load_resolved([f"results_dir={tmp}", *overrides])
        solve = Path(stage_dirs(cfg).solve)
        rec = json.loads((solve / "run.json").read_text())
        stage = json.loads((Path(rec["pipeline"]["stage_solve_dir"]) / "run.json").read_text())
        plan = json.loads((solve / "plan.json").read_text())
        out[key] = (rec, stage, plan, cfg)
    out["tmp"] = tmp
    return out


def _segment_sum(prof: dict, lo: int, hi: int, first: bool, last: bool, key: str) -> float:
    total = sum(prof["per_layer"][key][lo:hi])
    return total + (prof["first"][key] if first else 0.0) + (prof["last"][key] if last else 0.0)


def _bytes(prof: dict, lo: int, hi: int, first: bool, last: bool, kinds) -> float:
    segs = prof["per_layer"]["bytes"][lo:hi] + ([prof["first"]["bytes"]] if first else []) \
        + ([prof["last"]["bytes"]] if last else [])
    return sum(b.get(k, 0.0) for b in segs for k in kinds)


@pytest.mark.parametrize("key", ["ppdp", "pp"])
def test_profile_totals_are_the_stage_solve(runs, key):
    """The profile splits the stage solve's own numbers: its segments' fwd + bwd add up
    to the simulated compute (with fusion) plus the activation comm, its gathers to the
    weight comm, its reductions to the gradient comm, its bytes to the linear memory."""
    _, stage, _, _ = runs[key]
    prof = stage["layer_profile"]
    segs = [prof["first"], prof["last"]] + [
        {k: prof["per_layer"][k][i] for k in ("fwd_us", "bwd_us", "gather_us", "reduce_us")}
        | {"bytes": prof["per_layer"]["bytes"][i]} for i in range(len(prof["layers"]))]
    by_kind = stage["step_time"]["comm_us_by_kind"]
    work = sum(s["fwd_us"] + s["bwd_us"] for s in segs)
    assert work == pytest.approx(stage["step_time"]["compute_us"] + by_kind["activation"],
                                 rel=1e-9)
    assert sum(s["gather_us"] for s in segs) == pytest.approx(by_kind["weight"], rel=1e-9)
    assert sum(s["reduce_us"] for s in segs) == pytest.approx(by_kind["gradient"], rel=1e-9)
    assert sum(sum(s["bytes"].values()) for s in segs) == pytest.approx(
        stage["memory"]["linear_bytes"], rel=1e-9)
    assert prof["layers"] == ["layers.0", "layers.1"]


def test_ppdp_1f1b(runs):
    rec, stage, plan, cfg = runs["ppdp"]
    pl = rec["pipeline"]
    prof = stage["layer_profile"]
    p, m = 2, 8  # microbatches auto: the local batch 16 / dp 2 = 8, one sample each
    assert (pl["degree"], pl["schedule"], pl["microbatches"], pl["virtual_stages"],
            pl["split"]) == (p, "1f1b", m, 1, [0, 1, 2])
    # the stage solve: sub-mesh dp=2, one microbatch of the whole data-parallel batch
    assert (stage["mesh"], stage["mesh_names"], stage["config"]["model"]["batch_size"]) == (
        "2", ["dp"], 2)
    assert pl["stage_solves"] == 1 and pl["microbatch_size"] == 1
    assert pl["closed_form_bubble"] == pytest.approx((p - 1) / (m + p - 1))  # 1/9
    # boundary send: one sample of [2048, 256] bf16 = 1 MiB over NVLink (h100.yaml:
    # 390 GB/s, 30 µs), both ranks on one node
    assert pl["send_bytes"] == 2048 * 256 * 2
    assert pl["send_us"] == [pytest.approx(30.0 + 2048 * 256 * 2 / 390e9 * 1e6)]
    step = rec["step_time_us"]
    busy = 0.0
    for r, (lo, hi) in enumerate([(0, 1), (1, 2)]):
        row = pl["ranks"][r]
        f = _segment_sum(prof, lo, hi, r == 0, r == 1, "fwd_us")
        b = _segment_sum(prof, lo, hi, r == 0, r == 1, "bwd_us")
        assert row["fwd_us"] == [pytest.approx(f)] and row["bwd_us"] == [pytest.approx(b)]
        assert row["busy_us"] == pytest.approx(m * (f + b))
        busy += m * (f + b)
        # 1F1B: rank r holds p - r microbatches; under FSDP (this plan gathers weights)
        # the stage's gathered parameters (bf16) during each op and, from the first
        # backward, its gradients accumulated unsharded (float32, twice the bytes): the
        # peak is at a forward after the first backward
        assert row["in_flight"] == p - r
        gathered = _segment_sum(prof, lo, hi, r == 0, r == 1, "gathered_bytes")
        assert gathered > 0 and _segment_sum(prof, lo, hi, r == 0, r == 1, "gather_us") > 0
        state = _bytes(prof, lo, hi, r == 0, r == 1, STATE)
        act = _bytes(prof, lo, hi, r == 0, r == 1, ["saved_activations"])
        transient = max(prof["per_layer"]["transient_bytes"][lo:hi]
                        + [prof["first" if r == 0 else "last"]["transient_bytes"]])
        want = state + (p - r) * act + transient + gathered * (1 + 4 / 2)
        assert row["peak_bytes"] == pytest.approx(want, rel=1e-9)
        assert row["modules"] == [[["tok_embeddings", "layers.0"],
                                   ["layers.1", "norm", "output"]][r]]
    assert pl["bubble_fraction"] == pytest.approx(1 - busy / (p * step))
    assert rec["tokens_per_s_per_device"] == pytest.approx(16 * 2048 / 4 / (step * 1e-6))
    assert rec["memory"]["peak_bytes"] == max(r["peak_bytes"] for r in pl["ranks"])
    assert plan["pipeline"]["stages"] == [
        {"stage": 0, "rank": 0, "layers": [0, 1], "modules": ["tok_embeddings", "layers.0"]},
        {"stage": 1, "rank": 1, "layers": [1, 2], "modules": ["layers.1", "norm", "output"]}]
    assert (plan["pipeline"]["schedule"], plan["pipeline"]["microbatches"],
            plan["pipeline"]["virtual_stages"]) == ("1f1b", m, 1)
    runs_table = pd.read_parquet(Path(cfg.results_dir) / "report" / "runs.parquet")
    row = runs_table[runs_table["solve_dir"] == rec["solve_dir"]].iloc[0]
    assert (row["pipeline.degree"], row["pipeline.microbatches"]) == (2, m)
    assert row["pipeline.bubble_fraction"] == pytest.approx(pl["bubble_fraction"])
    assert row["step_time_us"] == pytest.approx(step)


def test_pp_gpipe_by_hand(runs):
    """Two stages on one device each (no collectives): the GPipe step by hand. Rank 1's
    forwards end at ``f0 + s + f1 + 3 max(f0, f1)`` (each waits for rank 0's and its
    own previous one), its backwards follow; rank 0's backward ``i`` waits for rank 1's
    plus the send: it ends at that + ``s + b1 + b0 + 3 max(b0, b1)``."""
    rec, stage, _, _ = runs["pp"]
    pl = rec["pipeline"]
    prof = stage["layer_profile"]
    m = 4
    assert stage["mesh"] == "1" and stage["config"]["model"]["batch_size"] == 4
    f0 = _segment_sum(prof, 0, 1, True, False, "fwd_us")
    b0 = _segment_sum(prof, 0, 1, True, False, "bwd_us")
    f1 = _segment_sum(prof, 1, 2, False, True, "fwd_us")
    b1 = _segment_sum(prof, 1, 2, False, True, "bwd_us")
    s = 30.0 + 4 * 2048 * 256 * 2 / 390e9 * 1e6  # a microbatch of 4 samples (16 / 4)
    assert pl["send_us"] == [pytest.approx(s)]
    forwards = f0 + s + f1 + (m - 1) * max(f0, f1)
    step = forwards + s + b1 + b0 + (m - 1) * max(b0, b1)
    assert rec["step_time_us"] == pytest.approx(step, rel=1e-9)
    assert pl["bubble_fraction"] == pytest.approx(1 - m * (f0 + b0 + f1 + b1) / (2 * step))
    assert pl["closed_form_bubble"] == pytest.approx(1 / 5)
    for r, (lo, hi) in enumerate([(0, 1), (1, 2)]):
        row = pl["ranks"][r]
        assert row["in_flight"] == m  # GPipe: every microbatch on every rank
        assert row["gather_us"] == 0 and row["reduce_us"] == 0
        transient = max(prof["per_layer"]["transient_bytes"][lo:hi]
                        + [prof["first" if r == 0 else "last"]["transient_bytes"]])
        want = (_bytes(prof, lo, hi, r == 0, r == 1, STATE)
                + m * _bytes(prof, lo, hi, r == 0, r == 1, ["saved_activations"])
                + transient)
        assert row["peak_bytes"] == pytest.approx(want, rel=1e-9)


def test_bad_input(tmp_path):
    """The pp dim's token of a placement must be R; a rank over the device memory."""
    proc = _run(tmp_path, *PPDP, "constraints.inputs=S(0)S(0)")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "constraints.inputs=S(0)S(0): a pipeline stage's tensors are not split over the pp "
        "dim; allowed R as its (first) token"]
    assert list(tmp_path.rglob("*")) == []
    proc = _run(tmp_path, *PP, "constraints.device_memory=10MB")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("constraints.device_memory=10MB: pipeline rank 0 "), lines
    cfg = load_resolved([f"results_dir={tmp_path}", *PP, "constraints.device_memory=10MB"])
    assert not Path(stage_dirs(cfg).solve).exists()
