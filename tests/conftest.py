"""Session fixtures every test file may request: the subprocess pool and the shared toy
results (see :mod:`fixtures`). Markers are declared in pyproject.toml."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fixtures import Jobs, ToyResults, queue_own_jobs, toy_configs_of


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
