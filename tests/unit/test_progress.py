"""Progress bars (pipeline/core/progress.py): drawn on a terminal, silent everywhere else,
``PIPELINE_PROGRESS`` overrides, and bars never change a result.

A "terminal" is either a text buffer whose ``isatty()`` says True (in-process checks) or a
real pseudo-terminal on the stderr of a child process (the end-to-end check).
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from fixtures import SEED, own_jobs_dir
from mrf_gen import random_edges, random_mrf

from pipeline.core import progress
from pipeline.solvers.lagrangian import row_value, solve_with_row
from pipeline.solvers.mrf import MRF, LinearConstraint, PairwiseFactor
from pipeline.solvers.trws import solve_trws
from pipeline.tools import bench

ROOT = Path(__file__).resolve().parents[2]


class FakeTerminal(io.StringIO):
    """A text buffer that claims to be a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def auto(monkeypatch):
    """No override in the environment; bars drawn at once and on every update."""
    monkeypatch.delenv(progress.ENV_VAR, raising=False)
    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.setattr(progress, "MININTERVAL", 0.0)


def _stderr(monkeypatch, stream: io.StringIO) -> io.StringIO:
    """Make ``stream`` sys.stderr (inside the test: pytest resets it between phases)."""
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


@pytest.mark.parametrize("value, tty, expected", [
    (None, True, True), (None, False, False), ("", True, True), ("auto", False, False),
    ("1", False, True), ("yes", False, True), ("ON", False, True), ("true", False, True),
    ("0", True, False), ("off", True, False), ("False", True, False), ("no", True, False),
    ("maybe", True, True), ("maybe", False, False),
])
def test_enabled_follows_the_terminal_unless_overridden(monkeypatch, value, tty, expected):
    if value is None:
        monkeypatch.delenv(progress.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(progress.ENV_VAR, value)
    stream = FakeTerminal() if tty else io.StringIO()
    assert progress.enabled(stream) is expected


def test_enabled_is_false_for_a_closed_or_odd_stream(monkeypatch):
    monkeypatch.delenv(progress.ENV_VAR, raising=False)
    closed = io.StringIO()
    closed.close()  # isatty() now raises ValueError
    assert progress.enabled(closed) is False
    assert progress.enabled(object()) is False


def test_bar_draws_on_a_terminal(auto, monkeypatch):
    terminal = _stderr(monkeypatch, FakeTerminal())
    assert list(progress.bar(range(300), desc="topology: strategies", unit="node")) == list(
        range(300))
    out = terminal.getvalue()
    assert "topology: strategies" in out and "300/300" in out


def test_bar_is_silent_without_a_terminal(auto, monkeypatch):
    pipe = _stderr(monkeypatch, io.StringIO())
    assert list(progress.bar(range(300), desc="topology: strategies")) == list(range(300))
    with progress.CallbackBar("solve: Lagrangian") as cb:
        cb.update_to(3, "lambda=1")
    assert pipe.getvalue() == ""


def test_forced_bar_draws_into_a_pipe(auto, monkeypatch):
    pipe = _stderr(monkeypatch, io.StringIO())
    monkeypatch.setenv(progress.ENV_VAR, "1")
    list(progress.bar(range(5), desc="costs: factors"))
    assert "costs: factors" in pipe.getvalue()


def test_a_phase_shorter_than_the_delay_draws_nothing(auto, monkeypatch):
    terminal = _stderr(monkeypatch, FakeTerminal())
    monkeypatch.setattr(progress, "DELAY", 60.0)
    list(progress.bar(range(1000), desc="costs: factors"))
    assert terminal.getvalue() == ""


def _problem(seed: int = 3) -> MRF:
    rng = np.random.default_rng(seed)
    return random_mrf(rng, 40, random_edges(rng, 40, 90), kmax=6)


def test_trws_bar_shows_bound_best_and_gap_and_changes_nothing(auto, monkeypatch):
    terminal = _stderr(monkeypatch, FakeTerminal())
    mrf = _problem()
    plain = solve_trws(mrf, max_iters=30, tol=0.0)
    assert terminal.getvalue() == ""
    with progress.BoundProgress(30) as cb:
        shown = solve_trws(mrf, max_iters=30, tol=0.0, progress=cb)
    out = terminal.getvalue()
    assert "solve: TRW-S" in out and "bound=" in out and "best=" in out and "gap=" in out
    assert f"{shown.iterations}/30" in out
    assert np.array_equal(plain.labels, shown.labels)
    assert plain.objective == shown.objective and plain.lower_bound == shown.lower_bound
    assert plain.bound_history == shown.bound_history


def test_trws_bar_is_silent_without_a_terminal(auto, monkeypatch):
    pipe = _stderr(monkeypatch, io.StringIO())
    with progress.BoundProgress(30) as cb:
        solve_trws(_problem(), max_iters=30, progress=cb)
    assert pipe.getvalue() == ""


def _chain(unary: list[list[float]], tables: list[np.ndarray]) -> MRF:
    n = len(unary)
    edges = np.array([[g, g + 1] for g in range(n - 1)], dtype=np.int64).reshape(-1, 2)
    factors = [PairwiseFactor(np.arange(t.shape[0], dtype=np.int32),
                              np.arange(t.shape[1], dtype=np.int32), t) for t in tables]
    return MRF(domain_sizes=np.array([len(u) for u in unary]),
               unary=[np.array(u) for u in unary], edges=edges, factor=factors.__getitem__)


def test_lagrangian_reports_every_inner_solve_and_changes_nothing():
    rng = np.random.default_rng(1)
    n = 6
    mrf = _chain([list(rng.uniform(0, 10, 3)) for _ in range(n)],
                 [rng.uniform(0, 5, (3, 3)) for _ in range(n - 1)])
    # Cheapest labels are the expensive ones for the row: a multiplier search is needed.
    mrf.unary = [u - np.array([20.0, 0.0, 0.0]) for u in mrf.unary]
    row = LinearConstraint("budget", {g: np.array([1.0, 0.5, 0.25]) for g in range(n)},
                           low=0.0, high=3.0)

    def inner(m: MRF):
        return solve_trws(m, max_iters=50)

    calls: list[tuple] = []
    res = solve_with_row(mrf, row, inner, progress=lambda *a: calls.append(a))
    plain = solve_with_row(mrf, row, inner)
    assert res.extra["inner_solves"] >= 2 and len(calls) == res.extra["inner_solves"]
    assert [c[0] for c in calls] == list(range(1, len(calls) + 1))
    assert calls[0][1] == 0.0 and calls[0][3] is False  # unpenalised first solve breaks it
    assert any(c[3] for c in calls)
    assert row_value(row, res.labels) <= row.high + 1e-9
    assert np.array_equal(res.labels, plain.labels) and res.objective == plain.objective
    assert res.lower_bound == plain.lower_bound


# --------------------------------------------------------------------------- end to end


_PIPELINE_SCRIPT = textwrap.dedent("""
    import sys
    from pipeline.core import progress
    progress.DELAY = 0.0  # the toy's phases end before the default delay
    from pipeline.stages.runner import run_pipeline
    from pipeline.config import load_resolved
    for lazy in ("false", "true"):
        run_pipeline(load_resolved(["model=toy", "mesh=2x4", f"lazy_costs={lazy}",
                                    f"results_dir={sys.argv[1]}"]))
""")

BAR_NAMES = ("topology: strategies", "costs: factors", "solve: factors (lazy)",
             "solve: TRW-S")


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != progress.ENV_VAR}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    return env


def _run_on_terminal(results: Path) -> tuple[int, str]:
    """Run the toy pipeline with a pseudo-terminal as stderr; return (code, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:  # keep reading so the child never blocks on a full terminal
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run([sys.executable, "-c", _PIPELINE_SCRIPT, str(results)],
                              cwd=results.parent, env=_child_env(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=slave, timeout=600)
    finally:
        os.close(slave)
        reader.join(timeout=30)
        os.close(master)
    return proc.returncode, b"".join(chunks).decode("utf-8", "replace")


def _results(results: Path) -> list[tuple]:
    from pipeline.config import load_resolved, stage_dirs

    out = []
    for lazy in ("false", "true"):
        cfg = load_resolved(["model=toy", "mesh=2x4", f"lazy_costs={lazy}",
                             f"results_dir={results}"])
        record = json.loads((Path(stage_dirs(cfg).solve) / "run.json").read_text())
        out.append((record["objective"], record["lower_bound"], record["placement_hash"]))
    return out


#: The same runs with stderr a pipe: a background job of the session (tests/support/fixtures.py,
#: which leaves PIPELINE_PROGRESS out of a job's environment, as _child_env does).
OWN_JOBS = {"progress-pipe": (
    "test_pipeline_shows_bars_on_a_terminal_only_and_the_plan_is_the_same",)}


def own_job_argv(key: str, base: Path) -> tuple[list[str], str]:
    assert key == "progress-pipe", key
    return [sys.executable, "-c", _PIPELINE_SCRIPT, str(base / "pipe")], SEED


@pytest.mark.slow
def test_pipeline_shows_bars_on_a_terminal_only_and_the_plan_is_the_same(tmp_path, jobs,
                                                                        tmp_path_factory):
    code, err = _run_on_terminal(tmp_path / "tty")
    assert code == 0, err[-3000:]
    for name in BAR_NAMES:
        assert name in err, (name, err[-3000:])
    assert "bound=" in err and "gap=" in err

    proc = jobs.result("progress-pipe")  # exit 0, or AssertionError with its stderr
    assert proc.stderr == "", proc.stderr[-3000:]  # not a terminal: no bar, nothing
    pipe = own_jobs_dir(tmp_path_factory, __name__) / "pipe"
    assert _results(tmp_path / "tty") == _results(pipe)


def test_bad_input_stays_one_line_with_bars_forced(tmp_path):
    env = _child_env()
    env[progress.ENV_VAR] = "1"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "mesh=2,0,8"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "mesh=2,0,8: allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 "
        "or 8)"]
    assert not any(tmp_path.iterdir())


def test_bench_draws_a_bar_over_the_cases_on_a_terminal(tmp_path, monkeypatch, auto):
    terminal = _stderr(monkeypatch, FakeTerminal())
    monkeypatch.setenv(progress.ENV_VAR, "1")  # must not reach the cases
    assert bench._child_env()[progress.ENV_VAR] == "0"
    broken = bench.Suite("broken", "one failing case", (bench.Case(("model=toy", "mesh=0")),))
    monkeypatch.setitem(bench.SUITES, "broken", broken)
    assert bench.main(["--suite", "broken", "--out", str(tmp_path / "b")]) == 1
    out = terminal.getvalue()
    assert "bench broken" in out and "1/1" in out
    assert "[1/1] #1 model=toy mesh=0: Error (" in out  # the case's line, above the bar
    log = next((tmp_path / "b" / "logs" / "broken").glob("*.stderr.log")).read_text()
    assert log.strip().splitlines() == [
        "mesh=0: allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)"]
