"""One line at every edge (issue 27, item 5): ``PIPELINE_*`` environment variables,
hardware values outside their physical range, configurations transformers rejects,
OS errors while a stage writes, and signals during verify.

Each case runs the real entry point (``python -m pipeline`` or ``pipeline.verify``) in a
child process and checks: the exit status, stderr ending in the one expected line with
no traceback, and nothing written where nothing should be.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import child_env

from pipeline.config import ConfigError, check_environment, log_level

TOY = ("model=toy", "mesh=2x2")


def run_py(cwd: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env={**child_env("1"), **(env or {})}, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The last stderr line, after checking that no traceback came before it."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines, proc
    return lines[-1]


# --------------------------------------------------------------------------- environment


@pytest.mark.parametrize(("name", "value", "expect"), [
    ("PIPELINE_LOG_LEVEL", "bogus", "PIPELINE_LOG_LEVEL=bogus: allowed DEBUG, INFO, WARNING, "
                                    "ERROR, CRITICAL (any case), or unset for INFO"),
    ("PIPELINE_PROGRESS", "maybe", "PIPELINE_PROGRESS=maybe: allowed 1, true, yes, on"),
    ("PIPELINE_ERROR_FD", "x", "PIPELINE_ERROR_FD=x: allowed a non-negative integer"),
    ("PIPELINE_ERROR_FD", "987", "PIPELINE_ERROR_FD=987: not an open file descriptor"),
    ("PIPELINE_SWEEP_OUTCOMES", "rel/dir", "PIPELINE_SWEEP_OUTCOMES=rel/dir: allowed an "
                                           "absolute path"),
])
def test_a_bad_environment_variable_is_one_line_exit_2_nothing_written(tmp_path, name, value,
                                                                       expect):
    results = tmp_path / "results"
    proc = run_py(tmp_path, "-m", "pipeline", *TOY, f"results_dir={results}",
                  env={name: value})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_line(proc).startswith(expect)
    assert len(proc.stderr.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []


def test_verify_refuses_a_bad_log_level_in_one_line(tmp_path):
    proc = run_py(tmp_path, "-m", "pipeline.verify", *TOY, f"results_dir={tmp_path / 'r'}",
                  env={"PIPELINE_LOG_LEVEL": "loud"})
    assert proc.returncode == 2 and one_line(proc).startswith("PIPELINE_LOG_LEVEL=loud:")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("env", "ok"), [
    ({}, True), ({"PIPELINE_LOG_LEVEL": "debug"}, True),
    ({"PIPELINE_LOG_LEVEL": " Warning "}, True),
    ({"PIPELINE_PROGRESS": "AUTO"}, True), ({"PIPELINE_PROGRESS": ""}, True),
    ({"PIPELINE_PROGRESS": "Off"}, True), ({"PIPELINE_PROGRESS": "2"}, False),
    ({"PIPELINE_LOG_LEVEL": "NOTSET"}, False), ({"PIPELINE_LOG_LEVEL": "10"}, False),
    ({"PIPELINE_ERROR_FD": "2"}, True), ({"PIPELINE_ERROR_FD": "-1"}, False),
    ({"PIPELINE_SWEEP_OUTCOMES": ""}, False), ({"PIPELINE_TEST_ANYTHING": "?"}, True),
])
def test_check_environment_by_hand(env, ok):
    if ok:
        check_environment(env)
    else:
        with pytest.raises(ConfigError) as err:
            check_environment(env)
        assert str(err.value).startswith(next(iter(env))) and "\n" not in str(err.value)


def test_log_level_defaults_to_info_and_reads_any_case():
    assert log_level({}) == "INFO" and log_level({"PIPELINE_LOG_LEVEL": "error"}) == "ERROR"


# --------------------------------------------------------------------------- hardware


@pytest.mark.parametrize(("override", "expect"), [
    # the issue's absurd but finite values: numpy overflow warnings and a solver message
    # blaming an edge before; now the key, its value and its range
    ("hardware.intra_node.bandwidth=1e-300", "hardware.intra_node.bandwidth=1e-300 is "
     "invalid: allowed the physical range [1e+06, 1e+15] bytes/s"),
    ("hardware.peak_flops_bf16=1e-300", "hardware.peak_flops_bf16=1e-300 is invalid: "
     "allowed the physical range [1e+06, 1e+18] FLOP/s"),
    ("hardware.inter_node.latency_us=1e308", "hardware.inter_node.latency_us=1e+308 is "
     "invalid: allowed the physical range [0, 1e+06] µs"),
    ("hardware.intra_node.bandwidth=-5e10", "hardware.intra_node.bandwidth=-50000000000.0 "
     "is invalid: must be a number > 0"),
    ("hardware.compute_efficiency=1.5", "hardware.compute_efficiency=1.5 is invalid: must "
     "be in (0, 1]"),
    ("hardware.memory_efficiency=0", "hardware.memory_efficiency=0.0 is invalid: must be in "
     "(0, 1]"),
    ("hardware.gpus_per_node=100000", "hardware.gpus_per_node=100000 is invalid: allowed the "
     "physical range [1, 4096] GPUs"),
])
def test_hardware_outside_its_physical_range_is_one_line_exit_2(tmp_path, override, expect):
    proc = run_py(tmp_path, "-m", "pipeline", *TOY, f"results_dir={tmp_path / 'r'}", override)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_line(proc).startswith(expect)
    assert "overflow" not in proc.stderr and not (tmp_path / "r").exists()


def test_physical_ranges_by_hand_and_every_preset_within_them():
    from pipeline.config import CONF_DIR
    from pipeline.costmodel.hardware import (
        PHYSICAL_RANGES,
        HardwareConfig,
        LinkConfig,
        check_physical_ranges,
        load_hardware,
    )

    presets = sorted((CONF_DIR / "hardware").glob("*.yaml"))
    assert len(presets) >= 4
    for path in presets:
        check_physical_ranges(load_hardware(path))
    # both ends are allowed, a step beyond is not
    HardwareConfig(hbm_bandwidth=1e6, intra_node=LinkConfig(bandwidth=1e15, latency_us=1e6))
    with pytest.raises(ValueError, match=r"hbm_bandwidth=999999\.0 is invalid"):
        HardwareConfig(hbm_bandwidth=999999.0)
    with pytest.raises(ValueError, match=r"inter_node\.latency_us=1000000\.5 is invalid"):
        HardwareConfig(inter_node=LinkConfig(latency_us=1e6 + 0.5))
    assert set(PHYSICAL_RANGES) >= {"peak_flops_bf16", "peak_flops_fp32", "hbm_bandwidth",
                                    "intra_node.bandwidth", "inter_node.latency_us"}
