"""Session fixtures every test file may request: the subprocess pool and the shared toy
results (see :mod:`fixtures`), and the order of the session: tests that read background
jobs run after the others, so that the jobs (queued at session start) are made while
the other tests run. Markers are declared in pyproject.toml."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fixtures import Jobs, ToyResults, queue_own_jobs, reads_jobs, toy_configs_of


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that read background jobs last (a stable partition: each part keeps the
    order pytest collected it in)."""
    items[:] = [i for i in items if not reads_jobs(i)] + [i for i in items if reads_jobs(i)]


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
