"""``constraints.device_memory`` and the memory record, end to end (``python -m pipeline``).

Toy on 8 devices without the parameter budget: the cheapest plan is DDP (replicated
weights). A limit one byte below that plan's reserved bytes (``(1 +
memory.reserve_fraction)`` x its liveness peak, the default fraction 0.23) must change
the plan, which then fits, and costs no less; the exact program with the same row costs at least
TRW-S's lower bound. Bad values fail with one line, exit 2, nothing written.

The run without a limit is the session's shared toy run (made in the background by the
pool, copied here); the two runs with a limit are ``python -m pipeline`` runs over the
copy (they reuse its trace, topology and costs, and write the report over all three).
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
# the additive objective: these tests are about the fit loop (the step-time search on top
# of it, pipeline/stages/solve/objective.py, is checked in the last test)
BASE = ("model=toy", "mesh=8", "constraints.param_memory=null", "solver.objective=additive")
#: The run without a limit, read from the session's shared toy runs.
FREE = BASE[1:]


def _run(tmp: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *BASE, f"results_dir={tmp}", *overrides],
        cwd=tmp, capture_output=True, text=True, timeout=900,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp),
             "PIPELINE_PROGRESS": "0"})


def _record(tmp: Path, *overrides: str) -> tuple[dict, pd.DataFrame]:
    cfg = load_resolved([*BASE, f"results_dir={tmp}", *overrides])
    solve = Path(stage_dirs(cfg).solve)
    return (json.loads((solve / "run.json").read_text()),
            pd.read_parquet(solve / "solution.parquet"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, toy_results) -> tuple[Path, int]:
    tmp = tmp_path_factory.mktemp("devmem")
    toy_results.copy_run(tmp, *FREE)
    free, _ = _record(tmp)
    assert free["memory"]["reserve_fraction"] == 0.23
    assert free["memory"]["reserved_bytes"] == 1.23 * free["memory"]["peak_bytes"]
    limit = int(free["memory"]["reserved_bytes"]) - 1
    for solver in ("approx", "ilp"):
        proc = _run(tmp, f"constraints.device_memory={limit}", f"solver={solver}")
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _run(tmp, f"constraints.device_memory={limit}", "solver.objective=step_time")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp, limit


@pytest.mark.toy_runs(FREE)
def test_memory_is_recorded_for_every_plan(runs: tuple[Path, int]) -> None:
    tmp, _ = runs
    rec, sol = _record(tmp)
    mem = rec["memory"]
    assert mem["peak_bytes"] == max(sol["live_bytes"])
    assert mem["linear_bytes"] == pytest.approx(sol["memory_bytes"].sum(), rel=1e-12)
    assert mem["linear_bytes"] == pytest.approx(sum(mem["linear"].values()), rel=1e-12)
    assert mem["peak_bytes"] == pytest.approx(sum(mem["peak"].values()), rel=1e-12)
    assert mem["peak_minus_linear_bytes"] == mem["peak_bytes"] - mem["linear_bytes"]
    assert "limit_bytes" not in mem
    # DDP: every parameter replicated, 16 B per element (fp32 weight, fp32 gradient, two
    # fp32 AdamW moments) of the toy's 2,098,432 elements on each device.
    lin = mem["linear"]
    assert lin["parameters"] + lin["gradients"] + lin["optimizer_state"] == 16 * 2_098_432
    params = sol[sol.role == "param"]
    assert set(params.memory_kind) == {"parameters+optimizer_state"}
    report = pd.read_parquet(tmp / "report" / "runs.parquet")
    assert {"memory.peak_bytes", "memory.reserved_bytes", "memory.linear.saved_activations",
            "memory.peak.transient"} <= set(report.columns)


@pytest.mark.toy_runs(FREE)
def test_limit_below_the_peak_changes_the_plan_and_it_fits(runs: tuple[Path, int]) -> None:
    tmp, limit = runs
    free, _ = _record(tmp)
    for solver in ("approx", "ilp"):
        rec, sol = _record(tmp, f"constraints.device_memory={limit}", f"solver={solver}")
        mem = rec["memory"]
        assert rec["placement_hash"] != free["placement_hash"]
        assert mem["fits"] is True and mem["reserved_bytes"] <= limit == mem["limit_bytes"]
        assert mem["reserved_bytes"] == 1.23 * mem["peak_bytes"]
        assert rec["objective"] >= free["objective"]
        assert max(sol["live_bytes"]) == mem["peak_bytes"]
        assert mem["rounds"][0]["peak_bytes"] == free["memory"]["peak_bytes"]
    approx, _ = _record(tmp, f"constraints.device_memory={limit}", "solver=approx")
    exact, _ = _record(tmp, f"constraints.device_memory={limit}", "solver=ilp")
    assert exact["status"] == "Optimal"
    # the step-time search under the same limit: every candidate it may return fits,
    # the one returned is no slower than the additive plan of the same cuts
    timed, sol = _record(tmp, f"constraints.device_memory={limit}",
                         "solver.objective=step_time")
    assert timed["memory"]["fits"] is True and max(sol["live_bytes"]) <= limit
    search = timed["step_time_search"]
    assert search["candidates"][0]["additive_us"] == approx["objective"]
    assert search["candidates"][0]["step_time_us"] == approx["step_time_us"]
    assert timed["step_time_us"] == min(c["step_time_us"] for c in search["candidates"]
                                        if c["fits"])
    assert timed["step_time_us"] <= approx["step_time_us"]
    # Both solved with the same cuts, so TRW-S's bound holds for the ILP's problem.
    assert approx["memory"]["cuts"] == exact["memory"]["cuts"]
    assert approx["lower_bound"] <= exact["objective"] + 1e-6
    assert exact["objective"] <= approx["objective"] + 1e-6


@pytest.mark.toy_runs(FREE)
def test_unreachable_limit_is_one_line(runs: tuple[Path, int]) -> None:
    tmp, _ = runs
    proc = _run(tmp, "constraints.device_memory=64MiB")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("constraints.device_memory=64MiB: infeasible, the smallest "
                           "memory any plan reaches is ")
    assert "> 64.00 MiB" in line


@pytest.mark.parametrize(("override", "message"), [
    ("constraints.device_memory=-1", "constraints.device_memory=-1: must be at least 1 byte"),
    ("constraints.device_memory=80GB?", "constraints.device_memory=80GB?: allowed a positive"),
    ("constraints.device_memory=0", "constraints.device_memory=0: must be at least 1 byte"),
    ("optimizer=lion", "optimizer=lion: allowed adamw, none, sgd"),
    ("optimizer.name=lion", "optimizer.name=lion: allowed adamw, sgd, none"),
    ("memory.activation_checkpointing=some",
     "memory.activation_checkpointing=some: allowed none, full, selective, "
     "selective_all_matmuls"),
])
def test_bad_memory_values(tmp_path: Path, override: str, message: str) -> None:
    proc = _run(tmp_path, override)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert not (tmp_path / "runs").exists()
