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


# --------------------------------------------------------------------------- transformers


HF_REFUSED = [
    # GPT-2's attention refuses a head count that does not divide the width
    (("model=hf/gpt2", "model.config.n_head=5", "model.config.n_layer=1"),
     "model.config.n_embd=768, model.config.n_head=5: transformers refused to build "
     "GPT2LMHeadModel: `embed_dim` must be divisible by num_heads"),
    # Llama's config validator (wrapped by huggingface_hub: its innermost message is shown)
    (("model=hf", "model.model_type=llama", "model.config.num_attention_heads=5",
      "model.config.num_hidden_layers=1"),
     "model.config.hidden_size=4096 (default), model.config.num_attention_heads=5: "
     "transformers refused to build LlamaConfig: The hidden size (4096) is not a multiple of "
     "the number of attention heads (5)."),
    # Phi-3's default pad_token_id (32000) beyond a vocabulary of 64
    (("model=hf", "model.model_type=phi3", "model.config.vocab_size=64",
      "model.config.hidden_size=32", "model.config.num_attention_heads=4",
      "model.config.num_hidden_layers=1", "model.config.intermediate_size=64"),
     "model.config.pad_token_id=32000 (default), model.config.vocab_size=64: transformers "
     "refused to build Phi3ForCausalLM: Padding_idx must be within num_embeddings"),
]


@pytest.mark.parametrize(("overrides", "expect"), HF_REFUSED)
def test_a_config_transformers_refuses_is_one_line_naming_the_keys(tmp_path, overrides, expect):
    pytest.importorskip("transformers")
    results = tmp_path / "r"
    proc = run_py(tmp_path, "-m", "pipeline", *overrides, "mesh=2", f"results_dir={results}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_line(proc) == expect or one_line(proc).startswith(expect)
    assert not results.exists()


def test_refusal_names_every_given_key_when_the_message_names_none():
    from pipeline.models.hf import refusal

    class Config:
        attribute_map = {"hidden_size": "n_embd"}
        n_embd = 8

    msg = refusal(RuntimeError("boom"), {"b": 2, "a": 1}, Config, Config(), "X")
    assert msg == "model.config.a=1, model.config.b=2: transformers refused to build X: boom"
    err = ValueError("outer")
    err.__cause__ = ValueError("the hidden size (8) is odd\nsecond line")
    msg = refusal(err, {}, Config, Config(), "X")
    assert msg == ("model.config.n_embd=8 (default): transformers refused to build X: the "
                   "hidden size (8) is odd")


# --------------------------------------------------------------------------- OS errors


TINY = ("model=toy", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2",
        "model.multiple_of=32", "model.vocab_size=64", "model.seq_len=16",
        "model.batch_size=8", "mesh=2x2")


def _file_size_limit(limit: int):
    """A ``preexec_fn``: files may grow to ``limit`` bytes; a write beyond fails with
    EFBIG (``RLIMIT_FSIZE``, setrlimit(2); SIGXFSZ ignored so the write returns the
    error instead of killing the process): a real OS error on a real write, as a full
    disk gives ENOSPC."""
    import resource
    import signal

    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_files


def test_an_os_error_while_the_report_writes_leaves_the_old_report_whole(tmp_path):
    import pyarrow.parquet as pq

    results = tmp_path / "results"
    first = run_py(tmp_path, "-m", "pipeline", *TINY, f"results_dir={results}")
    assert first.returncode == 0, first.stderr[-3000:]
    report = results / "report"
    # an older report: a placements table of 10 rows (the new one has every row)
    old = pq.read_table(report / "placements.parquet")
    assert old.num_rows > 10
    pq.write_table(old.slice(0, 10), report / "placements.parquet")
    before = {p.name: p.read_bytes() for p in report.iterdir() if p.suffix == ".parquet"}
    assert before["runs.parquet"].__len__() > 20_000 > len(before["placements.parquet"])
    # every stage and picture is current: the report runs, its runs.parquet (the last
    # table, over 20 kB) cannot be written
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", *TINY, f"results_dir={results}"], cwd=tmp_path,
        capture_output=True, text=True, env=child_env("1"), timeout=600,
        preexec_fn=_file_size_limit(20_000))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line(proc)
    assert line.startswith(f"{report}/runs.parquet: cannot write it: ") and (
        "(errno 27 EFBIG)" in line), line
    after = {p.name: p.read_bytes() for p in report.iterdir() if p.suffix == ".parquet"}
    assert after == before, "the old report tables must stay, all of them"
    assert not [p for p in results.rglob("*.tmp")], "no temporary file may stay"


def test_a_stage_that_cannot_write_its_artifact_is_one_line_and_reruns_after(tmp_path):
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", *TINY, f"results_dir={results}"], cwd=tmp_path,
        capture_output=True, text=True, env=child_env("1"), timeout=600,
        preexec_fn=_file_size_limit(4_000))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line(proc)
    assert "/graph.parquet: cannot write it: " in line and "(errno 27 EFBIG)" in line, line
    assert not list(results.rglob("graph.parquet")) and not list(results.rglob("*.tmp"))
    again = run_py(tmp_path, "-m", "pipeline", *TINY, f"results_dir={results}")
    assert again.returncode == 0, again.stderr[-3000:]


def test_atomic_group_keeps_the_old_files_on_enospc(tmp_path, monkeypatch):
    import errno

    from pipeline.core import runtime
    from pipeline.core.errors import WriteError

    (tmp_path / "a.json").write_text("old a")
    (tmp_path / "b.json").write_text("old b")
    with pytest.raises(WriteError) as err, runtime.atomic_group() as group:
        runtime.write_json(tmp_path / "a.json", {"new": 1}, group=group)
        with runtime.atomic_path(tmp_path / "b.json", group) as tmp:
            tmp.write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(err.value) == (f"{tmp_path / 'b.json'}: cannot write it: No space left on "
                              "device (errno 28 ENOSPC); nothing half-written was kept (free "
                              "space or fix the permissions, then rerun)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]
    assert (tmp_path / "a.json").read_text() == "old a"
    with runtime.atomic_group() as group:
        runtime.write_json(tmp_path / "a.json", {"new": 1}, group=group)
        assert (tmp_path / "a.json").read_text() == "old a"  # renamed at the group's end
    assert (tmp_path / "a.json").read_text() == '{\n  "new": 1\n}\n'


# --------------------------------------------------------------------------- signals


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc/<id>/stat, Linux)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we read
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.fixture(scope="module")
def verify_results(tmp_path_factory):
    """A tiny toy solved at 2x2: verify reuses every stage and starts its 4 workers."""
    results = tmp_path_factory.mktemp("verify-signals") / "results"
    proc = run_py(results.parent, "-m", "pipeline", *TINY, f"results_dir={results}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("sig", "to_group"), [
    ("SIGINT", False),   # kill -INT <parent>: before, the workers went on for 35 s
    ("SIGTERM", False),
    ("SIGINT", True),    # Ctrl-C in a terminal: the whole process group
])
def test_a_signal_during_verify_stops_the_workers_within_seconds(verify_results, sig,
                                                                 to_group):
    import signal
    import time

    signum = getattr(signal, sig)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.verify", *TINY, f"results_dir={verify_results}"],
        cwd=verify_results.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=child_env("1"), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        workers: list[int] = []
        while len(workers) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            workers = _children(proc.pid)
        assert len(workers) >= 4, "verify never started its 4 workers"
        sent = time.monotonic()
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signum, err[-3000:]
    assert took < 15, f"verify took {took:.1f} s to end after {sig}"
    assert [w for w in workers if Path(f"/proc/{w}").exists()] == [], "workers left running"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"verify: interrupted by {sig}; worker processes stopped, verify.json not written")
    assert not list(verify_results.rglob("verify.json"))


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_during_python_m_pipeline_is_one_line_and_the_run_goes_on_after(tmp_path, sig):
    """A signal while the trace stage runs (the toy's trace takes seconds): one line,
    exit 128 + the signal's number, no traceback, nothing of the trace stage kept; the
    same command then plans from scratch."""
    import signal
    import time

    signum = getattr(signal, sig)
    results = tmp_path / "results"
    argv = [sys.executable, "-m", "pipeline", "model=toy", "mesh=2", f"results_dir={results}"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env("1"))
    try:
        deadline = time.monotonic() + 120
        while not list(results.glob("runs/*")) and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before the signal"
        time.sleep(1.0)  # inside the trace (its directory exists from its start)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    # the line, among the log's INFO lines (torch may log its fake-tensor cache at exit)
    assert (f"python -m pipeline: interrupted by {sig}; the finished stages are kept, the "
            "interrupted stage left nothing behind; the same command goes on from there"
            ) in err.strip().splitlines(), err[-3000:]
    assert not list(results.rglob("graph.parquet")) and not list(results.rglob("*.tmp*"))
    again = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                           env=child_env("1"), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(list(results.glob("runs/*/*/*/*/*/run.json"))) == 1
