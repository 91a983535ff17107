"""``python -m pipeline.calibrate``: a ``--quick`` calibration end to end, bad input refused
in one line with nothing written, an nccl-tests table imported, and a toy run priced
with a profile's tables (``hardware=test_tables``, conf/hardware/test_tables.yaml),
checked by hand."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.costmodel.comm import GroupLayout, group_collective_us
from pipeline.costmodel.hardware import load_hardware, tables_of

ROOT = Path(__file__).resolve().parents[2]
TEST_PROFILE = ROOT / "conf" / "hardware" / "test_tables.yaml"
TOY_RUN = ("mesh=2", "recipe=ddp", "hardware=test_tables")
TOY_BASE = ("mesh=2", "recipe=ddp", "hardware=test_tables", "hardware.tables=null")


def _calibrate(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    return subprocess.run([sys.executable, "-m", "pipeline.calibrate", *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_quick_calibration_end_to_end(tmp_path):
    t0 = time.perf_counter()
    proc = _calibrate("--quick", "--name", "ci", "--out", str(tmp_path), cwd=tmp_path)
    took = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    hw = load_hardware(str(tmp_path / "ci.yaml"))
    t = hw.tables
    assert set(t["measured"]) == {"matmul", "attention", "memory", "launch_us", "collectives"}
    assert t["torch"] and t["date"] and t["device"].startswith("cpu")
    # the peak is the best measured matmul rate: every efficiency <= 1, the best == 1
    # (to the 4 significant digits written)
    effs = [r["efficiency"] for r in t["matmul"]]
    assert max(effs) == pytest.approx(1.0, rel=1e-3) and all(0 < e <= 1 for e in effs)
    assert {r["pass"] for r in t["matmul"]} == {"fwd", "bwd"}
    assert {r["causal"] for r in t["attention"]} == {True, False}
    # nccl-tests relations: algbw = size / time; busbw = algbw (n-1)/n (all_reduce 2(n-1)/n)
    kinds = {c["kind"] for c in t["collectives"]}
    assert kinds == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
    for c in t["collectives"]:
        assert (c["per_node"], c["nodes"], c["backend"]) == (2, 1, "gloo")
        for r in c["rows"]:
            assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3, rel=2e-3)
            f = 1.0 if c["kind"] == "all_reduce" else 0.5
            assert r["busbw"] == pytest.approx(r["algbw"] * f, rel=2e-3)
    # the scalar keys derived from the tables (pipeline/tools/calibrate/run.py)
    assert hw.kernel_floor_us == pytest.approx(t["launch_us"], rel=1e-3)
    assert hw.overlap is False  # CPU / gloo: a collective blocks the computing thread
    assert hw.hbm_bandwidth == pytest.approx(max(r["bandwidth"] for r in t["memory"]) * 1e9,
                                             rel=1e-3)
    # a shared 2-core machine: measured 37-65 s at load averages of 15-36
    assert took < 180, f"--quick took {took:.0f} s"


@pytest.mark.parametrize(("args", "message"), [
    (("--ranks", "64"), "error: --ranks=64: this machine holds at most"),
    (("--backend", "mpi"), "error: --backend='mpi': allowed auto, gloo, nccl"),
    (("--ranks", "1"), "error: --ranks='1': allowed a comma-separated list of integers >= 2"),
    (("--name", "a/b"), "error: --name='a/b': allowed letters"),
])
def test_bad_calibrate_input_is_one_line_and_writes_nothing(args, message, tmp_path):
    out = tmp_path / "out"
    proc = _calibrate("--quick", "--out", str(out), *args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and len(proc.stderr.splitlines()) == 1
    assert not out.exists()


#: An nccl-tests all_gather_perf output (format of nccl-tests src/common.cu; numbers made
#: up and consistent: algbw = size / time, busbw = algbw x 15/16 for 16 ranks).
NCCL_OUT = (ROOT / "tests" / "support" / "nccl_tests_all_gather.txt").read_text()


def test_import_nccl_tests_table(tmp_path):
    profile = tmp_path / "p.yaml"
    shutil.copy(TEST_PROFILE, profile)
    (tmp_path / "ag.txt").write_text(NCCL_OUT)
    proc = _calibrate("import-nccl-tests", "ag.txt", "--profile", str(profile), "--kind",
                      "all_gather", "--per-node", "8", "--nodes", "2", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    hw = load_hardware(str(profile))
    table = [c for c in hw.tables["collectives"] if (c["per_node"], c["nodes"]) == (8, 2)]
    assert len(table) == 1 and table[0]["backend"] == "nccl"
    assert [r["size"] for r in table[0]["rows"]] == [1024, 1048576, 4194304]
    assert [r["time_us"] for r in table[0]["rows"]] == [32.0, 100.0, 200.0]
    # the cost model gives back the measured time: 15/16 x 1 MiB / 9.83 GB/s = 100.0 µs
    layout = GroupLayout(16, 8, 2)
    assert group_collective_us("all_gather", 1048576, layout, hw) == pytest.approx(
        15 / 16 * 1048576 / 9.83e9 * 1e6)
    assert group_collective_us("all_gather", 1048576, layout, hw) == pytest.approx(100, rel=1e-3)
    # 2 MiB, half way in log2: busbw (9.83 + 19.66) / 2 = 14.745 GB/s
    assert group_collective_us("all_gather", 2 * 1048576, layout, hw) == pytest.approx(
        15 / 16 * 2 * 1048576 / 14.745e9 * 1e6)


@pytest.mark.parametrize(("edit", "text", "message"), [
    (None, NCCL_OUT.replace("     4194304 ", "         512 "),
     "hardware.tables.collectives[4] (all_gather): sizes 1048576 then 512 are not strictly"),
    (("efficiency: 0.35", "efficiency: -0.35"), NCCL_OUT,
     "hardware.tables.matmul[0].efficiency=-0.35 is invalid: must be a number > 0"),
    (("time_us: 1.0, efficiency", "efficiency"), NCCL_OUT,
     "hardware.tables.matmul[0].time_us is missing"),
])
def test_bad_import_is_one_line_and_leaves_the_profile(edit, text, message, tmp_path):
    profile = tmp_path / "p.yaml"
    src = TEST_PROFILE.read_text()
    if edit is not None:
        src = src.replace(*edit)
    profile.write_text(src)
    (tmp_path / "ag.txt").write_text(text)
    proc = _calibrate("import-nccl-tests", "ag.txt", "--profile", str(profile), "--kind",
                      "all_gather", "--per-node", "8", "--nodes", "2", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr
    assert profile.read_text() == src


@pytest.mark.toy_runs(TOY_RUN, TOY_BASE)
def test_toy_run_reads_the_tables_by_hand(toy_results):
    """conf/hardware/test_tables.yaml: no kernel floor, a 1e15 B/s memory, every matmul and
    attention efficiency 0.35 where the constant is 0.7, every 2-rank all-reduce at 1 GB/s
    bus bandwidth. Compute: every node's time under the tables is twice its time under
    the constants (the same profile with ``tables=null``); comm: a 2-rank all-reduce of
    ``S`` bytes takes ``2 (1/2) S / 1 GB/s = S`` ns."""
    from pipeline.costmodel.model import CostModel
    from pipeline.stages.topology.artifacts import read_topology

    run = toy_results.run(*TOY_RUN)
    rec = run.record
    # comm: the plan's all-reduces (ddp: the gradients), S ns each
    colls = rec["collectives"]
    assert set(colls) == {"all_reduce(dp)"}
    # ... less each bucket member's share of the table's latency floor, at most the time
    # of its smallest row (1 B at 1 GB/s: 0.001 µs) per collective
    ar = colls["all_reduce(dp)"]
    assert 0 <= ar["bytes"] / 1e3 - ar["us"] <= ar["count"] * 0.001 + 1e-9
    assert rec["comm_us"] == pytest.approx(colls["all_reduce(dp)"]["us"], rel=1e-9)
    lookups = rec["hardware_tables"]["lookups"]
    assert lookups["matmul"]["lookups"] > 0 and lookups["collectives"]["lookups"] > 0
    assert rec["hardware_tables"]["device"] == "none: a hand-written test profile"
    # compute: the same topology priced with and without the tables
    base = toy_results.run(*TOY_BASE)
    assert "hardware_tables" not in base.record
    topo = read_topology(Path(run.dirs.topology))
    with_tables = CostModel(topo, load_hardware(str(TEST_PROFILE)), memoise=False)
    plain_hw = load_hardware(str(TEST_PROFILE))
    plain_hw.tables = None
    plain = CostModel(topo, plain_hw, memoise=False)
    targets = topo.nodes["target"]
    doubled = 0
    def compute(cm: CostModel, v: int) -> np.ndarray:  # the unary less in-op collectives
        comm = cm.op_comm(v)
        return cm.unary(v) - (0.0 if comm is None else comm)

    for v in range(len(targets)):
        a, b = compute(with_tables, v), compute(plain, v)
        # a compute-bound strategy takes twice as long, a memory-bound one as long: a
        # matmul (or attention) is compute-bound at 1e15 B/s, a pointwise op (~1 FLOP per
        # 8-12 bytes) memory-bound even at half the FLOP/s
        big = np.isclose(a, 2 * b, rtol=1e-12) & (b > 0)
        assert np.allclose(a[~big], b[~big], rtol=1e-12), targets[v]
        if any(op in targets[v] for op in ("aten.mm", "aten.addmm", "aten.bmm")):
            assert big.all(), targets[v]
        doubled += int(big.any())
    assert doubled > 0
    # the plan's compute: twice its compute under the constants, node by node
    chosen = [r["strategy"] for r in run.plan]
    parts = [float(compute(plain, v)[k]) for v, k in enumerate(chosen)]
    doubles = [bool(np.isclose(compute(with_tables, v)[k], 2 * compute(plain, v)[k],
                               rtol=1e-12)) for v, k in enumerate(chosen)]
    expected = sum(2 * b if d else b for b, d in zip(parts, doubles))
    assert rec["compute_us"] == pytest.approx(expected, rel=1e-9)
    assert expected > 1.9 * sum(parts)  # the matmuls and attention are nearly all of it
    assert tables_of(with_tables.hw).counts["matmul"][0] > 0
