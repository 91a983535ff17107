"""A pytest plugin (``pytest_plugins`` of tests/conftest.py): under pytest-xdist with
``--dist loadgroup``, the tests of a module that share a module-, class- or
package-scoped fixture (directly, or through another test that shares one with each)
are one ``xdist_group``, which xdist runs on one worker, so that the fixture's work
(a Snakemake sweep, a model's pipeline runs) is done once. A session fixture's work is
shared between the workers through files instead (:mod:`fixtures`). Outside an xdist
worker it does nothing (the ``xdist_group`` mark is xdist's).
"""

from __future__ import annotations

import pytest

#: Fixture scopes whose work the tests that share them should not do twice (a session
#: fixture's work is shared through files, :mod:`fixtures`).
_SHARED_SCOPES = ("package", "module", "class")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker, mark the tests of a module that share a module-, class- or
    package-scoped fixture (directly or through another test) with one ``xdist_group``:
    ``--dist loadgroup`` runs a group on one worker. ``tryfirst``: before xdist reads the
    marks. A test's own ``xdist_group`` mark is kept."""
    if not hasattr(config, "workerinput"):
        return
    parent: dict[str, str] = {}  # union-find over "<module>::<fixture>" and node ids

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    shared: dict[str, list[str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.get_closest_marker("xdist_group"):
            continue
        module = item.nodeid.split("::")[0]
        names = [f"{module}::{name}" for name, defs in info.name2fixturedefs.items()
                 if defs and defs[-1].scope in _SHARED_SCOPES]
        if names:
            shared[item.nodeid] = names
            for name in names:
                parent[find(name)] = find(item.nodeid)
    group: dict[str, str] = {}  # root -> the first fixture of its component, by name
    for names in shared.values():
        for name in names:
            root = find(name)
            group[root] = min(group.get(root, name), name)
    for item in items:
        if item.nodeid in shared:
            item.add_marker(pytest.mark.xdist_group(group[find(item.nodeid)]))
