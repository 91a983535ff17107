"""Benchmark runner: ``python -m pipeline.bench [--suite NAME] [--out DIR] [--only REGEX]
[--dry-run] [--fresh] [--timeout S]``.

    python -m pipeline.bench --suite smoke --fresh        # toy model, about a minute
    python -m pipeline.bench --suite search --only 'mesh=8 '
    python -m pipeline.bench --suite solvers --dry-run    # list the cases, run nothing
    snakemake bench --config suite=big                    # the same, through Snakemake

A *suite* is a named list of *cases*; a case is a list of Hydra overrides, exactly what
``python -m pipeline`` takes. The suites are data in this module (:data:`SUITES`):

``search`` (default)
    llama1b on meshes 8, 8x8 and 2x4x8, approx, lazy and eager costs; then a depth sweep
    of the llama1b shapes at ``model.n_layers`` 2, 4, 8, 32, 64 on 2x4x8, lazy. The
    16-layer point of the sweep is the ``mesh=2x4x8 ... lazy_costs=true`` case (the same
    resolved config, so it is not run twice).
``solvers``
    llama1b on meshes 8, 8x8, 2x4x8 with approx, ILP/HiGHS and ILP/CBC (600 s limit).
``big``
    llama8b and llama70b on 2x4x8, approx, lazy costs.
``smoke``
    the toy model on meshes 8 and 2x4: approx lazy, approx eager, ILP (HiGHS). Fast; run
    by ``tests/test_bench.py``.
``models``
    transformers architectures beside the built-in model on 2x4x8, approx, lazy:
    llama1b, ``hf/gpt2`` (GPT-2 small, 12 layers) and ``hf/qwen2`` (Qwen2-0.5B, 24
    layers), real shapes. Before the cases the import of transformers is timed on its
    own (:data:`IMPORT_PROBES`, fresh processes, after ``import torch``), since every
    ``hf`` trace pays it.

Each case runs in a fresh process, ``python -m pipeline <overrides>
results_dir=<dir>``, with this checkout first on ``PYTHONPATH``. The runner measures

* ``wall``: wall-clock seconds around the process (start to reaped);
* ``cpu``: user + system CPU seconds of the process and its waited-for children;
* ``peak_rss_mib``: peak resident set size of the process tree (``ru_maxrss`` from
  ``os.wait4`` on the child: the largest of the child and its waited-for descendants,
  such as a CBC subprocess; KiB on Linux);

records ``code``, a hash of the stage sources on disk when the case starts (a suite
may outlive a commit: rows with different ``code`` ran different code), and reads
everything else from the case's run record (``run.json`` in
``stage_dirs(load_resolved(overrides)).solve``): phase seconds (``trace``, ``topology``,
``cost_build``, ``factor_build``, ``solve``, ``search_total``; the phase names of
:data:`pipeline.cli.PHASES`),
counts, objective, lower bound, gap, status, placement hash.

Results directory: with ``--fresh`` every case gets an empty results directory of its
own, ``<out>/fresh/<suite>/<NN>-<case>/`` (emptied first), so nothing is reused and
every phase is measured in that process. Without it all cases of all suites share
``<out>/results/``; a stage whose artifact is current is reused, its phase time is the
one recorded in the artifact when it was computed, and the ``reused`` column names the
reused stages (a stage counts as reused when its artifact's mtime did not change).

Outputs, rewritten atomically after every case (so a long suite can be watched):
``<out>/<suite>.parquet`` (one row per case; schema metadata ``pipeline`` holds the
machine, versions, git revision, command, units and ``complete``) and ``<out>/<suite>.md``
(a Markdown table under a header with the same facts). The stdout and stderr of each
case are kept in ``<out>/logs/<suite>/<NN>-<case>.{stdout,stderr}.log``.

A case that exits non-zero (or is killed by ``--timeout``) gets a row with status
``Error`` and the last line of its stderr; the runner goes on with the next case and
exits with 1 at the end. Ctrl-C or SIGTERM kills the running case (it runs in its own
process group), records it as ``Error`` (interrupted), keeps the tables and exits with
130 / 143. A bad ``--suite`` or ``--only`` prints one line and exits 2.
Progress: one line per case on stderr; on a terminal also a bar over the cases
(pipeline/progress.py). The cases run with ``PIPELINE_PROGRESS=0``: no bars in their logs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import progress, runtime
from pipeline.artifacts import RUN, SENTINELS

__all__ = ["COLUMNS", "SUITES", "Case", "Suite", "machine_info", "main", "run_case",
           "run_suite"]

# --------------------------------------------------------------------------- suites


@dataclass(frozen=True)
class Case:
    """One benchmark case: Hydra overrides for ``python -m pipeline``."""

    overrides: tuple[str, ...]

    @property
    def label(self) -> str:
        """The overrides joined by single spaces (what ``--only`` matches)."""
        return " ".join(self.overrides)

    @property
    def slug(self) -> str:
        """A file-name-safe form of the label (used for log and results directories)."""
        text = self.label.replace("=", "-").replace(" ", "_")
        return re.sub(r"[^A-Za-z0-9._-]", "", text)[:120]


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    cases: tuple[Case, ...]
    imports: tuple[str, ...] = ()  # keys of IMPORT_PROBES timed before the cases


def _suite(name: str, description: str, rows: Sequence[str],
           imports: tuple[str, ...] = ()) -> Suite:
    return Suite(name, description, tuple(Case(tuple(r.split())) for r in rows), imports)


#: Import probes: the statements a trace of the family runs before building a model,
#: timed in a fresh process after ``import torch`` (which every case pays anyway).
IMPORT_PROBES: dict[str, str] = {
    "transformers": ("import transformers; from transformers import AutoConfig, "
                     "AutoModelForCausalLM, AttentionInterface; "
                     "from transformers.masking_utils import AttentionMaskInterface"),
}


def import_seconds(name: str, repeats: int = 3) -> float | None:
    """Fastest of ``repeats`` fresh-process timings of :data:`IMPORT_PROBES` ``[name]``
    (seconds), ``None`` if the import fails (the package is not installed)."""
    script = ("import time, torch\nt = time.perf_counter()\n" + IMPORT_PROBES[name]
              + "\nprint(time.perf_counter() - t)")
    best = None
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        if proc.returncode != 0:
            return None
        seconds = float(proc.stdout.strip().splitlines()[-1])
        best = seconds if best is None else min(best, seconds)
    return best


_LLAMA1B_MESHES = ("8", "8x8", "2x4x8")

#: The benchmark suites (see the module docstring). Keys are always written in the order
#: model, model.*, mesh, solver, solver.*, lazy_costs, so ``--only 'mesh=8 '`` selects
#: mesh 8 and not 8x8.
SUITES: dict[str, Suite] = {s.name: s for s in (
    _suite("search", "llama1b search time by mesh and cost mode, and by depth",
           [f"model=llama1b mesh={m} solver=approx lazy_costs={lazy}"
            for m in _LLAMA1B_MESHES for lazy in ("true", "false")]
           # depth sweep; n_layers=16 is the mesh=2x4x8 lazy case above
           + [f"model=llama1b model.n_layers={n} mesh=2x4x8 solver=approx lazy_costs=true"
              for n in (2, 4, 8, 32, 64)]),
    _suite("solvers", "approx vs exact ILP (HiGHS, CBC) on llama1b",
           [f"model=llama1b mesh={m} {s}" for m in _LLAMA1B_MESHES for s in (
               "solver=approx",
               "solver=ilp solver.backend=highs solver.time_limit_s=600",
               "solver=ilp solver.backend=cbc solver.time_limit_s=600")]),
    _suite("big", "llama8b and llama70b on 2x4x8, approx, lazy costs",
           [f"model={m} mesh=2x4x8 solver=approx lazy_costs=true"
            for m in ("llama8b", "llama70b")]),
    _suite("smoke", "toy model, meshes 8 and 2x4: approx lazy / eager, ILP (fast; tested)",
           [f"model=toy mesh={m} {s}" for m in ("8", "2x4") for s in (
               "solver=approx lazy_costs=true",
               "solver=approx lazy_costs=false",
               "solver=ilp solver.backend=highs")]),
    _suite("models", "issue 11: transformers architectures (GPT-2 small, Qwen2-0.5B) beside "
           "llama1b on 2x4x8, approx, lazy costs",
           [f"model={m} mesh=2x4x8 solver=approx lazy_costs=true"
            for m in ("llama1b", "hf/gpt2", "hf/qwen2")], imports=("transformers",)),
)}

DEFAULT_SUITE = "search"

# --------------------------------------------------------------------------- columns

#: Output columns: (Parquet name, Arrow type name, Markdown header or None if the column
#: is left out of the Markdown table). Phase columns use the phase names of the run record
#: (:data:`pipeline.cli.PHASES`).
COLUMNS: tuple[tuple[str, str, str | None], ...] = (
    ("case_index", "int32", "#"),
    ("case", "string", None),
    ("model", "string", "model"),
    ("n_layers", "int32", "layers"),
    ("mesh", "string", "mesh"),
    ("solver", "string", "solver"),
    ("backend", "string", "backend"),
    ("cost_mode", "string", "cost mode"),
    ("nodes", "int64", "nodes"),
    ("groups", "int64", "groups"),
    ("group_strategies", "int64", "strategies"),
    ("factors_materialised", "int64", "factors"),
    ("trace", "float64", "trace s"),
    ("topology", "float64", "topology s"),
    ("cost_build", "float64", "cost_build s"),
    ("factor_build", "float64", "factor_build s"),
    ("solve", "float64", "solve s"),
    ("search_total", "float64", "search_total s"),
    ("wall", "float64", "wall s"),
    ("cpu", "float64", "cpu s"),
    ("peak_rss_mib", "float64", "peak RSS MiB"),
    ("objective", "float64", "objective µs"),
    ("lower_bound", "float64", "lower bound µs"),
    ("gap", "float64", "gap"),
    ("status", "string", "status"),
    ("placement_hash", "string", "placement hash"),
    ("time_limit_s", "float64", "time limit s"),
    ("reused", "string", "reused"),
    ("code", "string", "code"),
    ("revision", "string", None),
    ("exit_code", "int32", None),
    ("error", "string", None),
    ("load_1m", "float64", None),
    ("run_record", "string", None),
)

PHASE_COLUMNS = ("trace", "topology", "cost_build", "factor_build", "solve", "search_total")

UNITS = {
    "trace": "s", "topology": "s", "cost_build": "s", "factor_build": "s", "solve": "s",
    "search_total": "s (trace through solve, as recorded in run.json)",
    "wall": "s (process, measured by the runner)",
    "cpu": "s (user + system of the process tree)",
    "peak_rss_mib": "MiB (ru_maxrss of the process tree via os.wait4)",
    "objective": "µs", "lower_bound": "µs", "time_limit_s": "s",
    "load_1m": "1-minute load average when the case started",
    "code": "hash of the stage sources when the case started (see code_hash)",
    "revision": "git revision of the run record (+dirty: uncommitted changes)",
}

#: Sentinel file of each stage a case makes (whether a stage was reused: its mtime).
_SENTINELS = {stage: name for stage, name in SENTINELS.items() if stage != "report"}

# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, memory, OS and versions (Markdown header, Parquet metadata)."""
    env = runtime.environment()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    return {"cpu_model": env["cpu_model"], "cpu_count": env["cpu_count"],
            "usable_cores": usable, "memory_bytes": mem, "platform": env["platform"],
            "python": env["python"], "torch": env["torch"], "highspy": env["highspy"],
            "pulp": env["pulp"], "numpy": env["numpy"], "git": runtime.git_revision()}


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _load_1m() -> float | None:
    try:
        return float(os.getloadavg()[0])
    except OSError:
        return None


# --------------------------------------------------------------------------- one case


def _tail(path: Path) -> str:
    """The last non-empty line of a log file (at most 300 characters)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.strip():
            return line.strip()[:300]
    return ""


def _mtimes(dirs: Any) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for stage, name in _SENTINELS.items():
        try:
            out[stage] = (Path(dirs.of(stage)) / name).stat().st_mtime_ns
        except OSError:
            out[stage] = None
    return out


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env[progress.ENV_VAR] = "0"  # a case's stderr is a log file: no progress bars in it
    root = str(runtime.PROJECT_ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _measure(cmd: list[str], stdout: Path, stderr: Path, timeout: float | None
             ) -> tuple[int, float, float, float, bool]:
    """Run ``cmd`` in its own process group; return (exit code, wall s, cpu s, peak RSS
    bytes, timed out). The exit code is ``-signal`` for a killed process."""
    scale = 1 if sys.platform == "darwin" else 1024
    timed_out = threading.Event()
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=_child_env(), start_new_session=True)

        lock = threading.Lock()
        reaped = False

        def on_timeout() -> None:
            with lock:  # never signal a group whose leader was already reaped
                if not reaped:
                    timed_out.set()
                    _kill_group(proc.pid)

        timer = threading.Timer(timeout, on_timeout) if timeout else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            with lock:
                reaped = True
        except BaseException:  # KeyboardInterrupt: do not leave the case running
            _kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code  # reaped here, not by Popen
    return (code, wall, usage.ru_utime + usage.ru_stime, float(usage.ru_maxrss * scale),
            timed_out.is_set())


def code_hash() -> str:
    """12 hex digits over the source hashes of the trace, topology, costs and solve stages
    (:func:`pipeline.config.stage_code_hash`) as they are on disk when a case starts: rows
    with different values ran different code (the checkout may change during a suite)."""
    import hashlib

    from pipeline.config import stage_code_hash

    text = ",".join(stage_code_hash(st) for st in ("trace", "topology", "costs", "solve"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _empty_row() -> dict[str, Any]:
    return {name: None for name, _, _ in COLUMNS}


def run_case(case: Case, index: int, results_dir: Path, log_dir: Path,
             timeout: float | None = None) -> dict[str, Any]:
    """Run one case in a fresh process and return its row (see :data:`COLUMNS`)."""
    from pipeline.config import ConfigError, load_resolved, override_value, stage_dirs

    overrides = [*case.overrides, f"results_dir={override_value(str(results_dir), quote='path')}"]
    row = _empty_row()
    row.update(case_index=index, case=case.label, load_1m=_load_1m(), code=code_hash())
    cfg = dirs = None
    try:
        cfg = load_resolved(overrides)
        dirs = stage_dirs(cfg)
    except ConfigError:
        pass  # the child fails with the same one-line message; recorded below
    if cfg is not None:
        s = cfg.solver
        row.update(model=str(cfg.model.name), n_layers=cfg.model.get("n_layers"),
                   mesh="x".join(str(m) for m in cfg.mesh), solver=str(s.name),
                   backend=str(s.backend) if s.name != "approx" else None,
                   cost_mode="lazy" if cfg.lazy_costs else "eager",
                   time_limit_s=None if s.time_limit_s is None else float(s.time_limit_s))
    before = _mtimes(dirs) if dirs is not None else {}
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{index:02d}-{case.slug}"
    out_log, err_log = log_dir / f"{stem}.stdout.log", log_dir / f"{stem}.stderr.log"
    cmd = [sys.executable, "-m", "pipeline", *overrides]
    code, wall, cpu, rss, timed_out = _measure(cmd, out_log, err_log, timeout)
    row.update(exit_code=code, wall=wall, cpu=cpu, peak_rss_mib=rss / 2**20)

    error = None
    record = None
    if timed_out:
        error = f"timeout after {timeout:g} s (killed); {_tail(err_log)}"
    elif code != 0:
        what = (f"killed by {signal.Signals(-code).name}" if code < 0
                else f"exit {code}")
        error = f"{what}: {_tail(err_log)}"
    elif dirs is None:
        error = "the case's config does not resolve, but the process succeeded"
    else:
        path = RUN.path(dirs.solve)
        try:
            record = json.loads(path.read_text())
            row["run_record"] = str(path)
        except (OSError, ValueError) as err:
            error = f"cannot read {path}: {err}"
    if error is not None:
        row.update(status="Error", error=error)
        return row

    after = _mtimes(dirs)
    row["reused"] = ",".join(st for st in _SENTINELS
                             if before.get(st) is not None and before[st] == after.get(st))
    git = record.get("git") or {}
    if git.get("revision"):
        row["revision"] = git["revision"][:12] + ("+dirty" if git.get("dirty") else "")
    counts = record.get("counts", {})
    phases = record.get("phases", {})
    fm = counts.get("factors_materialised")
    row.update(
        model=record.get("model", row["model"]), mesh=record.get("mesh", row["mesh"]),
        # depth from the graph (repeated blocks), whatever the model family
        n_layers=(record.get("model_info") or {}).get("layers", row["n_layers"]),
        solver=record.get("solver", row["solver"]),
        backend=record.get("backend", row["backend"]),
        cost_mode=record.get("cost_mode", row["cost_mode"]),
        nodes=counts.get("nodes"), groups=counts.get("groups"),
        group_strategies=counts.get("group_strategies"),
        factors_materialised=fm.get("total") if isinstance(fm, dict) else fm,
        objective=record.get("objective"), lower_bound=record.get("lower_bound"),
        gap=record.get("gap"), status=record.get("status"),
        placement_hash=record.get("placement_hash"),
        **{k: phases.get(k) for k in PHASE_COLUMNS})
    return row


# --------------------------------------------------------------------------- outputs


def _table(rows: list[dict[str, Any]]) -> Any:
    import pyarrow as pa

    types = {"int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(),
             "string": pa.string()}
    schema = pa.schema([(name, types[t]) for name, t, _ in COLUMNS])
    data = {name: [r.get(name) for r in rows] for name, _, _ in COLUMNS}
    return pa.table(data, schema=schema)


def _fmt_cell(name: str, value: Any) -> str:
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if name == "placement_hash":
        return str(value)[:12]
    if name == "gap":
        return f"{value:.2e}" if value else "0"
    if name in ("objective", "lower_bound"):
        return f"{value:.3f}"
    if name == "peak_rss_mib":
        return f"{value:.0f}"
    if name == "time_limit_s":
        return f"{value:g}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value).replace("|", "\\|")


def _fmt_load(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _markdown(suite: Suite, rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    git = m.get("git") or {}
    mem = f", {m['memory_bytes'] / 2**30:.1f} GiB RAM" if m.get("memory_bytes") else ""
    rev = (git.get("revision") or "unknown")[:10] + (" (dirty)" if git.get("dirty") else "")
    mode = ("fresh results directory per case (nothing reused)" if meta["fresh"]
            else f"shared results directory {meta['results_dir']} (reuse allowed; "
                 "reused phases as recorded in the artifacts)")
    status = ("complete" if meta["complete"]
              else f"in progress: {len(rows)} of {meta['cases']} cases")
    lines = [
        f"# Benchmark `{suite.name}`",
        "",
        f"{suite.description}.",
        "",
        f"- machine: {m['cpu_model']}, {m['cpu_count']} logical CPUs "
        f"({m['usable_cores']} usable){mem}; {m['platform']}",
        f"- versions: python {m['python']}, torch {m['torch']}, highspy {m['highspy']}, "
        f"pulp {m['pulp']}; git {rev}",
        f"- command: `{meta['command']}`; {mode}",
        f"- started {meta['started']}, {status}"
        + (f" at {meta['finished']}" if meta.get("finished") else "")
        + f"; 1-min load average {_fmt_load(meta['load_start'])} at start, "
        f"{_fmt_load(meta.get('load_end'))} at end",
        "- times in seconds (phases as recorded in each run.json; `wall` and `cpu` of the "
        "process measured by the runner), peak RSS of the process tree in MiB "
        "(os.wait4), objective and bound in µs, gap relative",
    ]
    for name, seconds in (meta.get("import_seconds") or {}).items():
        shown_s = "not installed" if seconds is None else f"{seconds:.2f} s"
        lines.append(f"- import of {name} (fresh process after `import torch`, fastest of "
                     f"3; paid by every trace of the family): {shown_s}")
    lines += [
        "",
    ]
    shown = [(name, header) for name, _, header in COLUMNS if header is not None]
    lines.append("| " + " | ".join(h for _, h in shown) + " |")
    text_columns = ("model", "mesh", "solver", "backend", "cost_mode", "status",
                    "placement_hash", "reused", "code")
    lines.append("|" + "|".join("---" if n in text_columns else "--:" for n, _ in shown)
                 + "|")
    for r in rows:
        lines.append("| " + " | ".join(_fmt_cell(n, r.get(n)) for n, _ in shown) + " |")
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["", "Errors:", ""]
        lines += [f"- #{r['case_index']} `{r['case']}`: {r['error']}" for r in errors]
    lines += ["", "Cases:", ""]
    lines += [f"- #{r['case_index']} `{r['case']}`" for r in rows]
    return "\n".join(lines) + "\n"


def _write_outputs(out: Path, suite: Suite, rows: list[dict[str, Any]],
                   meta: dict[str, Any]) -> None:
    runtime.write_parquet(out / f"{suite.name}.parquet", _table(rows), metadata=meta)
    with runtime.atomic_path(out / f"{suite.name}.md") as tmp:
        tmp.write_text(_markdown(suite, rows, meta), encoding="utf-8")


# --------------------------------------------------------------------------- suite


def _progress(index: int, total: int, row: dict[str, Any]) -> str:
    if row["status"] == "Error":
        return f"Error ({row['wall']:.1f} s): {row['error']}"
    text = (f"{row['status']}, objective {row['objective']:.3f}, wall {row['wall']:.1f} s, "
            f"cpu {row['cpu']:.1f} s, search_total {(row['search_total'] or 0):.1f} s, "
            f"peak {row['peak_rss_mib']:.0f} MiB")
    if row.get("reused"):
        text += f", reused {row['reused']}"
    return text


def run_suite(suite: Suite, selected: list[tuple[int, Case]], out: Path, fresh: bool,
              timeout: float | None = None, command: str = "") -> int:
    """Run the selected ``(index, case)`` pairs of ``suite`` one after another; write the
    outputs after every case. Returns 0 if every case succeeded, else 1."""
    out = out.resolve()
    shared = out / "results"
    meta: dict[str, Any] = {
        "suite": suite.name, "description": suite.description, "command": command,
        "fresh": fresh, "results_dir": None if fresh else str(shared),
        "cases": len(selected), "complete": False,
        "started": _now(),
        "load_start": _load_1m(), "machine": machine_info(), "units": UNITS,
        "import_seconds": {name: import_seconds(name) for name in suite.imports},
    }
    rows: list[dict[str, Any]] = []
    failed = 0
    n = len(selected)
    # On a terminal a bar over the cases (pipeline/progress.py), the per-case lines
    # printed above it; elsewhere each line is written in two parts, as the case runs.
    cases_bar = progress.bar(total=n, desc=f"bench {suite.name}", unit="case", delay=0)
    for k, (index, case) in enumerate(selected, 1):
        head = f"[{k}/{n}] #{index} {case.label}: "
        if cases_bar.disable:
            print(head, end="", file=sys.stderr, flush=True)
        else:
            cases_bar.set_postfix_str(f"#{index} {case.label}")
        if fresh:
            results_dir = out / "fresh" / suite.name / f"{index:02d}-{case.slug}"
            if results_dir.exists():
                shutil.rmtree(results_dir)
            results_dir.mkdir(parents=True)
        else:
            results_dir = shared
        try:
            row = run_case(case, index, results_dir, out / "logs" / suite.name, timeout)
        except (KeyboardInterrupt, SystemExit):  # the case's process group is killed
            row = _empty_row()
            row.update(case_index=index, case=case.label, status="Error",
                       error="interrupted (the runner was stopped)")
            rows.append(row)
            if not cases_bar.disable:  # the head of the line was not printed yet
                cases_bar.close()
                print(head, end="", file=sys.stderr)
            print("interrupted", file=sys.stderr, flush=True)
            meta["finished"], meta["load_end"] = _now(), _load_1m()
            _write_outputs(out, suite, rows, meta)
            raise
        failed += row["status"] == "Error"
        rows.append(row)
        if cases_bar.disable:
            print(_progress(k, n, row), file=sys.stderr, flush=True)
        else:
            cases_bar.write(head + _progress(k, n, row), file=sys.stderr)
            cases_bar.update()
        meta["complete"] = k == n
        meta["finished"] = _now()
        meta["load_end"] = _load_1m()
        _write_outputs(out, suite, rows, meta)
    cases_bar.close()
    print(f"{suite.name}: {n - failed} of {n} cases ok -> {out / (suite.name + '.md')}",
          file=sys.stderr)
    return 1 if failed else 0


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.bench",
        description="Run a benchmark suite, one fresh `python -m pipeline` process per "
                    "case; write <out>/<suite>.parquet and <out>/<suite>.md.")
    p.add_argument("--suite", default=DEFAULT_SUITE,
                   help=f"one of {', '.join(SUITES)} (default {DEFAULT_SUITE})")
    p.add_argument("--out", default="results/bench", type=Path,
                   help="output directory (default results/bench)")
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="run the cases whose overrides, joined by spaces and followed by "
                        "one space, match REGEX (re.search), e.g. 'mesh=8 '")
    p.add_argument("--dry-run", action="store_true",
                   help="list the selected cases and their commands; run nothing")
    p.add_argument("--fresh", action="store_true",
                   help="an empty results directory per case: nothing is reused")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="kill a case after S seconds (recorded as Error); default none")
    return p


def _fail(message: str) -> int:
    print(" ".join(message.split()), file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pipeline.bench``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.suite not in SUITES:
        return _fail(f"--suite={args.suite}: allowed {', '.join(SUITES)}")
    if args.timeout is not None and not args.timeout > 0:
        return _fail(f"--timeout={args.timeout:g}: allowed a number of seconds > 0")
    suite = SUITES[args.suite]
    try:
        pattern = re.compile(args.only) if args.only is not None else None
    except re.error as err:
        return _fail(f"--only={args.only}: not a regular expression ({err})")
    selected = [(i, c) for i, c in enumerate(suite.cases, 1)
                if pattern is None or pattern.search(c.label + " ")]
    if not selected:
        return _fail(f"--only={args.only}: matches none of the {len(suite.cases)} cases of "
                     f"suite {suite.name} (see --dry-run without --only)")
    out = Path(args.out)
    if args.dry_run:
        return _dry_run(suite, selected, out.resolve(), args.fresh)
    command = shlex.join(["python", "-m", "pipeline.bench", *argv])
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return run_suite(suite, selected, out, args.fresh, args.timeout, command)
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (e.g. from Snakemake or a batch system) stops the runner like Ctrl-C: the
    running case, which is in its own process group, is killed and the tables are kept."""
    raise SystemExit(128 + signum)


def _dry_run(suite: Suite, selected: list[tuple[int, Case]], out: Path, fresh: bool) -> int:
    """Print one line per selected case (index, then the command); validate each config."""
    from pipeline.config import ConfigError, load_resolved, override_value

    bad = 0
    for index, case in selected:
        results_dir = (out / "fresh" / suite.name / f"{index:02d}-{case.slug}" if fresh
                       else out / "results")
        overrides = [*case.overrides,
                     f"results_dir={override_value(str(results_dir), quote='path')}"]
        note = ""
        try:
            load_resolved(overrides)
        except ConfigError as err:
            note, bad = f"   # invalid: {err}", bad + 1
        print(f"#{index:<3d}python -m pipeline {shlex.join(overrides)}{note}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
