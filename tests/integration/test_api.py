"""``pipeline.api``: ``plan()`` gives the run ``python -m pipeline`` makes, reusing its
stages; a bad value raises the command line's one-line error; the example of
docs/api.md runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.api import RUN_TABLES, Run, hydra_overrides, plan
from pipeline.config import ConfigError
from pipeline.core.artifacts import LOCK_FILE

ROOT = Path(__file__).resolve().parents[2]
#: The shared toy run ``python -m pipeline model=toy mesh=2x4`` (tests/fixtures.py).
TOY_2X4 = ("mesh=2x4",)


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` but the stage locks: (modification time, size)."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def _docs_example() -> str:
    """The python block of docs/api.md."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "api.md").read_text(),
                        re.M | re.S)
    assert len(blocks) == 1, "docs/api.md should hold one python example"
    return blocks[0]


def test_keywords_become_the_command_lines_overrides():
    assert hydra_overrides("toy", (2, 4), solver="ilp") == ["model=toy", "mesh=2x4", "solver=ilp"]
    assert hydra_overrides("toy", "2,4,8", results_dir=Path("/tmp/r s"), lazy_costs=False,
                           mesh_names=["dp", "cp", "tp"], solver__time_limit_s=60,
                           overrides=["solver.backend=highs"]) == [
        "model=toy", "mesh=2,4,8", "results_dir='/tmp/r s'", "lazy_costs=false",
        "mesh_names=[dp,cp,tp]", "solver.time_limit_s=60", "solver.backend=highs"]
    assert hydra_overrides(mesh=8)[:2] == ["model=llama1b", "mesh=8"]
    with pytest.raises(TypeError, match="allowed a list of Hydra overrides"):
        hydra_overrides("toy", overrides="solver=ilp")


def test_a_bad_value_raises_the_command_lines_one_line_error(tmp_path, monkeypatch):
    """The same ConfigError line ``python -m pipeline`` prints, nothing written."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    proc = subprocess.run([sys.executable, "-m", "pipeline", "model=toy", "mesh=2,0,8"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        plan(model="toy", mesh="2,0,8")
    assert proc.stderr.splitlines() == [str(err.value)]
    with pytest.raises(ConfigError, match=r"^mesh=2x0: allowed positive integers"):
        plan(model="toy", mesh=(2, 0))
    with pytest.raises(ConfigError, match=r"^solver=foo: allowed approx, ilp, lp$"):
        plan(model="toy", mesh=(2, 4), solver="foo")
    with pytest.raises(ConfigError, match=r"^model\.n_heads=7: must divide model\.dim=256$"):
        plan(model="toy", mesh=(2, 4), model__n_heads=7)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.toy_runs(TOY_2X4)
def test_plan_is_the_command_lines_run_and_reuses_its_stages(toy_results, tmp_path):
    """``plan(model="toy", mesh="2x4")`` on the artifacts ``python -m pipeline model=toy
    mesh=2x4`` wrote (a copy: times and code stamps kept) reruns no stage, writes nothing,
    and returns that run: same objective and placement hash."""
    cli = toy_results.run(*TOY_2X4)
    dirs = toy_results.copy_run(tmp_path / "results", *TOY_2X4)
    before = _files(tmp_path / "results")
    run = plan(model="toy", mesh="2x4", results_dir=tmp_path / "results")
    assert _files(tmp_path / "results") == before  # every stage reused, nothing written
    assert isinstance(run, Run) and run.solve_dir == dirs.solve
    assert run.record == cli.record
    assert (run.objective, run.placement_hash) == (cli.record["objective"],
                                                   cli.record["placement_hash"])
    assert run.status == cli.record["status"] and run.step_time_us == cli.record["step_time_us"]
    assert run.plan.placement_hash == run.placement_hash and run.plan_path.name == "plan.json"
    assert sorted(run.solution.column("node").to_pylist()) == [r["node"] for r in cli.plan]
    assert run.redistributions.num_rows > 0
    assert {name: run.table(name).num_rows > 0 for name in RUN_TABLES} == dict.fromkeys(
        RUN_TABLES, True)
    with pytest.raises(ValueError, match=r"^table=runs: allowed edges, graph, "):
        run.table("runs")
    assert "status=" in repr(run) and "record" not in repr(run)


@pytest.mark.toy_runs(TOY_2X4)
def test_the_example_of_docs_api_md_runs(toy_results, tmp_path, monkeypatch, capsys):
    toy_results.copy_run(tmp_path / "results", *TOY_2X4)
    before = _files(tmp_path / "results")
    monkeypatch.chdir(tmp_path)
    exec(compile(_docs_example(), "docs/api.md", "exec"), {})
    out = capsys.readouterr().out
    assert "Run(model=toy, mesh=2x4, solver=approx, status=" in out
    assert toy_results.run(*TOY_2X4).record["placement_hash"][:16] in out
    assert _files(tmp_path / "results") == before
