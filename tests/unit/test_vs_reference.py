"""benchmarks/vs_reference.py: the summary, ratio and Markdown code on hand-made run
records (no planner is run), the project's command line, and bad arguments."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "vs_reference", ROOT / "benchmarks" / "vs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_reference"] = module
    spec.loader.exec_module(module)
    return module


vs = _load()

MACHINE = {"cpu_model": "AMD EPYC", "cpu_count": 2, "usable_cores": 2,
           "memory_bytes": 24 * 2**30, "platform": "Linux", "python": "3.11.7",
           "torch": "2.13.0+cpu", "git": {"revision": "0123456789abcdef", "dirty": False}}
META = {"command": "python benchmarks/vs_reference.py", "started": "t0", "finished": "t1",
        "load_start": [1.0, 1.0, 1.0], "load_end": [1.5, 1.2, 1.1], "n_layers": 16,
        "reference_versions": {"torch": "2.13.0+cpu", "pulp": "3.3.2"}}


def _run(side: str, mesh: str, wall: float, rss: float, ok: bool = True,
         **extra: Any) -> dict[str, Any]:
    rec = {"side": side, "mesh": mesh, "ok": ok, "wall": wall, "peak_rss_mib": rss,
           "load_before": [1.0, 1.0, 1.0], "load_after": [1.25, 1.0, 1.0],
           "error": None if ok else "exit 1: boom", "phases": {}}
    rec.update(extra)
    return rec


def test_ratio_is_reference_over_project() -> None:
    assert vs.ratio(980.0, 70.0) == pytest.approx(14.0)
    assert vs.ratio(8908.8, 1433.6) == pytest.approx(8908.8 / 1433.6)
    assert vs.ratio(None, 70.0) is None
    assert vs.ratio(980.0, None) is None
    assert vs.ratio(980.0, 0.0) is None


def test_summary_and_markdown_by_hand() -> None:
    # 2x4x8: project 70.0 s / 1433.6 MiB (= 1.40 GiB), reference 980.0 s / 8908.8 MiB
    # (= 8.70 GiB): 980 / 70 = 14.0x faster, 8908.8 / 1433.6 = 6.214...x leaner.
    # 8x8: three project runs 10, 30, 20 s (median 20) with 400, 600, 500 MiB (median
    # 500); one reference run 90 s / 1000 MiB: 4.5x faster, 2.0x leaner.
    phases = {"trace": 16.7, "topology": 5.4, "cost_build": 1.8, "factor_build": 6.4,
              "solve": 28.7, "search_total": 59.0, "wall": 61.0}
    runs = [
        _run("project", "2x4x8", 70.0, 1433.6, phases=phases, objective=123.5,
             placement_hash="abc"),
        _run("reference", "2x4x8", 980.0, 8908.8,
             phases={"import": 5.0, "trace": 100.0, "optimizer_build": 700.0,
                     "solve": 170.0, "wall": 975.0},
             objective=140.25, graph_nodes=4431, decision_vars=397818,
             trws={"iterations": 400}),
        _run("project", "8x8", 10.0, 400.0, phases={"trace": 1.0}),
        _run("project", "8x8", 30.0, 600.0, phases={"trace": 3.0}),
        _run("project", "8x8", 20.0, 500.0, phases={"trace": 2.0}),
        _run("reference", "8x8", 90.0, 1000.0),
    ]
    summary = vs.summarise(runs, ["2x4x8", "8x8"])
    assert [row["mesh"] for row in summary] == ["2x4x8", "8x8"]
    big, small = summary
    assert big["speed_ratio"] == pytest.approx(14.0)
    assert big["memory_ratio"] == pytest.approx(6.2142857142857)
    assert small["project"]["wall"] == 20.0 and small["project"]["peak_rss_mib"] == 500.0
    assert small["project"]["phases"]["trace"] == 2.0
    assert small["speed_ratio"] == pytest.approx(4.5)
    assert small["memory_ratio"] == pytest.approx(2.0)
    assert small["project"]["load"] == [1.0, 1.0, 1.0, 1.25]

    md = vs.markdown(summary, MACHINE, META)
    lines = md.splitlines()
    head = lines.index("| mesh | project wall / RSS (phases s) | reference wall / RSS "
                       "(phases s) | speed ratio | memory ratio |")
    assert lines[head + 1] == "| --- | --- | --- | --- | --- |"
    assert lines[head + 2] == (
        "| 2x4x8 | 70.0 s / 1.40 GiB (trace 16.7, topology 5.4, cost 1.8, factors 6.4, "
        "solve 28.7, in-process 61.0) | 980.0 s / 8.70 GiB (import 5.0, trace 100.0, "
        "build 700.0, solve 170.0, in-process 975.0) | 14.0x faster | 6.2x leaner |")
    assert lines[head + 3] == (
        "| 8x8 | 20.0 s / 0.49 GiB (trace 2.0), median of 3 | 90.0 s / 0.98 GiB "
        "| 4.5x faster | 2.0x leaner |")
    assert "- machine: AMD EPYC, 2 usable cores of 2, 24.0 GiB, Linux" in lines
    assert "git 0123456789ab," in md
    assert "- reference: AutoParallel 8eda68d, pulp 3.3.2, torch 2.13.0+cpu" in lines
    assert any(ln.startswith("- 2x4x8 reference: objective 140.25; graph_nodes 4431; "
                             "decision_vars 397818; TRW-S iterations 400") for ln in lines)


def test_a_failed_side_has_no_ratio() -> None:
    runs = [_run("project", "8x8", 20.0, 500.0),
            _run("reference", "8x8", 5.0, 100.0, ok=False)]
    (row,) = vs.summarise(runs, ["8x8"])
    assert row["reference"]["wall"] is None and row["speed_ratio"] is None
    line = [ln for ln in vs.markdown([row], MACHINE, META).splitlines()
            if ln.startswith("| 8x8")][0]
    assert line == "| 8x8 | 20.0 s / 0.49 GiB | error: exit 1: boom | — | — |"
    (only,) = vs.summarise(runs[:1], ["8x8"])  # --project-only
    assert only["reference"] is None and only["memory_ratio"] is None


def test_project_case_and_meshes() -> None:
    assert vs.project_case("2x4x8").overrides == (
        "model=llama1b", "mesh=2x4x8", "solver=approx", "lazy_costs=true")
    assert vs.project_case("8x8", 4).overrides == (
        "model=llama1b", "model.n_layers=4", "mesh=8x8", "solver=approx", "lazy_costs=true")
    assert vs.parse_meshes("2x4x8,8x8") == ["2x4x8", "8x8"]
    assert vs.parse_meshes("8") == ["8"]
    for bad in ("2,4,8x", "2x0", "1x2x3x4", "", "a"):
        with pytest.raises(ValueError, match="--meshes="):
            vs.parse_meshes(bad)


@pytest.mark.parametrize("argv, key", [
    (["--meshes", "2x0"], "--meshes=2x0"),
    (["--repeats", "0"], "--repeats=0"),
    (["--n-layers", "0"], "--n-layers=0"),
    (["--timeout", "-1"], "--timeout=-1"),
    (["--ref-python", "/nonexistent/python"], "--ref-python=/nonexistent/python"),
])
def test_bad_arguments_exit_2_and_write_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        key: str) -> None:
    assert vs.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(key) and "allowed" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_sweep_points_pair_each_jobs_log_line_with_its_run_record(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "benchmarks" / "sweep.py")
    assert spec is not None and spec.loader is not None
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    for name, mesh, solver, mode in (("a", "8", "approx", "lazy"),
                                     ("b", "2x4", "ilp", "eager")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(
            f'{{"mesh": "{mesh}", "solver": "{solver}", "cost_mode": "{mode}"}}')
    log = "\n".join([
        "12:00:00 pipeline INFO: stages: trace 0.01 s (reused), topology 0.50 s, "
        "costs 0.10 s, solve 0.40 s; wall 1.05 s",
        "run record: a/run.json",
        "12:00:01 pipeline.stages.runner INFO: topology: running in x",
        "12:00:02 pipeline INFO: stages: trace 0.00 s (reused), topology 0.00 s (reused), "
        "costs 2.00 s, solve 3.25 s; wall 5.30 s",
        "run record: b/run.json",
        "12:00:03 pipeline INFO: report of the sweep: 2.50 s"])
    points = sweep.points(log, tmp_path)
    assert [(p, w) for p, w, _ in points] == [("mesh=8 solver=approx lazy", 1.05),
                                             ("mesh=2x4 solver=ilp eager", 5.30)]
    assert points[1][2].startswith("trace 0.00 s (reused)")
    assert [float(m["s"]) for m in sweep.REPORT_RE.finditer(log)] == [2.5]
