"""Session fixtures every test file may request: the subprocess pool and the shared toy
results (see :mod:`fixtures`, tests/support/, on ``sys.path`` through pyproject.toml's
``pythonpath``), and the order of the session.

The suite runs as one session (``python -m pytest``: one collection, one pool, each toy
run made once), or under pytest-xdist as one session per worker (``-n 2 --dist
loadgroup``, README's command) whose pools share the toy runs and own jobs, each made
once (:mod:`fixtures`). Its order: the quick tests, then the slow ones (marked
``slow``), so that the quick tests' failures show first; in each part, tests that read
background jobs come after the others, so that the jobs (queued when the session
starts, in that order) are made while the other tests run. ``--dist loadgroup`` hands
the workers the tests in that order, one at a time, except that the tests of a module
that share a module- or class-scoped fixture are one group (tests/support/xdist_groups.py,
whose scheduler replaces xdist's own ``loadgroup``), sent to one worker, so that the
fixture's work is done once. Markers are declared in pyproject.toml.

Layout: tests/unit (one module or formula, by hand or against an oracle),
tests/integration (stages together, ``python -m pipeline`` runs, the toy runs),
tests/e2e (Snakemake end to end, the paper, sweeps, SLURM, the benchmark runner),
tests/support (code that is not a test).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fixtures import (
    Jobs,
    ToyResults,
    queue_own_jobs,
    reads_jobs,
    shared_dir,
    toy_configs_of,
    xdist_worker,
)

#: The xdist groups of the tests that share a module- or class-scoped fixture, and their
#: scheduler.
pytest_plugins = ["xdist_groups"]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Quick tests, then slow ones; in each part, the tests that read background jobs
    last (a stable partition: each part keeps the order pytest collected and grouped it
    in). ``trylast``: after pytest's own grouping of parametrized fixtures."""
    def part(item: pytest.Item) -> int:
        return 2 * (item.get_closest_marker("slow") is not None) + reads_jobs(item)

    items.sort(key=part)


@pytest.fixture(scope="session")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    """The session's subprocess pool (``PIPELINE_TEST_WORKERS`` at a time); under xdist
    its jobs are shared with the other workers' pools (:func:`fixtures.shared_dir`)."""
    worker = xdist_worker()
    pool = Jobs(shared=shared_dir(tmp_path_factory) if worker else None, turn=worker)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def toy_results(tmp_path_factory: pytest.TempPathFactory, jobs: Jobs) -> ToyResults:
    """The session's shared toy results. Read-only: copy before writing
    (:meth:`fixtures.ToyResults.copy_run`)."""
    if xdist_worker():  # one directory for every worker (fixtures.shared_dir)
        return ToyResults(shared_dir(tmp_path_factory) / "toy" / "results", jobs)
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
