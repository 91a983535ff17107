"""Benchmark runner: one case in a fresh process (:func:`run_case`), a suite case by case
(:func:`run_suite`).

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
:data:`pipeline.stages.runner.PHASES`),
counts, objective, lower bound, gap, status, placement hash.

Results directory: with ``--fresh`` every case gets an empty results directory of its
own, ``<out>/fresh/<suite>/<NN>-<case>/`` (emptied first), so nothing is reused and
every phase is measured in that process. Without it all cases of all suites share
``<out>/results/``; a stage whose artifact is current is reused, its phase time is the
one recorded in the artifact when it was computed, and the ``reused`` column names the
reused stages (a stage counts as reused when its artifact's mtime did not change).

A case that exits non-zero (or is killed by ``--timeout``) gets a row with status
``Error`` and the last line of its stderr; the runner goes on with the next case and
returns 1 at the end. Ctrl-C or SIGTERM kills the running case (it runs in its own
process group), records it as ``Error`` (interrupted), keeps the tables and re-raises
(exit codes: :mod:`pipeline.tools.bench.cli`).
Progress: one line per case on stderr; on a terminal also a bar over the cases
(pipeline/core/progress.py). The cases run with ``PIPELINE_PROGRESS=0``: no bars in their logs.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.core import progress, runtime
from pipeline.core.artifacts import RUN, SENTINELS
from pipeline.tools.bench.suites import IMPORT_PROBES, Case, Suite
from pipeline.tools.bench.table import PHASE_COLUMNS, UNITS, _empty_row, _write_outputs

__all__ = ["code_hash", "import_seconds", "load_1m", "machine_info", "now_utc", "run_case",
           "run_suite"]

#: Sentinel file of each stage a case makes (whether a stage was reused: its mtime).
_SENTINELS = {stage: name for stage, name in SENTINELS.items() if stage != "report"}


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


def now_utc() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def load_1m() -> float | None:
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


def run_case(case: Case, index: int, results_dir: Path, log_dir: Path,
             timeout: float | None = None) -> dict[str, Any]:
    """Run one case in a fresh process and return its row (see :data:`COLUMNS`)."""
    from pipeline.config import ConfigError, load_resolved, override_value, stage_dirs

    overrides = [*case.overrides, f"results_dir={override_value(str(results_dir), quote='path')}"]
    row = _empty_row()
    row.update(case_index=index, case=case.label, load_1m=load_1m(), code=code_hash())
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
        additive_status=record.get("additive_status"), step_time_us=record.get("step_time_us"),
        step_time_lower_bound_us=record.get("step_time_lower_bound_us"),
        step_time_gap=record.get("step_time_gap"),
        placement_hash=record.get("placement_hash"),
        **{k: phases.get(k) for k in PHASE_COLUMNS})
    return row



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
        "started": now_utc(),
        "load_start": load_1m(), "machine": machine_info(), "units": UNITS,
        "import_seconds": {name: import_seconds(name) for name in suite.imports},
    }
    rows: list[dict[str, Any]] = []
    failed = 0
    n = len(selected)
    # On a terminal a bar over the cases (pipeline/core/progress.py), the per-case lines
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
            meta["finished"], meta["load_end"] = now_utc(), load_1m()
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
        meta["finished"] = now_utc()
        meta["load_end"] = load_1m()
        _write_outputs(out, suite, rows, meta)
    cases_bar.close()
    print(f"{suite.name}: {n - failed} of {n} cases ok -> {out / (suite.name + '.md')}",
          file=sys.stderr)
    return 1 if failed else 0
