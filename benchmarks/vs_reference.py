"""Side-by-side benchmark: this project and the public reference planner (AutoParallel,
github.com/meta-pytorch/autoparallel at its approximate-solver commit 8eda68d) plan
LLaMA-3.2 1B in one sitting, fresh processes, alternating; prints the ratios.

    python benchmarks/vs_reference.py                       # 2x4x8 and 8x8, once each
    python benchmarks/vs_reference.py --meshes 8x8 --repeats 3
    python benchmarks/vs_reference.py --project-only --n-layers 4

Runs with the project's Python. The reference runs in its own venv
(``benchmarks/setup_reference.sh``; ``--ref-python``, default ``$REF_PYTHON`` or
``$REF_VENV/bin/python`` or the script's default venv) through
``benchmarks/reference_llama.py``.

Per mesh and repeat, alternating sides (the side that goes first alternates too):

* project: ``python -m pipeline model=llama1b mesh=<m> solver=approx lazy_costs=true``
  through :func:`pipeline.tools.bench.run_case`, in a fresh, empty temporary results directory
  (no cached trace: every phase is computed in that process), removed afterwards;
  its phases come from its run record (``phases`` of ``run.json``);
* reference: ``<ref-python> benchmarks/reference_llama.py --mesh <m>``, one JSON line.

Both are measured the same way, by the bench's runner around the child process: ``wall``
(start to reaped), ``cpu`` (user + system of the process and its reaped children) and
peak RSS (``ru_maxrss`` of ``os.wait4``: the largest of the process and its reaped
descendants, e.g. the reference's cost-building fork workers). With ``--repeats`` > 1
each side's figures are medians.

``speed ratio`` = reference wall / project wall and ``memory ratio`` = reference peak
RSS / project peak RSS (> 1: the project is faster / leaner). The load average is
recorded before and after each run: the figures are comparable only within one sitting.

Outputs (rewritten atomically after every run): ``<out>/vs_reference.json`` (every run,
the summary, machine, command) and ``<out>/vs_reference.md``; logs in
``<out>/logs/vs_reference/``. Exit codes: 0 all runs succeeded; 1 a run failed or timed
out (recorded, the others go on); 2 bad arguments (one line, nothing written).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's pipeline, not an installed one
    sys.path.insert(0, str(ROOT))

from pipeline.core import runtime  # noqa: E402
from pipeline.tools.bench import Case, machine_info, run_case  # noqa: E402
from pipeline.tools.bench.runner import _measure, _tail  # noqa: E402

__all__ = ["DEFAULT_MESHES", "PROJECT_PHASES", "default_ref_python", "main", "markdown",
           "parse_meshes", "project_case", "ratio", "summarise"]

DEFAULT_MESHES = ("2x4x8", "8x8")
DRIVER = Path(__file__).resolve().parent / "reference_llama.py"
#: Phases of the project's run record shown in the table (label, key).
PROJECT_PHASES = (("trace", "trace"), ("topology", "topology"), ("cost", "cost_build"),
                  ("factors", "factor_build"), ("solve", "solve"), ("in-process", "wall"))
#: Phases of the reference driver shown in the table (label, key).
REFERENCE_PHASES = (("import", "import"), ("trace", "trace"),
                    ("build", "optimizer_build"), ("solve", "solve"), ("in-process", "wall"))
LLAMA1B_LAYERS = 16


def default_ref_python() -> str:
    """``$REF_PYTHON``, else ``$REF_VENV/bin/python``, else the venv that
    ``benchmarks/setup_reference.sh`` makes by default."""
    if os.environ.get("REF_PYTHON"):
        return os.environ["REF_PYTHON"]
    venv = os.environ.get("REF_VENV") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "sharding-planner-reference" / "venv")
    return str(Path(venv) / "bin" / "python")


def parse_meshes(text: str) -> list[str]:
    """``"2x4x8,8x8"`` -> ``["2x4x8", "8x8"]``; a mesh is 1 to 3 positive integers joined
    by ``x``. Raises ``ValueError`` with the one-line message."""
    meshes = [m.strip() for m in text.split(",") if m.strip()]
    for m in meshes:
        dims = m.split("x")
        if not (1 <= len(dims) <= 3 and all(d.isdigit() and int(d) > 0 for d in dims)):
            raise ValueError(f"--meshes={text}: {m!r} is not a mesh; allowed a comma list "
                             "of 1 to 3 positive integers joined by 'x', e.g. 2x4x8,8x8")
    if not meshes:
        raise ValueError(f"--meshes={text!r}: allowed a comma list of meshes, e.g. 2x4x8,8x8")
    return meshes


def project_case(mesh: str, n_layers: int = LLAMA1B_LAYERS) -> Case:
    """The project's case for ``mesh`` (keys in the bench's order: model, model.*, mesh,
    solver, lazy_costs)."""
    depth = () if n_layers == LLAMA1B_LAYERS else (f"model.n_layers={n_layers}",)
    return Case(("model=llama1b", *depth, f"mesh={mesh}", "solver=approx",
                 "lazy_costs=true"))


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --------------------------------------------------------------------------- runs


def run_project(mesh: str, n_layers: int, index: int, log_dir: Path,
                timeout: float | None) -> dict[str, Any]:
    """One project run in a fresh temporary results directory (removed afterwards)."""
    case = project_case(mesh, n_layers)
    record: dict[str, Any] = {"side": "project", "mesh": mesh, "n_layers": n_layers,
                              "command": "python -m pipeline " + case.label,
                              "started": _now(), "load_before": _load()}
    tmp = Path(tempfile.mkdtemp(prefix="vs-reference-"))
    try:
        row = run_case(case, index, tmp, log_dir, timeout)
        phases = None
        if row.get("run_record"):
            phases = json.loads(Path(row["run_record"]).read_text()).get("phases")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record.update(
        load_after=_load(), ok=row["status"] != "Error", error=row.get("error"),
        wall=row["wall"], cpu=row["cpu"], peak_rss_mib=row["peak_rss_mib"],
        phases=phases, objective=row["objective"], status=row["status"],
        nodes=row["nodes"], groups=row["groups"], group_strategies=row["group_strategies"],
        factors=row["factors_materialised"], placement_hash=row["placement_hash"],
        revision=row["revision"], code=row["code"])
    return record


def run_reference(mesh: str, n_layers: int, index: int, ref_python: str, log_dir: Path,
                  timeout: float | None) -> dict[str, Any]:
    """One reference run: the driver in ``ref_python``, measured like the project's."""
    cmd = [ref_python, str(DRIVER), "--mesh", mesh, "--n-layers", str(n_layers)]
    record: dict[str, Any] = {"side": "reference", "mesh": mesh, "n_layers": n_layers,
                              "command": shlex.join(cmd), "started": _now(),
                              "load_before": _load()}
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{index:02d}-reference-mesh-{mesh}"
    out_log, err_log = log_dir / f"{stem}.stdout.log", log_dir / f"{stem}.stderr.log"
    code, wall, cpu, rss, timed_out = _measure(cmd, out_log, err_log, timeout)
    record.update(load_after=_load(), wall=wall, cpu=cpu, peak_rss_mib=rss / 2**20,
                  exit_code=code, stderr_log=str(err_log))
    error = None
    driver: dict[str, Any] | None = None
    if timed_out:
        error = f"timeout after {timeout:g} s (killed); {_tail(err_log)}"
    elif code != 0:
        error = f"exit {code}: {_tail(err_log)}"
    else:
        lines = [ln for ln in out_log.read_text().splitlines() if ln.strip()]
        try:
            driver = json.loads(lines[-1])
        except (IndexError, ValueError) as err:
            error = f"no JSON line on the driver's stdout ({err})"
    record.update(ok=error is None, error=error)
    if driver is not None:
        record.update(
            phases={**(driver.get("phases") or {}), "wall": driver.get("wall_s")},
            objective=driver.get("objective"),
            status=driver.get("status"), graph_nodes=driver.get("graph_nodes"),
            decision_vars=driver.get("decision_vars"), groups=driver.get("groups"),
            trws=driver.get("trws"), driver_wall=driver.get("wall_s"),
            cost_workers=driver.get("cost_workers"), versions=driver.get("versions"),
            driver_rss_self_mib=driver.get("peak_rss_self_mib"),
            driver_rss_children_mib=driver.get("peak_rss_children_mib"))
    return record


# --------------------------------------------------------------------------- summary


def ratio(reference: float | None, project: float | None) -> float | None:
    """``reference / project`` (> 1: the project is faster or leaner); ``None`` when a
    side is missing or the project's figure is not positive."""
    if reference is None or project is None or not project > 0:
        return None
    return reference / project


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _side(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Medians of the successful runs of one side on one mesh (``None``: no run)."""
    if not runs:
        return None
    ok = [r for r in runs if r.get("ok")]
    out: dict[str, Any] = {"runs": len(runs), "ok": len(ok),
                           "errors": [r["error"] for r in runs if not r.get("ok")]}
    out["wall"] = _median([r["wall"] for r in ok])
    out["peak_rss_mib"] = _median([r["peak_rss_mib"] for r in ok])
    keys = sorted({k for r in ok for k in (r.get("phases") or {})})
    out["phases"] = {k: _median([r["phases"][k] for r in ok
                                 if (r.get("phases") or {}).get(k) is not None])
                     for k in keys}
    out["load"] = [r["load_before"][0] for r in runs] + [runs[-1]["load_after"][0]]
    for key in ("objective", "nodes", "groups", "graph_nodes", "decision_vars",
                "placement_hash", "trws"):
        vals = [r.get(key) for r in ok if r.get(key) is not None]
        if vals:
            out[key] = vals[-1]
    return out


def summarise(runs: list[dict[str, Any]], meshes: Sequence[str]) -> list[dict[str, Any]]:
    """One entry per mesh: each side's medians and the two ratios."""
    rows = []
    for mesh in meshes:
        project = _side([r for r in runs if r["mesh"] == mesh and r["side"] == "project"])
        reference = _side([r for r in runs
                           if r["mesh"] == mesh and r["side"] == "reference"])
        rows.append({
            "mesh": mesh, "project": project, "reference": reference,
            "speed_ratio": ratio(reference and reference["wall"],
                                 project and project["wall"]),
            "memory_ratio": ratio(reference and reference["peak_rss_mib"],
                                  project and project["peak_rss_mib"])})
    return rows


def _gib(mib: float) -> str:
    return f"{mib / 1024:.2f} GiB"


def _cell(side: dict[str, Any] | None, phases: tuple[tuple[str, str], ...]) -> str:
    if side is None:
        return "not run"
    if side["wall"] is None:
        return "error: " + "; ".join(e or "" for e in side["errors"])[:200].replace("|", "/")
    text = f"{side['wall']:.1f} s / {_gib(side['peak_rss_mib'])}"
    parts = [f"{label} {side['phases'][key]:.1f}" for label, key in phases
             if side["phases"].get(key) is not None]
    if parts:
        text += f" ({', '.join(parts)})"
    if side["runs"] > 1:
        text += f", median of {side['ok']}"
    return text


def _ratio_cell(value: float | None, word: str) -> str:
    return "—" if value is None else f"{value:.1f}x {word}"


def _versions(info: Any) -> str:
    if not isinstance(info, dict):
        return "not run"
    return "AutoParallel 8eda68d, " + ", ".join(f"{k} {info[k]}" for k in sorted(info))


def _git(info: Any) -> str:
    if isinstance(info, dict) and info.get("revision"):
        return str(info["revision"])[:12] + ("+dirty" if info.get("dirty") else "")
    return str(info)


def markdown(summary: list[dict[str, Any]], machine: dict[str, Any],
             meta: dict[str, Any]) -> str:
    """The Markdown report: machine and sitting, the table, then per-mesh details."""
    mem = machine.get("memory_bytes")
    lines = [
        "# This project vs the public reference planner (AutoParallel 8eda68d)", "",
        f"- machine: {machine.get('cpu_model')}, {machine.get('usable_cores')} usable "
        f"cores of {machine.get('cpu_count')}, "
        + (f"{mem / 2**30:.1f} GiB" if mem else "memory unknown")
        + f", {machine.get('platform')}",
        f"- project: git {_git(machine.get('git'))}, python {machine.get('python')}, torch "
        f"{machine.get('torch')}",
        f"- reference: {_versions(meta.get('reference_versions'))}",
        f"- sitting: {meta.get('started')} to {meta.get('finished')}; load average (1 min) "
        f"at start {meta.get('load_start')}, at end {meta.get('load_end')}",
        f"- command: `{meta.get('command')}`",
        f"- model: llama1b ({meta.get('n_layers')} layers), approx solver; project with "
        "lazy costs, reference with its default cost-building workers", "",
        "| mesh | project wall / RSS (phases s) | reference wall / RSS (phases s) "
        "| speed ratio | memory ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in summary:
        lines.append(f"| {row['mesh']} | {_cell(row['project'], PROJECT_PHASES)} "
                     f"| {_cell(row['reference'], REFERENCE_PHASES)} "
                     f"| {_ratio_cell(row['speed_ratio'], 'faster')} "
                     f"| {_ratio_cell(row['memory_ratio'], 'leaner')} |")
    lines += ["", "speed ratio = reference wall / project wall; memory ratio = reference "
              "peak RSS / project peak RSS (both measured around the child process: "
              "wall to reaped, `ru_maxrss` of `wait4`, reaped descendants included). "
              "Phases in seconds; in-process: from the planner's first import to the end "
              "of the solve (the rest of the wall is interpreter start-up and exit, and "
              "the project's report stage).", ""]
    for row in summary:
        for name in ("project", "reference"):
            side = row[name]
            if side is None or side["wall"] is None:
                continue
            facts = [f"{k} {side[k]}" for k in ("objective", "nodes", "groups",
                                                "graph_nodes", "decision_vars",
                                                "placement_hash") if k in side]
            if side.get("trws"):
                facts.append(f"TRW-S iterations {side['trws'].get('iterations')}")
            facts.append(f"load {', '.join(f'{x:.2f}' for x in side['load'])}")
            lines.append(f"- {row['mesh']} {name}: " + "; ".join(facts))
    return "\n".join(lines) + "\n"


def _write(out: Path, payload: dict[str, Any]) -> None:
    runtime.write_json(out / "vs_reference.json", payload)
    with runtime.atomic_path(out / "vs_reference.md") as tmp:
        tmp.write_text(markdown(payload["summary"], payload["machine"], payload["meta"]),
                       encoding="utf-8")


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/vs_reference.py",
        description="Plan llama1b with this project and with the public reference "
                    "(AutoParallel 8eda68d) side by side; print and write the ratios.")
    p.add_argument("--meshes", default=",".join(DEFAULT_MESHES),
                   help=f"comma list of meshes (default {','.join(DEFAULT_MESHES)})")
    p.add_argument("--repeats", type=int, default=1, help="runs per side and mesh (default 1)")
    p.add_argument("--ref-python", default=None,
                   help="the reference venv's python (default $REF_PYTHON, "
                        "$REF_VENV/bin/python, or setup_reference.sh's default venv)")
    side = p.add_mutually_exclusive_group()
    side.add_argument("--ref-only", action="store_true", help="run the reference only")
    side.add_argument("--project-only", action="store_true", help="run the project only")
    p.add_argument("--n-layers", type=int, default=LLAMA1B_LAYERS,
                   help="transformer blocks of llama1b (default 16)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="kill a run after S seconds (recorded as an error); default none")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench",
                   help="output directory (default results/bench)")
    return p


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        meshes = parse_meshes(args.meshes)
    except ValueError as err:
        return _fail(str(err))
    if args.repeats < 1:
        return _fail(f"--repeats={args.repeats}: allowed integers >= 1")
    if args.n_layers < 1:
        return _fail(f"--n-layers={args.n_layers}: allowed integers >= 1")
    if args.timeout is not None and not args.timeout > 0:
        return _fail(f"--timeout={args.timeout:g}: allowed a number of seconds > 0")
    ref_python = args.ref_python or default_ref_python()
    if not args.project_only and not (Path(ref_python).is_file()
                                      and os.access(ref_python, os.X_OK)):
        return _fail(f"--ref-python={ref_python}: not an executable file; allowed the "
                     "python of the reference venv (run benchmarks/setup_reference.sh)")
    sides = (["project"] if args.project_only else ["reference"] if args.ref_only
             else ["project", "reference"])
    out = args.out.resolve()
    log_dir = out / "logs" / "vs_reference"
    machine = machine_info()
    meta: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/vs_reference.py", *argv]),
        "started": _now(), "load_start": _load(), "meshes": meshes,
        "repeats": args.repeats, "n_layers": args.n_layers, "sides": sides,
        "ref_python": None if args.project_only else ref_python, "complete": False}
    runs: list[dict[str, Any]] = []
    index = 0
    for rep in range(args.repeats):
        for k, mesh in enumerate(meshes):
            order = sides if (rep + k) % 2 == 0 else sides[::-1]
            for side in order:
                index += 1
                print(f"[{index}] {side} mesh={mesh} (repeat {rep + 1}/{args.repeats}, "
                      f"load {_load()[0]:.2f}) ...", file=sys.stderr, flush=True)
                if side == "project":
                    rec = run_project(mesh, args.n_layers, index, log_dir, args.timeout)
                else:
                    rec = run_reference(mesh, args.n_layers, index, ref_python, log_dir,
                                        args.timeout)
                    if rec.get("versions"):
                        meta["reference_versions"] = rec["versions"]
                runs.append(rec)
                status = (f"{rec['wall']:.1f} s, {rec['peak_rss_mib']:.0f} MiB"
                          if rec["ok"] else f"error: {rec['error']}")
                print(f"[{index}] {side} mesh={mesh}: {status}", file=sys.stderr, flush=True)
                meta.update(finished=_now(), load_end=_load(),
                            complete=index == args.repeats * len(meshes) * len(sides))
                _write(out, {"meta": meta, "machine": machine, "runs": runs,
                             "summary": summarise(runs, meshes)})
    summary = summarise(runs, meshes)
    print(markdown(summary, machine, meta), end="")
    print(f"-> {out / 'vs_reference.md'}", file=sys.stderr)
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
