"""Session fixtures every test file may request: the subprocess pool and the shared toy
results (see :mod:`fixtures`, tests/support/, on ``sys.path`` through pyproject.toml's
``pythonpath``), and the order of the session.

The suite runs as one session (``python -m pytest``: one collection, one pool, each toy
run made once). Its order: the quick tests, then the slow ones (marked ``slow``), so
that the quick tests' failures show first; in each part, tests that read background
jobs come after the others, so that the jobs (queued when the session starts, in that
order) are made while the other tests run. Markers are declared in pyproject.toml.

Layout: tests/unit (one module or formula, by hand or against an oracle),
tests/integration (stages together, ``python -m pipeline`` runs, the toy runs),
tests/e2e (Snakemake end to end, the paper, sweeps, SLURM, the benchmark runner),
tests/support (code that is not a test).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fixtures import Jobs, ToyResults, queue_own_jobs, reads_jobs, toy_configs_of


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Quick tests, then slow ones; in each part, the tests that read background jobs
    last (a stable partition: each part keeps the order pytest collected and grouped it
    in). ``trylast``: after pytest's own grouping of parametrized fixtures."""
    def part(item: pytest.Item) -> int:
        return 2 * (item.get_closest_marker("slow") is not None) + reads_jobs(item)

    items.sort(key=part)


@pytest.fixture(scope="session")
def jobs() -> Iterator[Jobs]:
    """The session's subprocess pool (``PIPELINE_TEST_WORKERS`` at a time)."""
    pool = Jobs()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def toy_results(tmp_path_factory: pytest.TempPathFactory, jobs: Jobs) -> ToyResults:
    """The session's shared toy results. Read-only: copy before writing
    (:meth:`fixtures.ToyResults.copy_run`)."""
    return ToyResults(tmp_path_factory.mktemp("toy") / "results", jobs)


@pytest.fixture(scope="session", autouse=True)
def _start_jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                jobs: Jobs) -> None:
    """At the start of the session, queue every toy config the selected tests declare
    (``toy_runs`` markers) and the test modules' own jobs (``OWN_JOBS``), in the order
    the tests need them, so that the runs are made while earlier tests run."""
    items = request.session.items
    configs = toy_configs_of(items)
    if configs:
        request.getfixturevalue("toy_results").prefetch(configs)
    queue_own_jobs(jobs, items, tmp_path_factory)
