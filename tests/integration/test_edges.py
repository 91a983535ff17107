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
