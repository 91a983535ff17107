"""What the test files share: the session's toy-model results, the subprocess pool that
makes them, an in-process Snakemake runner, and the toy model's parameter shapes.

Toy results (:class:`ToyResults`, the ``toy_results`` fixture of ``conftest.py``): one
results directory per pytest session holds the traces, topologies, costs and solves of
the toy configs the tests read. Each run is made once, by a process that runs the
stages trace .. solve of ``model=toy <overrides> results_dir=<shared>`` as ``python -m
pipeline`` does (:data:`RUN_SCRIPT`; ``PYTHONHASHSEED`` fixed; a fork of a warm
interpreter that has imported the pipeline once, :mod:`warm`), and every test file
that needs it reads the same artifacts. A run is one job whatever its spelling: the job's key
is the run's resolved solve directory, so ``mesh=2x4`` and ``mesh=2x4
mesh_names=[dp,tp]`` are one job. The report over the shared directory is not made (no
test reads it: a test that needs a report makes its own over copies of the runs). Runs
share stages through the pipeline's own cache, so the whole session traces the toy
model once, builds one topology per mesh and one cost directory per (mesh, cost mode).

Background jobs: a test declares the configs it reads with the ``toy_runs`` marker,
e.g. ``@pytest.mark.toy_runs(("mesh={mesh}", "lazy_costs=true"))``, where ``{name}`` is
filled from the test's parameters (``when=<callable>``: queued only if it returns true
at the start of the session); a test module may also declare subprocesses of its own
(``OWN_JOBS``, :func:`queue_own_jobs`). At the start of the session (conftest.py) every
job of the selected tests is queued in the session's pool (:class:`Jobs`,
:func:`pool_size` at a time, in the order the tests need them), and the tests that read
jobs run after the others, so that the jobs are made while the other tests run. A
config nobody declared is made on first use.

The shared directory is read-only for tests: a test that writes (a stage rerun, a
corrupted artifact, its own report) works on a copy (:meth:`ToyResults.copy_run`) or
in a fresh directory of its own.

Under pytest-xdist (``-n 2``, docs/development.md) each worker process is a session of
its own with its own pool (:func:`pool_size` subprocesses: 1 under xdist, so that two
workers and their pools do not oversubscribe the machine), but the toy results and the
modules' own jobs live in one directory shared by the workers (:func:`shared_dir`,
named after the xdist test-run uid), and a job is made once for all of them: a worker
runs a job under a file lock keyed by the job, writes its result (stdout, stderr,
seconds) next to the lock, and a worker that comes second reads it (:class:`Jobs`).
Each worker queues every declared job (it cannot know which tests it will be sent), the
workers taking turns first (worker ``i`` of ``n`` starts with the jobs whose rank is
``i`` modulo ``n``), so that while one worker makes a job the other makes another.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import heapq
import io
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from warm import WarmPython

#: tests/support (on sys.path: pyproject.toml ``pythonpath``) and the checkout above it.
SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
SNAKEFILE = ROOT / "workflow" / "Snakefile"

#: Priority added to the jobs that are another xdist worker's turn (above any test index).
OTHER_TURN = 1e9
#: Safety net per subprocess, seconds.
JOB_TIMEOUT = float(os.environ.get("PIPELINE_TEST_JOB_TIMEOUT", "1200"))
#: PYTHONHASHSEED of the shared runs.
SEED = "1"
#: The stages of one run, in order (the report aggregates runs; it is not copied).
RUN_STAGES = ("trace", "topology", "costs", "solve")
#: A toy job: ``python -c RUN_SCRIPT <results_dir> <overrides...>`` runs the stages of
#: :data:`RUN_STAGES` of ``model=toy <overrides>`` as ``python -m pipeline`` does
#: (``pipeline.__main__.run_pipeline``), without the report over the results directory.
RUN_SCRIPT = """
import sys
from pipeline.__main__ import run_pipeline
from pipeline.config import load_resolved
from pipeline.stages.runner import configure_logging
configure_logging()
results_dir, *overrides = sys.argv[1:]
run_pipeline(load_resolved(["model=toy", *overrides, f"results_dir={results_dir}"]),
             report=False)
"""
#: What the warm interpreter of the toy jobs imports once (:class:`Jobs`): the pipeline's
#: entry point and its stages.
WARM_MODULES = ("pipeline.__main__", "pipeline.stages.runner", "pipeline.stages.trace.stage",
                "pipeline.stages.topology", "pipeline.stages.costs.stage",
                "pipeline.stages.solve.stage")

# Parameter shapes of the toy model, in elements (float32 storage).
TOY_PARAMS = (
    [1024 * 256]  # tok_embeddings
    + 2 * [256, 256 * 256, 128 * 256, 128 * 256, 256 * 256, 256, 768 * 256, 256 * 768,
           768 * 256]  # per layer: norms, wq, wk, wv, wo, w1, w2, w3
    + [256, 1024 * 256]  # final norm, output
)



def xdist_worker() -> tuple[int, int] | None:
    """(index, count) of this pytest-xdist worker (``gw<index>`` of ``count``), or None
    outside xdist (the environment variables xdist sets in its workers)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not name.startswith("gw") or count is None:
        return None
    return int(name[2:]), int(count)


def pool_size() -> int:
    """Concurrent pipeline subprocesses of a session's pool: ``PIPELINE_TEST_WORKERS``,
    else 2 (the machine has 2 cores), 1 per worker under xdist (two workers, each with
    its own pool)."""
    default = "1" if xdist_worker() else "2"
    return int(os.environ.get("PIPELINE_TEST_WORKERS", default))


def serial_under_xdist(overrides: Sequence[str]) -> list[str]:
    """``["workers=1"]`` for a pool job under xdist (two workers, each with its pool
    process, already fill two cores; ``workers=0`` would add a process per CPU to
    each), unless ``overrides`` set ``workers``; else nothing. ``workers`` does not enter
    a run's directories (tests/unit/test_config.py) nor its plan."""
    if xdist_worker() is None or any(o.startswith("workers=") for o in overrides):
        return []
    return ["workers=1"]


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory the session's toy results and own jobs live in: the session's base
    temporary directory, or under xdist one directory that every worker of the test run
    shares: ``shared-<uid>`` (the first 12 characters of the test-run uid xdist hands
    its workers) beside the workers' own base directories, inside the controller's, so
    that pytest removes it with them after a passing run."""
    base = tmp_path_factory.getbasetemp()
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if xdist_worker() is None or not uid:
        return base
    path = base.parent / f"shared-{uid[:12]}"
    path.mkdir(exist_ok=True)
    return path


#: Where each background job made in this test run is logged, one JSON line (key, wall
#: and CPU seconds, the xdist worker): ``PIPELINE_TEST_JOBS_LOG``, set by ``.ci/run``,
#: which prints the slowest beside pytest's ``--durations`` (the jobs' time is spent in
#: the background, so no test's duration shows it). Unset: no log.
JOBS_LOG_ENV = "PIPELINE_TEST_JOBS_LOG"


def log_job(key: str, seconds: float, cpu_s: float | None = None) -> None:
    """Append one job to the jobs log (:data:`JOBS_LOG_ENV`) when one is set."""
    path = os.environ.get(JOBS_LOG_ENV)
    if path:
        line = json.dumps({"key": key, "seconds": round(seconds, 2),
                           "cpu_s": None if cpu_s is None else round(cpu_s, 2),
                           "worker": os.environ.get("PYTEST_XDIST_WORKER", "")})
        with open(path, "a") as fh:  # one short write per line: O_APPEND keeps lines whole
            fh.write(line + "\n")


def _logged(result: JobResult) -> JobResult:
    log_job(result.key, result.seconds, result.cpu_s)
    return result


def child_env(seed: str) -> dict[str, str]:
    """The environment of a background job: this process's, with this checkout first on
    ``PYTHONPATH`` (so the job imports the code under test), ``PYTHONHASHSEED=seed``,
    and no ``PIPELINE_PROGRESS`` (a job's stderr is a pipe: it draws no bars)."""
    from pipeline.core.progress import ENV_VAR

    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONHASHSEED"] = seed
    return env


def snakemake(workdir: Path, *args: str) -> tuple[int, str, str]:
    """Run Snakemake on the project's Snakefile in this process; (exit code, stdout,
    stderr). In-process keeps dry runs fast; the working directory is restored."""
    from snakemake.cli import main

    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    code: int = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(["--snakefile", str(SNAKEFILE), "--directory", str(workdir), *args])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------- subprocesses


@dataclass
class JobResult:
    key: str
    stdout: str
    stderr: str
    seconds: float
    cpu_s: float | None = None  # user + system CPU seconds (None: not measured)

    def tagged(self, tag: str) -> Any:
        """The JSON printed after ``tag`` on stdout."""
        for line in self.stdout.splitlines():
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        raise AssertionError(f"job {self.key}: no '{tag}' line on stdout:\n{self.stdout[-2000:]}")


class Jobs:
    """Subprocesses of the session, each once per key, run ``workers`` at a time in
    order of priority (the index of the first test that needs the job; a job a test
    waits for goes first). A ``warm`` job (``python -c <script> <args>``, the session's
    hash seed) runs as a fork of the worker's warm interpreter (:mod:`warm`), which has
    imported :data:`WARM_MODULES` once.

    ``shared``: a directory the pools of other processes (xdist workers) share; a job
    then runs under the lock ``<shared>/jobs/<hash of key>.lock`` and its result is
    kept in ``<hash of key>.json`` beside it, which a pool that comes second reads
    instead of running the job. ``turn``: ``(index, count)`` of this worker; the jobs
    queued with a finite priority are ranked in the order they are first queued, and
    those of rank ``r`` with ``r % count != index`` wait for the others
    (:data:`OTHER_TURN`)."""

    def __init__(self, workers: int | None = None, shared: Path | None = None,
                 turn: tuple[int, int] | None = None) -> None:
        workers = pool_size() if workers is None else workers
        self._shared = None if shared is None else shared / "jobs"
        if self._shared is not None:
            self._shared.mkdir(parents=True, exist_ok=True)
        self._turn = turn
        self._ranked = 0
        self.futures: dict[str, Future] = {}
        self._specs: dict[str, tuple[list[str], Path, str, bool]] = {}
        self._warm: dict[int, WarmPython] = {}  # worker thread id -> its warm interpreter
        self._started: set[str] = set()
        self._queue: list[tuple[float, int, str]] = []  # heap of (priority, seq, key)
        self._seq = itertools.count()
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._cv = threading.Condition()
        self._threads = [threading.Thread(target=self._work, daemon=True)
                         for _ in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, key: str, argv: Sequence[str], cwd: Path, seed: str = SEED,
               priority: float = -math.inf, warm: bool = False) -> None:
        """Queue ``argv`` under ``key`` (a key runs once; submitting it again can only
        raise its priority). ``warm``: ``argv`` is ``[python, "-c", script, *args]``,
        run in a warm interpreter (``seed`` must be :data:`SEED`)."""
        if warm and (seed != SEED or list(argv[1:2]) != ["-c"]):
            raise ValueError(f"job {key}: a warm job is python -c with seed {SEED}")
        with self._cv:
            if key not in self.futures:
                self.futures[key] = Future()
                self._specs[key] = (list(argv), cwd, seed, warm)
                if self._turn is not None and math.isfinite(priority):
                    index, count = self._turn
                    if self._ranked % count != index:
                        priority += OTHER_TURN
                    self._ranked += 1
            if key not in self._started:
                heapq.heappush(self._queue, (priority, next(self._seq), key))
                self._cv.notify()

    def result(self, key: str) -> JobResult:
        """The finished job ``key`` (moved to the front and waited for); AssertionError
        if it failed."""
        if key not in self._specs:
            raise KeyError(f"job {key} was never queued")
        argv, cwd, seed, warm = self._specs[key]
        self.submit(key, argv, cwd, seed, warm=warm)
        return self.futures[key].result()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                _, _, key = heapq.heappop(self._queue)
                if key in self._started:
                    continue
                self._started.add(key)
            future = self.futures[key]
            try:
                future.set_result(self._run_once(key))
            except BaseException as err:  # noqa: BLE001 - handed to the test that waits
                future.set_exception(err)

    def _run_once(self, key: str) -> JobResult:
        """Job ``key``, or under a shared directory the result another pool made of it
        (the job runs under its lock and its result is written before the lock is let
        go; a job that failed leaves no result, and the next pool runs it again)."""
        if self._shared is None:
            return self._run(key, *self._specs[key])
        name = hashlib.sha256(key.encode()).hexdigest()[:20]
        done = self._shared / f"{name}.json"
        with self._shared_lock(key, self._shared / f"{name}.lock"):
            if done.exists():
                return JobResult(**json.loads(done.read_text()))
            result = self._run(key, *self._specs[key])
            tmp = done.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(vars(result)))
            os.replace(tmp, done)
            return result

    @contextlib.contextmanager
    def _shared_lock(self, key: str, path: Path) -> Any:
        """Hold ``fcntl.flock`` on ``path``; polled, so that a pool closed meanwhile stops
        waiting (AssertionError)."""
        with open(path, "a") as fh:
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if self._closed:
                        raise AssertionError(f"job {key}: the pool was closed") from None
                    time.sleep(0.2)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _run(self, key: str, argv: list[str], cwd: Path, seed: str, warm: bool) -> JobResult:
        if warm:
            return self._run_warm(key, argv, cwd)
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=child_env(seed), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        with self._cv:
            self._procs.append(proc)
            if self._closed:  # closed while this one was starting
                proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired as err:
            proc.kill()
            proc.communicate()
            raise AssertionError(f"job {key} timed out after {JOB_TIMEOUT:.0f} s: "
                                 f"{' '.join(argv[:8])}") from err
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise AssertionError(
                f"job {key} failed (exit {proc.returncode}) after {seconds:.0f} s: "
                f"{' '.join(argv[:10])}\n--- stderr (tail) ---\n{stderr[-4000:]}")
        return _logged(JobResult(key, stdout, stderr, seconds))

    def _run_warm(self, key: str, argv: list[str], cwd: Path) -> JobResult:
        """``argv`` (``python -c script *args``) in this worker's warm interpreter."""
        start = time.perf_counter()
        with self._cv:
            if self._closed:
                raise AssertionError(f"job {key}: the pool was closed")
            server = self._warm.get(threading.get_ident())
            if server is None:
                server = WarmPython(child_env(SEED), list(WARM_MODULES))
                self._warm[threading.get_ident()] = server
        out = server.run(argv[2], argv[3:], cwd, JOB_TIMEOUT)
        seconds = time.perf_counter() - start
        if out.timed_out:
            raise AssertionError(f"job {key} timed out after {JOB_TIMEOUT:.0f} s: "
                                 f"{' '.join(argv[3:11])}")
        if out.returncode != 0:
            raise AssertionError(
                f"job {key} failed (exit {out.returncode}) after {seconds:.0f} s: python -c "
                f"<script> {' '.join(argv[3:11])}\n--- stderr (tail) ---\n{out.stderr[-4000:]}")
        return _logged(JobResult(key, out.stdout, out.stderr, seconds, out.cpu_s))

    def close(self) -> None:
        """Drop the jobs not started; stop the ones still running (a test failed early)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            for proc in self._procs:
                if proc.poll() is None:
                    proc.terminate()
            servers = list(self._warm.values())
        for server in servers:
            server.close()
        for t in self._threads:
            t.join()


# --------------------------------------------------------------------------- toy results


@dataclass
class ToyRun:
    """One toy run of the shared directory: the overrides it was first asked for, its
    resolved config, stage directories, run record and plan (``solution.parquet`` rows,
    indexed by node id), and what tests derive from it (:meth:`memo`)."""

    overrides: tuple[str, ...]
    cfg: Any
    dirs: Any
    record: dict
    plan: list[dict]
    seconds: float
    derived: dict[str, Any] = field(default_factory=dict, repr=False)

    def memo(self, name: str, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per run and session under ``name`` (the run is
        read-only, so what is derived from it stays valid)."""
        if name not in self.derived:
            self.derived[name] = make()
        return self.derived[name]

    def solution(self) -> Any:
        """``solution.parquet`` as a pandas DataFrame."""
        import pandas as pd

        return pd.read_parquet(Path(self.dirs.solve) / "solution.parquet")


class ToyResults:
    """The session's shared toy results under ``root`` (see the module docstring)."""

    def __init__(self, root: Path, jobs: Jobs) -> None:
        self.root = root
        self.jobs = jobs
        self.cwd = root.parent
        self.cwd.mkdir(parents=True, exist_ok=True)  # the jobs' working directory
        self._resolved: dict[tuple[str, ...], Any] = {}  # spelling -> resolved config
        self._runs: dict[str, ToyRun] = {}  # job key -> the finished run

    def cfg(self, *overrides: str, results_dir: Path | None = None) -> Any:
        """The resolved config of ``model=toy <overrides>`` in ``results_dir`` (default:
        the shared directory, each spelling resolved once)."""
        from pipeline.config import load_resolved

        if results_dir is not None:
            return load_resolved(["model=toy", *overrides, f"results_dir={results_dir}"])
        if overrides not in self._resolved:
            self._resolved[overrides] = load_resolved(
                ["model=toy", *overrides, f"results_dir={self.root}"])
        return self._resolved[overrides]

    def key(self, overrides: Sequence[str]) -> str:
        """The job key of a config: its resolved solve directory, relative to the shared
        directory (every spelling of one run is one job)."""
        from pipeline.config import stage_dirs

        solve = Path(stage_dirs(self.cfg(*overrides)).solve)
        return "toy " + str(solve.relative_to(self.root))

    def prefetch(self, configs: Iterable[tuple[float, Sequence[str]]]) -> None:
        """Queue ``(priority, overrides)`` configs (see :class:`Jobs` for the order)."""
        for priority, overrides in configs:
            self.jobs.submit(self.key(overrides),
                             [sys.executable, "-c", RUN_SCRIPT, str(self.root),
                              *overrides, *serial_under_xdist(overrides)],
                             self.cwd, priority=priority, warm=True)

    def run(self, *overrides: str) -> ToyRun:
        """The finished run of ``model=toy <overrides>`` (made now if nobody started it)."""
        import pyarrow.parquet as pq

        from pipeline.config import stage_dirs

        key = self.key(overrides)
        if key not in self._runs:
            self.prefetch([(-math.inf, overrides)])
            res = self.jobs.result(key)
            cfg = self.cfg(*overrides)
            dirs = stage_dirs(cfg)
            record = json.loads((Path(dirs.solve) / "run.json").read_text())
            rows = pq.read_table(Path(dirs.solve) / "solution.parquet").to_pylist()
            rows.sort(key=lambda r: r["node"])
            assert [r["node"] for r in rows] == list(range(len(rows)))
            self._runs[key] = ToyRun(overrides, cfg, dirs, record, rows, res.seconds)
        return self._runs[key]

    def copy_run(self, dest: Path, *overrides: str, upto: str = "solve") -> Any:
        """Copy the artifacts of stages ``trace`` .. ``upto`` of one shared run into the
        results directory ``dest`` (each stage directory's own files, modification times
        and code stamps kept, so the pipeline there reuses them as current); return the
        run's stage directories under ``dest``."""
        from pipeline.config import stage_dirs

        src = self.run(*overrides).dirs
        dst = stage_dirs(self.cfg(*overrides, results_dir=dest))
        for stage in RUN_STAGES[:RUN_STAGES.index(upto) + 1]:
            out = Path(dst.of(stage))
            out.mkdir(parents=True, exist_ok=True)
            for path in Path(src.of(stage)).iterdir():
                if path.is_file() and path.name != ".lock":
                    shutil.copy2(path, out / path.name)
        return dst


def own_jobs_dir(tmp_path_factory: pytest.TempPathFactory, module: str) -> Path:
    """The session's directory for the own jobs of test module ``module`` (in
    :func:`shared_dir`: under xdist, the same for every worker)."""
    path = shared_dir(tmp_path_factory) / f"own-jobs-{module}"
    path.mkdir(exist_ok=True)
    return path


def queue_own_jobs(jobs: Jobs, items: Sequence[pytest.Item],
                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """Queue the own subprocesses of the test modules of ``items``, each at the index of
    the first selected test that reads it. A module declares them with ``OWN_JOBS``
    (job key -> names of the tests that read it) and ``own_job_argv(key, base)`` ->
    ``(argv, PYTHONHASHSEED)``, ``base`` being :func:`own_jobs_dir` of the module (the
    job's working directory)."""
    for i, item in enumerate(items):
        module = item.module
        own = getattr(module, "OWN_JOBS", None)
        if own is None:
            continue
        name = getattr(item, "originalname", item.name)
        for key, tests in own.items():
            if name in tests:
                base = own_jobs_dir(tmp_path_factory, module.__name__)
                argv, seed = module.own_job_argv(key, base)
                jobs.submit(key, argv, base, seed=seed, priority=i)


def reads_jobs(item: pytest.Item) -> bool:
    """Whether ``item`` reads a background job: a ``toy_runs`` marker, or a test its
    module's ``OWN_JOBS`` names."""
    if item.get_closest_marker("toy_runs"):
        return True
    name = getattr(item, "originalname", item.name)
    return any(name in tests for tests in getattr(item.module, "OWN_JOBS", {}).values())


def toy_configs_of(items: Sequence[pytest.Item]) -> list[tuple[int, tuple[str, ...]]]:
    """(index of the test, config) of every config the ``toy_runs`` markers of ``items``
    declare, parameters filled in; tests that are skipped or not run declare none, and
    neither does a marker whose ``when()`` is false."""
    out = []
    for i, item in enumerate(items):
        xfail = item.get_closest_marker("xfail")
        if item.get_closest_marker("skip") or (xfail and xfail.kwargs.get("run") is False):
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        for mark in item.iter_markers("toy_runs"):
            when = mark.kwargs.get("when")
            if when is not None and not when():
                continue
            for config in mark.args:
                out.append((i, tuple(o.format(**params) for o in config)))
    return out


def traced_topology(tmp: Path, model: dict, mesh: tuple[int, ...],
                    names: tuple[str, ...], constraints: dict | None = None) -> Any:
    """Trace ``model`` (a model config dict) and build its topology on ``mesh`` named
    ``names`` (forward/backward consistency on, repeated layers grouped, and any other
    ``constraints`` entries), written to and read back from ``tmp``: the topology tables
    the cost-model tests start from."""
    import math

    from pipeline.stages.topology import (
        build_topology,
        device_mesh,
        load_nodes,
        read_topology,
        write_topology,
    )
    from pipeline.stages.trace.stage import trace_model

    table, _ = trace_model(model, math.prod(mesh))
    topo = build_topology(load_nodes(table), device_mesh(mesh, names), mesh, names,
                          {"fwd_bwd_consistency": True, **(constraints or {})}, True)
    write_topology(topo, tmp, {"stage": "topology"})
    return read_topology(tmp)


def dtensor_planned(redistributions: list[dict], mesh_shape: tuple[int, ...],
                    mesh_names: list[str]) -> Any:
    """Counter of the collectives DTensor's own ``redistribute`` issues for the rows of a
    run's ``redistributions.parquet``: a row's ``collectives`` as they are, except that a
    collective over a flattened group (``all_gather(dp+tp)``, priced as FSDP2 runs it)
    is replaced by the per-mesh-dim steps of DTensor's planner for that row's
    placements (tests/support/dtensor_reference.py), which is what a plan executed with DTensor
    runs."""
    import collections

    from dtensor_reference import DTensorReference

    from pipeline.dtensor.placements import parse_placements

    reference = DTensorReference()
    planned: collections.Counter = collections.Counter()
    for row in redistributions:
        if not any("+" in c for c in row["collectives"]):
            planned.update(row["collectives"])
            continue
        src = parse_placements(row["src_placement"], len(mesh_shape))
        dst = parse_placements(row["dst_placement"], len(mesh_shape))
        steps = reference.plan(src, dst, tuple(mesh_shape), tuple(row["shape"]))
        planned.update(f"{st.kind}({mesh_names[st.mesh_dim]})" for st in steps
                       if st.is_collective and mesh_shape[st.mesh_dim] > 1)
    return planned
