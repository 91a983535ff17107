"""``python -m pipeline.tools.profile``: the reference harness's flags map to Hydra overrides,
bad flags and values fail in one line with exit 2 and write nothing, and a profile of a
toy run has the same placement hash as ``python -m pipeline`` of the same config, with
the provenance fields the issue asks for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_resolved
from pipeline.tools import profile

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> list[str]:
    return profile.flags_to_overrides(profile.build_parser().parse_args(list(argv)))


def test_flags_map_to_hydra_overrides():
    assert parse("--model", "llama1b", "--mesh", "2,4,8", "--solver", "approx",
                 "--lazy-costs", "false", "--revision-label", "3e6fbf2", "--output",
                 "o.json", "--detailed-solution") == [
        "model=llama1b", "solver=approx", "mesh='2,4,8'", "lazy_costs=false",
        "revision_label='3e6fbf2'"]
    assert parse("--model", "toy", "--solver", "ilp", "--output", "o.json",
                 "--results-dir", "/r", "solver.time_limit_s=60") == [
        "model=toy", "solver=ilp", "results_dir='/r'", "solver.time_limit_s=60"]
    # a label that reads as a number stays a string
    cfg = load_resolved(parse("--model", "toy", "--solver", "approx", "--output", "o",
                              "--revision-label", "1e10", "--mesh", "2x4"))
    assert cfg.revision_label == "1e10" and list(cfg.mesh) == [2, 4]


BAD = [
    (["--model", "gpt", "--solver", "approx", "--output", "{out}"],
     "python -m pipeline.tools.profile: argument --model: invalid choice: 'gpt' (choose from "
     "'llama1b', 'llama405b', 'llama70b', 'llama8b', 'toy')"),
    (["--model", "toy", "--solver", "approx"],
     "python -m pipeline.tools.profile: the following arguments are required: --output"),
    (["--model", "toy", "--solver", "greedy", "--output", "{out}"],
     "python -m pipeline.tools.profile: argument --solver: invalid choice: 'greedy' (choose from "
     "'approx', 'ilp', 'lp')"),
    (["--model", "toy", "--solver", "approx", "--lazy-costs", "maybe", "--output", "{out}"],
     "python -m pipeline.tools.profile: argument --lazy-costs: invalid choice: 'maybe' (choose "
     "from 'true', 'false')"),
    (["--model", "toy", "--solver", "approx", "--output", "{out}", "--verbose"],
     "python -m pipeline.tools.profile: unrecognized arguments: --verbose"),
    (["--model", "toy", "--solver", "approx", "--mesh", "2,0,8", "--output", "{out}"],
     "mesh=2,0,8: allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)"),
    (["--model", "toy", "--solver", "ilp", "--lazy-costs", "true", "--output", "{out}"],
     "lazy_costs=true: lazy costs need solver=approx (got solver=ilp)"),
    (["--model", "toy", "--solver", "approx", "--moe-layout", "2d", "--output", "{out}"],
     "--moe-layout 2d: no mixture-of-experts model here; allowed models llama1b, llama405b, "
     "llama70b, llama8b, toy without --moe-layout"),
    (["--model", "toy", "--solver", "approx", "--output", "{out}", "solver.max_iters=0"],
     "solver.max_iters=0: allowed an integer >= 1"),
    (["--model", "toy", "--solver", "approx", "--output", "{out}", "verbose"],
     "verbose: not an override; allowed KEY=VALUE Hydra overrides"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(b[0][:6]) for b in BAD])
def test_bad_flags_fail_in_one_line_and_write_nothing(argv, message, tmp_path, monkeypatch,
                                                      capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.json"
    code = profile.main([a.replace("{out}", str(out)) for a in argv])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.strip().splitlines() == [message]
    assert captured.out == ""
    assert list(tmp_path.iterdir()) == []


def test_bad_flags_through_the_real_interpreter(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.tools.profile", "--model", "toy", "--solver", "approx",
         "--output", str(tmp_path / "o.json"), "--lazy-costs", "yes"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_is_not_an_error(capsys):
    assert profile.main(["--help"]) == 0
    assert "--detailed-solution" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.toy_runs(("mesh=8", "lazy_costs=true"))
def test_profile_has_the_placement_hash_of_python_m_pipeline(tmp_path, monkeypatch, capsys,
                                                             toy_results):
    """Profile of toy on mesh 8 (in this process) next to `python -m pipeline` of the same
    config (another process, other results dir: the shared toy run): one plan; then a
    second profile reuses every stage and --fresh reruns them, with the same hash."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "prof" / "lazy.json"
    argv = ["--model", "toy", "--mesh", "8", "--solver", "approx", "--lazy-costs", "true",
            "--detailed-solution", "--revision-label", "test-label", "--output", str(out),
            "--results-dir", "profiled"]
    code = profile.main(argv)
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    doc = json.loads(out.read_text())
    plain = toy_results.run("mesh=8", "lazy_costs=true").record
    assert doc["placement_hash"] == plain["placement_hash"] == summary["placement_hash"]
    assert doc["objective"] == pytest.approx(plain["objective"])
    assert summary == {"status": "success", "output": str(out),
                       "objective": doc["objective"], "placement_hash": doc["placement_hash"]}

    # the fields of the issue
    assert doc["status"] == "success" and doc["schema_version"] == 1
    assert doc["request"]["model"] == "toy" and doc["request"]["detailed_solution"] is True
    assert doc["overrides"][:2] == ["model=toy", "solver=approx"]
    exp = doc["expanded_config"]
    assert exp["mesh_shape"] == [8] and exp["mesh_dim_names"] == ["dp"]
    assert exp["model"]["name"] == "toy" and exp["model"]["n_layers"] == 2
    assert exp["lazy_costs"] is True and exp["solver"]["name"] == "approx"
    assert doc["config"]["model"] == exp["model"]
    env_keys = {"python", "torch", "pulp", "snakemake", "cpu_model", "cpu_count"}
    assert env_keys <= set(doc["environment"])
    git = doc["git"]
    assert len(git["revision"]) == 40 and isinstance(git["dirty"], bool)
    assert isinstance(git["status"], str) and "branch" in git
    assert doc["revision_label"] == "test-label"
    assert {"compute_us", "comm_us", "transition_us", "lower_bound", "gap", "status"} <= set(doc)
    assert doc["counts"]["nodes"] > 100 and doc["counts"]["groups"] > 0
    assert doc["counts"]["factors_materialised"]["total"] > 0
    assert {"trace", "topology", "cost_build", "factor_build", "solve", "search_total",
            "wall"} <= set(doc["phases"])
    assert doc["peak_rss_bytes"]["max"] > 0
    assert doc["process"]["peak_rss_bytes"]["max"] >= doc["peak_rss_bytes"]["max"]
    assert {"trace", "topology", "cost_build", "solve", "wall"} <= set(doc["process"]["phases"])
    assert doc["reused_stages"] == []
    details = doc["solution_detail"]
    assert len(details) == doc["counts"]["nodes"]
    assert {"name", "op", "output_placement", "input_placements", "compute_us",
            "comm_us"} <= set(details[0])

    # again: every stage reused, same plan; --fresh: every stage rerun, same plan
    again = tmp_path / "again.json"
    assert profile.main([*argv[:-4], "--output", str(again), "--results-dir", "profiled"]) == 0
    assert json.loads(again.read_text())["reused_stages"] == ["trace", "topology", "costs",
                                                               "solve"]
    fresh = tmp_path / "fresh.json"
    assert profile.main([*argv[:-4], "--output", str(fresh), "--results-dir", "profiled",
                         "--fresh"]) == 0
    fdoc = json.loads(fresh.read_text())
    assert fdoc["reused_stages"] == [] and fdoc["placement_hash"] == doc["placement_hash"]
    assert "solution_detail" in fdoc


def test_a_failed_search_writes_an_error_document(tmp_path, monkeypatch, capsys):
    def boom(cfg, force=False):
        raise RuntimeError("solver exploded")

    monkeypatch.setattr(profile, "run_pipeline", boom)
    out = tmp_path / "err.json"
    code = profile.main(["--model", "toy", "--solver", "approx", "--output", str(out),
                         "--results-dir", str(tmp_path / "r")])
    assert code == 1
    doc = json.loads(out.read_text())
    assert doc["status"] == "error"
    assert doc["error"]["type"] == "RuntimeError" and "solver exploded" in doc["error"]["message"]
    assert "Traceback" in doc["error"]["traceback"]
    assert doc["expanded_config"]["model"]["name"] == "toy"
    assert json.loads(capsys.readouterr().out)["status"] == "error"
