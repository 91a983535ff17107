"""Time a Hydra sweep over one cached trace: meshes x solvers x cost modes of a model.

    python benchmarks/sweep.py [--results DIR] [--meshes 8,16,2x8,4x4,8x8] [--model llama1b]

1. ``python -m pipeline.cli trace model=llama1b`` makes the trace (the trace stage
   alone, timed on its own; reused when ``DIR`` already holds a current one).
2. Two sweeps, each one ``python -m pipeline -m`` process (ILP and LP need eager costs,
   so they cannot share the approx sweep's ``lazy_costs`` axis):
   ``mesh=<meshes> solver=approx lazy_costs=true,false`` and
   ``mesh=<meshes> solver=ilp,lp``: 4 points per mesh, 20 for the default 5 meshes.

Each job of a sweep logs ``stages: ...; wall X s`` (its trace, topology, costs and
solve; the sweep writes one report after its last job, logged as ``report of the
sweep``). The script prints a Markdown table of the points (wall per job, from that
line) and the totals: process wall of each sweep (interpreter start, imports and the
final report included) and their sum. Writes ``<DIR>/sweep.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's pipeline, not an installed one
    sys.path.insert(0, str(ROOT))

from pipeline.config.overrides import override_value  # noqa: E402

STAGES_RE = re.compile(r"stages: (?P<stages>.*); wall (?P<wall>[\d.]+) s")
REPORT_RE = re.compile(r"report of the sweep: (?P<s>[\d.]+) s")
RECORD_RE = re.compile(r"^run record: (?P<path>.+)$")  # a path may hold spaces


def run(args: list[str], cwd: Path, module: str = "pipeline") -> tuple[float, str]:
    """Run ``python -m <module> args`` in ``cwd``; (wall seconds, its output: stderr and
    stdout in one stream, unbuffered, so each job's log line precedes its record line)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RunFailed(proc.returncode, proc.stdout)
    return wall, proc.stdout


class RunFailed(Exception):
    """A ``python -m pipeline`` run of the sweep failed: its exit code and output."""

    def __init__(self, code: int, output: str) -> None:
        super().__init__(code)
        self.code, self.output = code, output

    def last_line(self) -> str:
        lines = [ln for ln in self.output.splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit code {self.code}"


def points(log: str, cwd: Path) -> list[tuple[str, float, str]]:
    """(point, wall s, stages) of each job of a sweep's log, in order; the point (mesh,
    solver, cost mode) is read from the job's run record."""
    out, pending = [], None
    for line in log.splitlines():
        m = STAGES_RE.search(line)
        if m:
            pending = (float(m["wall"]), m["stages"])
            continue
        m = RECORD_RE.match(line)
        if m and pending is not None:
            record = json.loads((cwd / m["path"]).read_text())
            mesh = record["mesh"] if isinstance(record["mesh"], str) else "x".join(
                str(s) for s in record["mesh"])
            out.append((f"mesh={mesh} solver={record['solver']} {record['cost_mode']}",
                        *pending))
            pending = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=None,
                    help="results directory (default: a new temporary one)")
    ap.add_argument("--meshes", default="8,16,2x8,4x4,8x8", help="comma list of meshes")
    ap.add_argument("--model", default="llama1b", help="model option (conf/model)")
    args = ap.parse_args()
    results = args.results or Path(tempfile.mkdtemp(prefix="sweep-"))
    made = not results.exists() or not any(results.iterdir())
    results.mkdir(parents=True, exist_ok=True)
    try:
        sweep(args, results)
    except RunFailed as err:  # a bad value: the pipeline's one line, its exit code
        if made and not any(p for p in results.rglob("*") if p.is_file()):
            shutil.rmtree(results)
        print(err.last_line(), file=sys.stderr)
        sys.exit(err.code)


def sweep(args: argparse.Namespace, results: Path) -> None:
    """Make the trace, run the two sweeps, print and write the table."""
    meshes = args.meshes.split(",")
    # a Hydra override: a path with spaces, quotes or ; is quoted (never a shell here)
    common = [f"model={args.model}",
              f"results_dir={override_value(str(results.resolve()), quote='path')}"]
    trace_wall, _ = run(["trace", *common, f"mesh={meshes[0]}"], ROOT, "pipeline.stages.runner")
    sweeps = [[*common, f"mesh={','.join(meshes)}", "solver=approx", "lazy_costs=true,false"],
              [*common, f"mesh={','.join(meshes)}", "solver=ilp,lp"]]
    rows, walls, reports = [], [], []
    for sweep in sweeps:
        wall, log = run(["-m", *sweep], ROOT)
        walls.append(wall)
        rows.extend(points(log, ROOT))
        reports.extend(float(m["s"]) for m in REPORT_RE.finditer(log))
    lines = ["| # | point | job wall s | stages |", "| --: | --- | --: | --- |"]
    for k, (point, wall, stages) in enumerate(rows, start=1):
        lines.append(f"| {k} | {point} | {wall:.2f} | {stages} |")
    jobs = sum(w for _, w, _ in rows)
    lines += ["", f"- points: {len(rows)}; trace (first run, not in the sweeps): "
              f"{trace_wall:.1f} s",
              f"- jobs: {jobs:.1f} s in total, {jobs / max(len(rows), 1):.2f} s per point "
              f"(max {max((w for _, w, _ in rows), default=0):.2f} s)",
              f"- the sweeps' reports (one per sweep): "
              f"{', '.join(f'{r:.1f} s' for r in reports)}",
              f"- process wall of the {len(sweeps)} sweeps: "
              f"{' + '.join(f'{w:.1f}' for w in walls)} = {sum(walls):.1f} s"]
    text = "\n".join(lines) + "\n"
    (results / "sweep.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
