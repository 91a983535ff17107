"""Nothing half-trusted: bad numbers and impossible input sharding refused before the
trace, strict JSON records, artifacts verified against their stamps before reuse, the
report skipping untrusted run records, one-line errors that reach the Snakemake user,
interrupted solvers cleaned up, read-only results trees.

Each test fails on the code before these checks existed (see the commit history).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures import ROOT, SNAKEFILE, SUPPORT, child_env

from pipeline.config import STAGES, ConfigError, load_resolved, stage_dirs
from pipeline.core import artifacts
from pipeline.stages import runner as cli

STRICT = {"parse_constant": lambda c: (_ for _ in ()).throw(ValueError(f"non-strict {c}"))}


def strict_loads(text: str):
    """``json.loads`` refusing ``Infinity``, ``-Infinity`` and ``NaN`` (strict JSON)."""
    return json.loads(text, **STRICT)


def run_py(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env=child_env("1"), timeout=timeout)


# --------------------------------------------------------------------------- config


FINITE = "allowed a finite number (inf, -inf and nan are refused)"


@pytest.mark.parametrize("override", [
    "hardware.peak_flops_bf16=inf", "hardware.intra_node.bandwidth=inf",
    "hardware.inter_node.latency_us=inf", "solver.tol=inf",
    "solver.time_limit_s=inf", "hardware.hbm_bandwidth=inf"])
def test_an_infinite_number_is_refused_naming_the_key(override):
    with pytest.raises(ConfigError) as err:
        load_resolved(["model=toy", override])
    assert str(err.value) == f"{override}: {FINITE}"


@pytest.mark.parametrize("override", ["hardware.peak_flops_bf16=nan",
                                      "hardware.peak_flops_bf16=-inf", "solver.tol=nan",
                                      "constraints.param_memory.low=nan"])
def test_nan_and_minus_inf_stay_refused(override):
    with pytest.raises(ConfigError) as err:
        load_resolved(["model=toy", override])
    assert str(err.value).startswith(override)


def test_check_finite_walks_nested_lists_and_names_the_index():
    from pipeline.config.validate import check_finite

    check_finite({"a": [1.0, {"b": 2}], "c": "inf", "d": None})  # finite, text: fine
    with pytest.raises(ConfigError, match=r"^a\.1\.b=-inf: allowed a finite number"):
        check_finite({"a": [1.0, {"b": float("-inf")}]})


def test_inf_on_the_command_line_is_one_line_exit_2_nothing_written(tmp_path):
    proc = run_py(tmp_path, "-m", "pipeline", "model=toy", "mesh=8",
                  "hardware.peak_flops_bf16=inf")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"hardware.peak_flops_bf16=inf: {FINITE}"
    assert list(tmp_path.iterdir()) == []


BATCH_DEFAULT = ("model.batch_size=2: the inputs are sharded on mesh dims dp (8) "
                 "(constraints.inputs=S(0) on the first mesh dim (the default)), 8 shards; "
                 "allowed model.batch_size >= 8, or constraints.inputs sharding that dim "
                 "on fewer mesh dims (e.g. R on each)")


def test_batch_smaller_than_its_shard_count_is_refused_before_the_trace(tmp_path):
    """The issue's case: ``model.batch_size=2 mesh=8`` was refused after the trace,
    blaming ``constraints.inputs`` on node primals_24."""
    proc = run_py(tmp_path, "-m", "pipeline", "model=toy", "mesh=8", "model.batch_size=2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == BATCH_DEFAULT
    assert list(tmp_path.iterdir()) == []  # no trace was written


@pytest.mark.parametrize("mesh,inputs,override,key,shards,on", [
    # S(0) on dp and cp: 2 * 4 = 8 shards of the batch
    ("2x4x8", "S(0)S(0)R", "model.batch_size=4", "model.batch_size", 8, "dp (2), cp (4)"),
    # S(1) on tp: the sequence dim in 8 shards
    ("2x4x8", "S(0)RS(1)", "model.seq_len=4", "model.seq_len", 8, "tp (8)"),
    ("2x4", "RS(-1)", "model.seq_len=2", "model.seq_len", 4, "tp (4)"),
])
def test_each_sharded_input_dim_needs_its_shard_count(mesh, inputs, override, key, shards,
                                                      on):
    with pytest.raises(ConfigError) as err:
        cli.preflight_trace(load_resolved(["model=toy", f"mesh={mesh}",
                                           f"constraints.inputs={inputs}", override]))
    value = override.split("=")[1]
    assert str(err.value) == (
        f"{key}={value}: the inputs are sharded on mesh dims {on} (constraints.inputs="
        f"{inputs}), {shards} shards; allowed {key} >= {shards}, or constraints.inputs "
        "sharding that dim on fewer mesh dims (e.g. R on each)")


def test_a_batch_equal_to_its_shard_count_and_a_replicated_input_resolve():
    from pipeline.config.validate import check_input_sharding

    for overrides in (["model.batch_size=8"], ["model.batch_size=2", "constraints.inputs=R"]):
        cfg = load_resolved(["model=toy", "mesh=8", *overrides])
        check_input_sharding(cfg, list(cfg.mesh), list(cfg.mesh_names))


def test_a_shard_of_a_dim_the_input_lacks_is_refused():
    with pytest.raises(ConfigError) as err:
        cli.preflight_trace(load_resolved(["model=toy", "mesh=2x4",
                                           "constraints.inputs=S(0)S(2)"]))
    assert str(err.value) == ("constraints.inputs=S(0)S(2): shards dim 2 of an input of "
                              "shape [16, 2048]; allowed dims 0..1")


def test_json_artifacts_are_strict_json(tmp_path):
    import numpy as np

    path = artifacts.write_json(artifacts.RUN, tmp_path, {
        "gap": float("inf"), "bound": -np.inf, "x": np.float64("nan"), "n": np.int64(3),
        "arr": np.array([1.0, np.inf]), "p": tmp_path})
    rec = strict_loads(path.read_text())
    assert rec == {"gap": None, "bound": None, "x": None, "n": 3, "arr": [1.0, None],
                   "p": str(tmp_path), "schema_version": artifacts.RUN.schema_version}


# --------------------------------------------------------------------------- caches


@pytest.fixture
def fake_stages(monkeypatch):
    """Stage functions replaced by ones that write their artifacts (``<stage>`` as the
    content) and log their calls."""
    calls: list[str] = []

    def fake(stage, cfg, dirs):
        calls.append(stage)
        time.sleep(0.01)
        dirs.of(stage).mkdir(parents=True, exist_ok=True)
        for artifact in artifacts.stage_outputs(stage, bool(cfg.lazy_costs)):
            artifact.path(dirs.of(stage)).write_text(f"{stage} {artifact.name}")

    monkeypatch.setattr(cli, "_call_stage", fake)
    return calls


def _first_run(tmp_path, monkeypatch, fake_stages, *overrides):
    from pipeline.stages.runner import run_pipeline

    monkeypatch.chdir(tmp_path)
    cfg = load_resolved(["model=toy", *overrides])
    run_pipeline(cfg)
    assert fake_stages == list(STAGES)
    fake_stages.clear()
    return cfg, stage_dirs(cfg), run_pipeline


def test_the_stamp_records_each_artifact_written_last(tmp_path, monkeypatch, fake_stages):
    cfg, dirs, _ = _first_run(tmp_path, monkeypatch, fake_stages, "lazy_costs=false")
    stamp = strict_loads((dirs.costs / artifacts.CODE_STAMP).read_text())
    assert set(stamp["files"]) == {"factors.npz", "costs.json"}
    text = b"costs factors.npz"
    assert stamp["files"]["factors.npz"] == {
        "bytes": len(text), "sha256": hashlib.sha256(text).hexdigest(),
        "schema_version": artifacts.FACTORS.schema_version}
    assert stamp["code"] == cli.stage_code_hash("costs")
    assert (dirs.costs / artifacts.CODE_STAMP).stat().st_mtime_ns >= \
        (dirs.costs / "costs.json").stat().st_mtime_ns


@pytest.mark.parametrize("stage,name,damage,rerun", [
    ("trace", "graph.parquet", "truncate", ["trace", "topology", "costs", "solve"]),
    ("topology", "edges.parquet", "same size", ["topology", "costs", "solve"]),
    ("costs", "factors.npz", "delete", ["costs", "solve"]),
    ("solve", "solution.parquet", "truncate", ["solve"]),
])
def test_a_damaged_artifact_is_rebuilt(tmp_path, monkeypatch, fake_stages, caplog, stage,
                                       name, damage, rerun):
    cfg, dirs, run_pipeline = _first_run(tmp_path, monkeypatch, fake_stages,
                                         "lazy_costs=false", "solver=ilp")
    path = dirs.of(stage) / name
    good = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "same size":
        path.write_bytes(good[::-1])
    else:
        path.unlink()
    with caplog.at_level(logging.INFO, logger="pipeline.stages.runner"):
        run_pipeline(cfg)
    assert fake_stages == [*rerun, "report"]
    assert path.read_bytes() == good
    why = {"truncate": f"{path}: {len(good) // 2} bytes, the stamp says {len(good)} "
                       "(truncated or changed since it was written); rerunning",
           "same size": f"{path}: checksum differs from the stamp (changed since it was "
                        "written); rerunning",
           "delete": f"{path} is missing; rerunning"}[damage]
    assert f"{stage}: {why}" in caplog.messages


def test_a_stamp_of_another_schema_version_or_none_reruns(tmp_path, monkeypatch, fake_stages):
    cfg, dirs, run_pipeline = _first_run(tmp_path, monkeypatch, fake_stages)
    stamp_path = dirs.topology / artifacts.CODE_STAMP
    stamp = json.loads(stamp_path.read_text())
    stamp["files"]["nodes.parquet"]["schema_version"] = 0
    stamp_path.write_text(json.dumps(stamp))
    run_pipeline(cfg)
    assert fake_stages == ["topology", "costs", "solve", "report"]
    fake_stages.clear()
    (dirs.solve / artifacts.CODE_STAMP).unlink()
    run_pipeline(cfg)
    assert fake_stages == ["solve", "report"]
    fake_stages.clear()
    run_pipeline(cfg)
    assert fake_stages == ["report"]


def test_the_stage_cli_refuses_a_damaged_input_in_one_line(tmp_path, monkeypatch,
                                                          fake_stages, capsys):
    """What a Snakemake job runs: the damaged upstream file is named, exit 2."""
    cfg, dirs, _ = _first_run(tmp_path, monkeypatch, fake_stages)
    graph = dirs.trace / "graph.parquet"
    size = graph.stat().st_size
    graph.write_bytes(graph.read_bytes()[:3])
    capsys.readouterr()
    read, write = os.pipe()
    monkeypatch.setenv(cli.ERROR_FD_ENV, str(write))
    assert cli.main(["topology", "model=toy"]) == 2
    os.close(write)
    line = (f"{graph}: 3 bytes, the stamp says {size} (truncated or changed since it was "
            "written); rerun the trace stage (python -m pipeline reruns it; snakemake "
            "--forcerun trace or delete the file)")
    assert capsys.readouterr().err.strip().splitlines()[-1] == line
    with os.fdopen(read) as fh:
        assert fh.read() == line + "\n"
    assert fake_stages == []


def test_stale_temp_files_are_removed_even_from_a_cached_run(tmp_path, monkeypatch,
                                                           fake_stages):
    """HiGHS' ``.model.<random>.mps`` and an atomic writer's ``.<name>.<random>.tmp`` of a
    killed process went on living beside the artifacts."""
    cfg, dirs, run_pipeline = _first_run(tmp_path, monkeypatch, fake_stages)
    stale = [dirs.solve / ".model.k2j3h4.mps", dirs.costs / ".costs.json.abc.tmp"]
    for p in stale:
        p.write_bytes(b"x" * 100)
    keep = dirs.solve / "notes.mps"
    keep.write_text("mine")
    run_pipeline(cfg)
    assert fake_stages == ["report"]
    assert [p.exists() for p in stale] == [False, False]
    assert keep.exists()


def test_a_read_only_results_tree_serves_a_cached_run(tmp_path, monkeypatch, fake_stages,
                                                     caplog):
    cfg, dirs, run_pipeline = _first_run(tmp_path, monkeypatch, fake_stages)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}

    def read_only(directory):
        raise OSError(errno.EROFS, "Read-only file system", str(directory / ".lock"))

    monkeypatch.setattr(cli, "_open_lock", read_only)
    with caplog.at_level(logging.INFO, logger="pipeline.stages.runner"):
        run_pipeline(cfg)
    assert fake_stages == []
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before
    assert f"report: {dirs.report} is read-only; keeping its tables" in caplog.messages
    # a stage that has to run says so in one line
    from pipeline.core.errors import PlanError

    other = load_resolved(["model=toy", "mesh=8"])
    with pytest.raises(PlanError) as err:
        run_pipeline(other)
    assert str(err.value) == (
        f"results_dir=results: {stage_dirs(other).topology} is read-only and the topology "
        "stage has to run; allowed a writable results_dir (or a fully cached run)")


# --------------------------------------------------------------------------- real runs


@pytest.mark.toy_runs(("mesh=8",), ("mesh=2x4",))
def test_a_truncated_graph_is_retraced_by_python_m_pipeline(tmp_path, toy_results):
    """The issue's case: ``graph.parquet`` cut to half gave "trace: reusing", then a
    32-line ArrowInvalid traceback."""
    dirs = toy_results.copy_run(tmp_path / "results", "mesh=8")
    graph = Path(dirs.trace) / "graph.parquet"
    good = pq.read_table(graph).replace_schema_metadata(None)
    size = graph.stat().st_size
    graph.write_bytes(graph.read_bytes()[: size // 2])
    proc = run_py(tmp_path, "-m", "pipeline", "model=toy", "mesh=8",
                  f"results_dir={tmp_path / 'results'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"trace: {graph}: {size // 2} bytes, the stamp says {size} (truncated or "
            "changed since it was written); rerunning") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert pq.read_table(graph).replace_schema_metadata(None).equals(good)  # the same graph
    rec = strict_loads((Path(dirs.solve) / "run.json").read_text())
    assert rec["placement_hash"] == toy_results.run("mesh=8").record["placement_hash"]


@pytest.mark.toy_runs(("mesh=8",), ("mesh=2x4",))
def test_the_report_skips_untrusted_run_records(tmp_path, toy_results, caplog):
    from pipeline.stages.report.stage import run_report

    root = tmp_path / "results"
    good = toy_results.copy_run(root, "mesh=2x4")
    cases = {}
    for name, mesh in (("garbage", "mesh=8"),):
        dirs = toy_results.copy_run(root, mesh)
        (Path(dirs.solve) / "run.json").write_text("garbage{")
        cases[name] = Path(dirs.solve) / "run.json"
    run_report(root)
    runs = pq.read_table(root / "report" / "runs.parquet").to_pylist()
    want = toy_results.run("mesh=2x4").record
    assert [(r["mesh"], r["objective"]) for r in runs] == [("2x4", want["objective"])]
    placements = pq.read_table(root / "report" / "placements.parquet")
    assert set(placements["run_id"].to_pylist()) == {want["run_id"]}
    assert any(m.startswith(f"report: skipping {cases['garbage']}: not a readable run "
                            "record (JSONDecodeError") for m in caplog.messages)
    # a record whose objective lies below its own lower bound, or whose hash does not
    # match its solution.parquet
    path = Path(good.solve) / "run.json"
    rec = json.loads(path.read_text())
    for edit, why in (({"objective": 1.0},
                       f"objective=1.0 is below its own lower_bound={rec['lower_bound']}"),
                      ({"placement_hash": "0" * 64}, f"placement_hash={'0' * 64} does not "
                       f"match {Path(good.solve) / 'solution.parquet'} "
                       f"({rec['placement_hash']})")):
        path.write_text(json.dumps({**rec, **edit}))
        caplog.clear()
        run_report(root)
        assert pq.read_table(root / "report" / "runs.parquet").num_rows == 0
        assert f"report: skipping {path}: {why}" in caplog.messages


@pytest.mark.toy_runs(("mesh=8",))
def test_run_records_are_strict_json(toy_results):
    rec = strict_loads((Path(toy_results.run("mesh=8").dirs.solve) / "run.json").read_text())
    assert rec["objective"] == toy_results.run("mesh=8").record["objective"]


# --------------------------------------------------------------------------- snakemake


@pytest.mark.toy_runs(("mesh=8",))
def test_a_failing_snakemake_job_prints_its_one_line_error(tmp_path, toy_results):
    """The job's stderr goes to its log; the stage's line reaches Snakemake's stderr too
    (the job runs with fd 3 on it), and the workflow exits non-zero."""
    dirs = toy_results.copy_run(tmp_path / "results", "mesh=8")
    graph = Path(dirs.trace) / "graph.parquet"
    size = graph.stat().st_size
    graph.write_bytes(graph.read_bytes()[:10])
    proc = run_py(tmp_path, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory",
                  str(tmp_path), "--cores", "1", "--config", "model=toy", "mesh=8",
                  f"results_dir={tmp_path / 'results'}",
                  timeout=900)
    assert proc.returncode != 0
    line = (f"{graph}: 10 bytes, the stamp says {size} (truncated or changed since it was "
            "written); rerun the trace stage (python -m pipeline reruns it; snakemake "
            "--forcerun trace or delete the file)")
    assert line in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert "Error in rule topology" in proc.stderr


# --------------------------------------------------------------------------- interrupts


# Each script first restores Python's SIGINT handler: a process started in the
# background (`cmd &`) inherits SIGINT ignored, and Python then keeps it ignored.
CBC_SCRIPT = textwrap.dedent("""
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from mrf_gen import random_edges, random_mrf
    from pipeline.solvers.ilp import solve_ilp

    rng = np.random.default_rng(7)
    n = 1200  # CBC runs for a minute: the signal always comes during the solve
    mrf = random_mrf(rng, n, random_edges(rng, n, 3 * n), kmin=8, kmax=10)
    print("solving", flush=True)
    solve_ilp(mrf, backend="cbc")
    print("done", flush=True)
""")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if sys.platform.startswith(
        "linux") and Path(f"/proc/{pid}/stat").exists() else "R"
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ps --ppid, /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_cbc_solve_kills_cbc_and_removes_its_temp_dir(tmp_path, sig):
    env = child_env("1")
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", CBC_SCRIPT.format(tests=str(SUPPORT))],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kids: list[int] = []
        deadline = time.time() + 120
        while not kids and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
            kids = _children(proc.pid)
        assert kids, "cbc never started: " + (proc.stderr.read() if proc.poll() else "")
        assert [p.name for p in tmp_path.iterdir()][0].startswith("ilp_cbc_")
        time.sleep(0.5)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    deadline = time.time() + 10
    while any(_alive(k) for k in kids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(k) for k in kids)
    assert list(tmp_path.iterdir()) == []


HIGHS_SCRIPT = textwrap.dedent("""
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import sys, time
    import numpy as np
    sys.path.insert(0, {tests!r})
    from mrf_gen import random_edges, random_mrf
    from pipeline.solvers.ilp import solve_ilp

    rng = np.random.default_rng(7)
    n = 1200  # HiGHS needs minutes on it: the signal comes during the solve
    mrf = random_mrf(rng, n, random_edges(rng, n, 3 * n), kmin=8, kmax=10)
    print("solving", flush=True)
    t = time.time()
    try:
        solve_ilp(mrf, backend="highs", mps_path={mps!r})
    finally:
        print(f"left after {{time.time() - t:.1f}} s", flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_highs_solve_cancels_it_and_leaves_no_temp_file(tmp_path, sig):
    """HiGHS runs in this process: the signal cancels its solve through its interrupt
    callback within seconds (not at its time limit) and the process exits non-zero with
    the model file written (atomically, before the solve) and no ``.model.*.mps`` temp."""
    mps = tmp_path / "model.mps"
    proc = subprocess.Popen([sys.executable, "-c",
                             HIGHS_SCRIPT.format(tests=str(SUPPORT), mps=str(mps))],
                            env=child_env("1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 120
        while not mps.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert mps.exists(), "the model was never written: " + (
            proc.stderr.read() if proc.poll() is not None else "")
        time.sleep(2.0)  # into the solve
        assert proc.poll() is None, "the solve ended before the signal"
        sent = time.time()
        proc.send_signal(sig)
        proc.wait(timeout=60)
        took = time.time() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert took < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.mps"]


# --------------------------------------------------------------------------- lint


def test_snakemake_lint_is_clean(tmp_path):
    from fixtures import snakemake

    code, out, err = snakemake(tmp_path, "--lint")
    assert code == 0, out + err
    assert "Congratulations, your workflow is in a good condition!" in out + err


def test_the_conda_environment_pins_pyprojects_dependencies():
    import tomllib

    import yaml

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = yaml.safe_load((ROOT / "workflow" / "envs" / "pipeline.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert [p for p in pip if not p.startswith("--")] == deps
    assert "torch==2.13.0" in pip
    rules = "".join(p.read_text() for p in (ROOT / "workflow" / "rules").glob("*.smk"))
    import re

    assert len(re.findall(r"\n +shell:", rules)) == len(re.findall(r"\n +conda:\n +CONDA_ENV\n",
                                                                    rules))


# --------------------------------------------------------------------------- docs


def test_the_example_path_in_docs_config_is_the_derived_one():
    text = (ROOT / "docs" / "config.md").read_text()
    solve = stage_dirs(load_resolved(["model=toy", "mesh=2x4x8"])).solve
    assert f"`{solve}/run.json`" in text.replace("\n", "")


def test_the_readme_cites_only_what_a_clone_has():
    import re

    text = (ROOT / "README.md").read_text()
    assert "../shared" not in text and "public reference" not in text
    assert not re.search(r"issue #\d", text, re.I)
    assert text.count("python3 -m venv --clear .venv") == 2


# --------------------------------------------------------------------------- problem size


@pytest.mark.toy_runs(("mesh=2x4",))
def test_the_problem_size_is_counted_from_the_topology(toy_results):
    """Labels and class pairs by brute force over the topology tables."""
    import collections

    from pipeline.stages.costs.problem_size import BASE_BYTES, estimate

    d = Path(toy_results.run("mesh=2x4").dirs.topology)
    nodes = pq.read_table(d / "nodes.parquet").to_pylist()
    strategies = pq.read_table(d / "strategies.parquet").to_pylist()
    edges = pq.read_table(d / "edges.parquet").to_pylist()
    outs, ins = collections.defaultdict(set), collections.defaultdict(set)
    for s in strategies:
        out = s["output"]
        parts = out[1:-1].split("|") if out.startswith("(") else [out]
        for k, part in enumerate(parts):
            outs[(s["slist"], k)].add(part)
        for a, p in enumerate(s["inputs"]):
            ins[(s["slist"], a)].add(p)
    by_id = {n["id"]: n for n in nodes}
    domain = {n["group"]: n["num_strategies"] for n in nodes}
    each = [len(outs[(by_id[e["producer"]]["slist"], max(e["element"], 0))])
            * len(ins[(by_id[e["consumer"]]["slist"], e["arg"])]) for e in edges]
    pairs = sum(each)
    size = estimate(d)
    assert size.labels == sum(domain.values()) == toy_results.run("mesh=2x4").record[
        "counts"]["group_strategies"]
    assert size.class_pairs == pairs
    assert size.largest_table == max(each)
    # group factors: label k of a group is strategy k of each member; its joint class on
    # a group edge is the tuple of its placements on the member edges
    ndim = 2
    texts = collections.defaultdict(list)
    for s in strategies:
        texts[s["slist"]].append((s["output"], s["inputs"]))

    def side(node: dict, k: int, out: bool, element: int, arg: int) -> str:
        o, i = texts[node["slist"]][k]
        if not out:
            return i[arg]
        if element < 0 or not o.startswith("("):
            return o
        part = o[1:-1].split("|")[element]
        return "R" * ndim if part == "-" else part

    between = collections.defaultdict(list)
    for e in edges:
        gu, gv = by_id[e["producer"]]["group"], by_id[e["consumer"]]["group"]
        if gu != gv:
            between[(min(gu, gv), max(gu, gv))].append((e, gu > gv))
    group_pairs = 0
    for (lo, hi), members in between.items():
        def joint(g: int, low: bool, members=members) -> int:
            keys = set()
            for k in range(domain[g]):
                key = []
                for e, flipped in members:
                    prod = (not flipped) == low  # this side of e is the producer
                    node = by_id[e["producer"] if prod else e["consumer"]]
                    key.append(side(node, k, prod, e["element"], e["arg"]))
                keys.add(tuple(key))
            return len(keys)
        group_pairs += joint(lo, True) * joint(hi, False)
    assert size.group_pairs == group_pairs
    assert size.bytes == (BASE_BYTES + 16 * group_pairs + 96 * max(each) + 64 * size.labels
                          + 24 * size.message_labels)


def test_a_problem_above_max_memory_is_refused_in_one_line(tmp_path, monkeypatch):
    from pipeline.core.errors import PlanError
    from pipeline.stages.costs.problem_size import ProblemSize

    big = ProblemSize(labels=499_592, class_pairs=10**9, group_edges=401,
                      message_labels=10**6, group_pairs=2 * 10**9, largest_table=10**7)
    monkeypatch.setattr("pipeline.stages.costs.problem_size.estimate", lambda d: big)
    cfg = load_resolved(["model=toy", "solver.max_memory=4GiB"])
    with pytest.raises(PlanError) as err:
        cli.check_problem_size(cfg, stage_dirs(cfg))
    gib = (2**29 + 16 * 2 * 10**9 + 96 * 10**7 + 64 * 499_592 + 24 * 10**6) / 2**30
    assert str(err.value) == (
        f"solver.max_memory=4GiB: mesh 2x4x8 is estimated at {gib:.2f} GiB (499,592 group "
        "labels, 2,000,000,000 class pairs in 401 group factors), more than allowed; "
        "allowed a problem within the limit: a larger solver.max_memory, a smaller mesh, "
        "or fewer candidate placements (constraints.inputs / constraints.nodes pins)")
    cli.check_problem_size(load_resolved(["model=toy", "solver.max_memory=32GiB"]),
                           stage_dirs(cfg))  # 31.25 GiB fits
    # a guard, in no directory key; bad values are one line
    assert stage_dirs(cfg).solve == stage_dirs(load_resolved(["model=toy"])).solve
    with pytest.raises(ConfigError, match=r"^solver.max_memory=lots: allowed a positive"):
        load_resolved(["model=toy", "solver.max_memory=lots"])


@pytest.mark.toy_runs(("mesh=8",))
def test_python_m_pipeline_refuses_a_problem_above_max_memory(tmp_path, toy_results):
    dirs = toy_results.copy_run(tmp_path / "results", "mesh=8", upto="topology")
    proc = run_py(tmp_path, "-m", "pipeline", "model=toy", "mesh=8",
                  "solver.max_memory=100MiB", f"results_dir={tmp_path / 'results'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    from pipeline.memory.options import format_bytes
    from pipeline.stages.costs.problem_size import estimate

    size = estimate(dirs.topology)
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"solver.max_memory=100MiB: mesh 8 is estimated at "
                           f"{format_bytes(size.bytes)} ({size.labels:,} group labels, ")
    assert size.labels == toy_results.run("mesh=8").record["counts"]["group_strategies"]
    assert "Traceback" not in proc.stderr
    assert not Path(dirs.costs).exists()


#: A small model on a 4-d mesh: one nn.Linear (the custom family), mesh 2x2x2x2.
LINEAR_4D = ["model=custom", "model.builder._target_=torch.nn.Linear",
             "model.builder.in_features=16", "model.builder.out_features=32",
             "model.inputs=[{name:x,shape:[16,16],dtype:float32}]", "mesh=2,2,2,2",
             "mesh_names=[dp,cp,tp,ep]", "solver.max_memory=10GiB"]
#: The estimate of :mod:`pipeline.stages.costs.problem_size` against a run's measured peak RSS.
ESTIMATE_RTOL = 0.3


def test_a_4d_mesh_plans_within_its_estimate(tmp_path):
    """A 4-d mesh plans end to end (lazy costs, TRW-S certifies its plan) and the
    problem-size estimate is within ESTIMATE_RTOL of the run's peak RSS, measured by
    ``resource`` in a fresh parent of the run (its ``RUSAGE_CHILDREN`` holds only it)."""
    from pipeline.stages.costs.problem_size import estimate

    results = tmp_path / "results"
    measure = ("import resource, subprocess, sys; "
               "p = subprocess.run(sys.argv[1:]); "
               "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    proc = run_py(tmp_path, "-c", measure, sys.executable, "-m", "pipeline", *LINEAR_4D,
                  f"results_dir={results}")
    code, peak_kib = (int(x) for x in proc.stdout.split()[-2:])
    assert code == 0, proc.stderr[-3000:]
    (record,) = [json.loads(p.read_text()) for p in results.glob("runs/*/*/*/*/*/run.json")]
    assert record["mesh"] == "2x2x2x2" and record["cost_mode"] == "lazy"
    assert record["additive_status"] == "Optimal"  # the additive plan is certified
    additive = record["step_time_search"]["candidates"][0]["additive_us"]
    assert abs(additive - record["lower_bound"]) <= 1e-9 * additive
    (topology,) = results.glob("runs/*/2x2x2x2-*")
    size = estimate(topology)
    assert size.labels == record["counts"]["group_strategies"]
    peak = peak_kib * 1024
    assert abs(size.bytes - peak) <= ESTIMATE_RTOL * peak, (size.bytes, peak)
