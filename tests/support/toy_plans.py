"""The toy runs the plan checks read (tests/integration/test_lazy_eager.py,
test_cost_evaluator.py, test_plan_validity.py, test_report_tables.py,
test_eager_factors.py): the meshes and cost modes, the overrides and marks of a check,
the runs as the checks see them, and the guard of the eager 2x4x8 run.

The runs are the session's shared ones (``toy_results``, :mod:`fixtures`). The 2x4x8
cases (about a minute per cost mode) are marked ``slow``; ``PIPELINE_TEST_NO_2X4X8=1``
leaves them out.

The guard: should ``pipeline.stages.costs.stage.load_factors`` again keep a copy of the
whole ``factors.npz`` archive per factor (as it did when it indexed the lazy ``np.load``
archive inside its loop), the eager 2x4x8 solve would need ~35 GB and be OOM-killed.
:func:`load_factors_keeps_one_copy` probes a small synthetic MRF (milliseconds) when the
session starts, not at collection: while it fails, the eager 2x4x8 run is not queued and
the checks that read it are skipped, and ``test_eager_factors_load_once`` fails.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fixtures import ToyResults, ToyRun

#: Meshes of the quick checks.
MESHES: list[str] = ["8", "2x4"]
#: The 3-d mesh cases (slow: about a minute per cost mode).
MESHES_2X4X8: list[str] = [] if os.environ.get("PIPELINE_TEST_NO_2X4X8") else ["2x4x8"]
ALL_MESHES: list[str] = MESHES + MESHES_2X4X8
MODES: tuple[str, ...] = ("lazy", "eager")

#: Relative tolerance of two sums of the same terms added in another order.
REL = 1e-9

LOAD_FACTORS_REASON = ("pipeline.stages.costs.stage.load_factors re-reads whole arrays of "
                       "factors.npz for every factor (z['table'] inside the loop), so the "
                       "eager 2x4x8 solve needs tens of GB and is OOM-killed "
                       "(test_eager_factors_load_once)")


def rel_close(a: float, b: float, rel: float = REL) -> bool:
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


def toy_overrides(mesh: str, mode: str) -> tuple[str, ...]:
    """Overrides of the toy run at ``mesh`` with ``mode`` costs (``model=toy`` implied)."""
    return (f"mesh={mesh}", f"lazy_costs={'true' if mode == 'lazy' else 'false'}")


def _guarded(mesh: str, mode: str) -> bool:
    """Whether the run ``(mesh, mode)`` needs the guard (eager factors on 2x4x8)."""
    return mode == "eager" and mesh in MESHES_2X4X8


def run_marks(*runs: tuple[str, str]) -> list[pytest.MarkDecorator]:
    """The marks of a check that reads the shared runs ``(mesh, mode)``: their
    ``toy_runs`` markers (a guarded run queued only when
    :func:`load_factors_keeps_one_copy`), and ``slow`` when one is on a 2x4x8 mesh."""
    plain = [toy_overrides(m, md) for m, md in runs if not _guarded(m, md)]
    guarded = [toy_overrides(m, md) for m, md in runs if _guarded(m, md)]
    marks = [pytest.mark.toy_runs(*plain)] if plain else []
    if guarded:
        marks.append(pytest.mark.toy_runs(*guarded, when=load_factors_keeps_one_copy))
    if any(m in MESHES_2X4X8 for m, _ in runs):
        marks.append(pytest.mark.slow)
    return marks


@dataclass
class Run:
    """One shared toy run as the checks see it: mesh, cost mode and the run itself."""

    mesh: str
    mode: str
    shared: ToyRun

    @property
    def cfg(self) -> Any:
        return self.shared.cfg

    @property
    def dirs(self) -> Any:
        return self.shared.dirs

    @property
    def record(self) -> dict:
        return self.shared.record

    @property
    def plan(self) -> list[dict]:
        """``solution.parquet`` rows, indexed by node id."""
        return self.shared.plan


def get_run(toy: ToyResults, mesh: str, mode: str) -> Run:
    """The shared toy run at ``mesh`` with ``mode`` costs; skips the check when the run is
    guarded and the guard fails."""
    if _guarded(mesh, mode) and not load_factors_keeps_one_copy():
        pytest.skip(LOAD_FACTORS_REASON)
    return Run(mesh, mode, toy.run(*toy_overrides(mesh, mode)))


def topology_of(run: Run) -> Any:
    """The run's topology tables (read once per session)."""
    from pipeline.stages.topology import read_topology

    return run.shared.memo("topology", lambda: read_topology(run.dirs.topology))


def evaluation_of(run: Run) -> Any:
    """The independent evaluation of the run's plan (:mod:`cost_evaluator`; once per
    session)."""
    from cost_evaluator import evaluate_plan

    from pipeline.config.readers import fuse_pointwise_config

    def make() -> Any:
        mesh = tuple(int(m) for m in run.cfg.mesh)
        return evaluate_plan(run.plan, topology_of(run), mesh, run.cfg.hardware,
                             fuse=fuse_pointwise_config(run.cfg))

    return run.shared.memo("evaluation", make)


# --------------------------------------------------------------------------- the guard


def _retained_bytes(arrays: list) -> int:
    """Bytes of the distinct base buffers that ``arrays`` (numpy views) keep alive."""
    roots: dict[int, Any] = {}
    for a in arrays:
        while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
            a = a.base
        roots[id(a)] = a
    return sum(a.nbytes for a in roots.values())


def load_factors_overhead(path: Path) -> float:
    """Bytes kept alive by ``pipeline.stages.costs.stage.load_factors(path)`` over the
    bytes of the factors themselves (1.0 when every array of the archive is held once)."""
    from pipeline.stages.costs.stage import load_factors

    mrf = load_factors(path)
    arrays = list(mrf.unary)
    for e in range(mrf.num_edges):
        f = mrf.factor(e)
        arrays += [f.row_cls, f.col_cls, f.table]
    own = sum(a.nbytes for a in arrays)
    return _retained_bytes(arrays) / max(own, 1)


def probe_load_factors() -> float:
    """``load_factors_overhead`` of a small synthetic chain MRF (30 factors), after
    checking that its factors read back equal."""
    import tempfile

    import numpy as np

    from pipeline.solvers.mrf import MRF, PairwiseFactor
    from pipeline.stages.costs.stage import load_factors, save_factors

    rng = np.random.default_rng(0)
    k, groups = 20, 31
    factors = [PairwiseFactor(np.arange(k, dtype=np.int32), np.arange(k, dtype=np.int32),
                              rng.random((k, k))) for _ in range(groups - 1)]
    mrf = MRF(domain_sizes=np.full(groups, k, dtype=np.int64),
              unary=[rng.random(k) for _ in range(groups)],
              edges=np.array([(g, g + 1) for g in range(groups - 1)], dtype=np.int64),
              factor=factors.__getitem__)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "factors.npz"
        save_factors(path, mrf, factors)
        back = load_factors(path)  # the values read back are the ones written
        assert all(np.array_equal(a, b) for a, b in zip(back.unary, mrf.unary))
        for e, f in enumerate(factors):
            g = back.factor(e)
            assert np.array_equal(g.row_cls, f.row_cls) and np.array_equal(g.col_cls, f.col_cls)
            assert np.array_equal(g.table, f.table)
        return load_factors_overhead(path)


def load_factors_keeps_one_copy() -> bool:
    """Whether ``load_factors`` keeps each array of the archive about once (the probe
    within 2x), so that the eager 2x4x8 solve can run. A probe that raises counts as
    no (the run is not risked); ``test_eager_factors_load_once`` then raises it."""
    try:
        return probe_load_factors() <= 2.0
    except Exception:  # noqa: BLE001 - the guard's answer; the test raises the error
        return False

