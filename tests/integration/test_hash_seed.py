"""The placement hash does not depend on ``PYTHONHASHSEED``: ``python -m pipeline`` of the
toy at mesh 2x4 (lazy costs), run in a process of its own with another hash seed and
its own results directory, gives the objective, the placement hash and the plan of the
session's shared run (made with :data:`fixtures.SEED`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fixtures import SEED, Jobs, ToyResults, own_jobs_dir
from toy_plans import get_run, toy_overrides

#: PYTHONHASHSEED of the rerun of 2x4 (the shared runs: fixtures.SEED).
SEED_OTHER = "2"
assert SEED_OTHER != SEED

#: This file's own subprocess (fixtures.queue_own_jobs): key -> the tests that read it.
OWN_JOBS: dict[str, tuple[str, ...]] = {
    "hashseed": ("test_placement_hash_independent_of_hash_seed",),
}


def own_job_argv(key: str, base: Path) -> tuple[list[str], str]:
    """(argv, PYTHONHASHSEED) of own job ``key``, writing under ``base``."""
    assert key == "hashseed", key
    return [sys.executable, "-m", "pipeline", "model=toy", *toy_overrides("2x4", "lazy"),
            f"results_dir={base / 'hashseed'}"], SEED_OTHER


@pytest.fixture(scope="module")
def own_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base directory of this file's own jobs."""
    return own_jobs_dir(tmp_path_factory, __name__)


@pytest.mark.toy_runs(toy_overrides("2x4", "lazy"))
def test_placement_hash_independent_of_hash_seed(toy_results: ToyResults, jobs: Jobs,
                                                 own_jobs: Path) -> None:
    from pipeline.config import stage_dirs

    main = get_run(toy_results, "2x4", "lazy")  # PYTHONHASHSEED=SEED
    jobs.result("hashseed")  # PYTHONHASHSEED=SEED_OTHER, its own results_dir
    cfg = toy_results.cfg(*toy_overrides("2x4", "lazy"), results_dir=own_jobs / "hashseed")
    other_dir = stage_dirs(cfg).solve
    assert other_dir != main.dirs.solve
    other = json.loads((other_dir / "run.json").read_text())
    assert other["placement_hash"] == main.record["placement_hash"]
    assert other["objective"] == main.record["objective"]
    rows = pq.read_table(other_dir / "solution.parquet").to_pylist()
    rows.sort(key=lambda r: r["node"])
    strip = [(r["name"], r["output_placement"], r["input_placements"]) for r in rows]
    assert strip == [(r["name"], r["output_placement"], r["input_placements"])
                     for r in main.plan]
