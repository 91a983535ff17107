"""The fit check (issue 27, item 6): every run compares its predicted peak per device
with the hardware preset's device memory (pipeline/memory/fit.py): ``fits`` in run.json
and runs.parquet, a warning line in the solve log, a memory column and the fit in the
shapes and recipe tables; ``constraints.device_memory=auto`` takes the preset's memory
as the limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures import child_env

from pipeline.memory.fit import fit_fields, fit_warning

GIB = 2**30
MIB = 2**20


def test_fit_fields_and_warning_by_hand():
    # the case: Llama-3 8B, 64 GPUs, 2 x 8192 tokens, no checkpointing, 117 GiB
    # per device on the 80 GiB H100 preset
    memory = {"peak_bytes": 117 * GIB, "peak_node": "mm_9", "peak_phase": "bwd"}
    assert fit_fields(memory, 80 * GIB) == {
        "device_memory_bytes": 80 * GIB, "fits": False, "headroom_bytes": -37.0 * GIB}
    assert fit_warning(memory, 80 * GIB, "h100", limit_given=False) == (
        "the plan does not fit: predicted peak 117.00 GiB per device (at mm_9, bwd) > 80.00 "
        "GiB of device memory (hardware=h100 device_memory_bytes=85899345920); "
        "constraints.device_memory=auto plans within it; or memory.activation_checkpointing, "
        "a larger mesh, a smaller batch")
    # exactly full fits; one byte over does not
    assert fit_fields({"peak_bytes": 80 * GIB}, 80 * GIB)["fits"] is True
    assert fit_fields({"peak_bytes": 80 * GIB + 1}, 80 * GIB)["fits"] is False
    assert fit_warning({"peak_bytes": 80 * GIB}, 80 * GIB, "h100", False) is None
    assert fit_fields(None, 80 * GIB) == {} and fit_fields({}, 80 * GIB) == {}
    # with the allocator reserve (memory.reserve_fraction=0.25): 70 GiB live reserve
    # 87.5 GiB, which does not fit 80 GiB; the line names the reserved bytes
    reserved = {"peak_bytes": 70 * GIB, "reserved_bytes": 87.5 * GIB, "peak_node": "mm_1",
                "peak_phase": "fwd"}
    assert fit_fields(reserved, 80 * GIB)["headroom_bytes"] == -7.5 * GIB
    assert fit_warning(reserved, 80 * GIB, "h100", True).startswith(
        "the plan does not fit: predicted reserved 87.50 GiB per device (at mm_1, fwd)")


def _run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "model=toy", *overrides,
                           f"results_dir={tmp_path / 'results'}"], cwd=tmp_path,
                          capture_output=True, text=True, env=child_env("1"), timeout=900)


def _records(results: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(results.rglob("run.json"))]


def test_a_plan_that_does_not_fit_says_so_in_the_record_the_log_and_the_report(tmp_path):
    """The toy on 2 devices peaks at about 558 MiB per device: on a preset of 300 MiB
    it plans (no limit is set) and says it does not fit; on 8 devices it fits. What is
    compared is the reserved memory, (1 + memory.reserve_fraction) x the peak."""
    hw = f"hardware.device_memory_bytes={300 * MIB}"
    proc = _run(tmp_path, "mesh=2", hw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = _records(tmp_path / "results")
    live = rec["memory"]["peak_bytes"]
    peak = rec["memory"]["reserved_bytes"]
    assert peak == (1 + rec["memory"]["reserve_fraction"]) * live > 300 * MIB
    assert rec["fits"] is False and rec["device_memory_bytes"] == 300 * MIB
    assert rec["headroom_bytes"] == 300 * MIB - peak
    warnings = [ln for ln in proc.stderr.splitlines() if " WARNING: solve: " in ln]
    assert len(warnings) == 1 and (
        f"the plan does not fit: predicted reserved {peak / MIB:.2f} MiB per device" in warnings[0]
        and "> 300.00 MiB of device memory (hardware=h100 device_memory_bytes=314572800); "
        "constraints.device_memory=auto plans within it" in warnings[0]), warnings
    proc = _run(tmp_path, "mesh=8", hw)
    assert proc.returncode == 0 and "does not fit" not in proc.stderr, proc.stderr[-3000:]
    runs = pq.read_table(tmp_path / "results" / "report" / "runs.parquet").to_pylist()
    by_mesh = {r["mesh"]: r for r in runs}
    assert by_mesh["2"]["fits"] is False and by_mesh["8"]["fits"] is True
    assert by_mesh["8"]["memory.reserved_bytes"] <= 300 * MIB == by_mesh["8"][
        "device_memory_bytes"]


def test_device_memory_auto_is_the_presets_memory(tmp_path):
    hw = f"hardware.device_memory_bytes={300 * MIB}"
    proc = _run(tmp_path, "mesh=8", hw, "constraints.device_memory=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = _records(tmp_path / "results")
    assert rec["memory"]["limit_bytes"] == 300 * MIB and rec["memory"]["fits"] is True
    assert rec["fits"] is True
    # no plan of 2 devices fits 300 MiB: the one line names the limit as given
    proc = _run(tmp_path, "mesh=2", hw, "constraints.device_memory=auto")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "constraints.device_memory=auto (h100 device_memory_bytes): infeasible")
    proc = _run(tmp_path, "mesh=2", "constraints.device_memory=automatic")
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        "or auto (the hardware preset's device_memory_bytes)"), proc.stderr[-3000:]


def test_the_shapes_table_has_the_peak_and_the_fit(tmp_path):
    from pipeline.tools import shapes

    dirs = []
    for mesh, peak, fits in (("8", 50 * GIB, True), ("2x4", 90 * GIB, False)):
        d = tmp_path / mesh
        d.mkdir()
        (d / "run.json").write_text(json.dumps({
            "mesh": mesh, "mesh_names": ["dp"] if mesh == "8" else ["dp", "tp"],
            "objective": 10.0 if mesh == "8" else 20.0, "status": "Optimal", "gap": 0.0,
            "run_id": mesh, "placement_hash": "h", "memory": {"peak_bytes": peak},
            "fits": fits}))
        dirs.append(d)
    table = shapes.shape_table(dirs)
    assert list(table["peak_bytes"]) == [50.0 * GIB, 90.0 * GIB]
    assert list(table["fits"]) == [True, False]
    md = shapes.markdown_table(table)
    assert "| peak_bytes | fits |" in md and "| 90.00 GiB | False |" in md


def test_the_recipe_table_has_each_runs_peak_and_fit():
    from pipeline.stages.report.stage import _recipe_table, recipe_rows

    common = {"model": "toy", "mesh": "8", "mesh_names": ["dp"], "hardware": "h100",
              "config": {}}
    planner = {**common, "run_id": "p", "memory": {"peak_bytes": 1.5 * GIB}, "fits": True}
    recipe = {**common, "run_id": "r", "recipe": "fsdp", "memory": {"peak_bytes": 99 * GIB},
              "fits": False}
    rows = recipe_rows([planner, recipe])
    assert len(rows) == 1
    row = _recipe_table(rows).to_pylist()[0]
    assert (row["recipe_peak_bytes"], row["planner_peak_bytes"]) == (99.0 * GIB, 1.5 * GIB)
    assert (row["recipe_fits"], row["planner_fits"]) == (False, True)


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto "])
def test_auto_reads_the_preset(value):
    from omegaconf import OmegaConf

    from pipeline.memory.options import device_memory_of_config

    cfg = OmegaConf.create({"constraints": {"device_memory": value},
                            "hardware": {"name": "h200", "device_memory_bytes": 141 * 10**9}})
    assert device_memory_of_config(cfg) == (141 * 10**9, "auto (h200 device_memory_bytes)")
