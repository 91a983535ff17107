"""A pytest plugin (``pytest_plugins`` of tests/conftest.py): under pytest-xdist with
``--dist loadgroup``, the tests of a module that share a module-, class- or
package-scoped fixture (directly, or through another test that shares one with each)
are one group, which runs on one worker, so that the fixture's work (a Snakemake
sweep, a model's pipeline runs) is done once. A session fixture's work is shared
between the workers through files instead (:mod:`fixtures`). Outside xdist it does
nothing.

How: each worker works out the groups when it has collected (the fixtures a test uses
are known there only; an explicit ``xdist_group`` mark is a group too) and writes
them, node id -> group, to a file the controller named (``workerinput``); the
controller's scheduler (:func:`make_scheduler`), xdist's ``loadgroup`` order (tests
handed out one at a time in collection order, a group as one unit when its first test
comes up), reads them from there. xdist's own ``loadgroup`` appends ``@group`` to a
node id, which pytest 9 no longer lets a plugin do (the id is structured); hence the
file, through xdist's documented hooks.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

#: Fixture scopes whose work the tests that share them should not do twice.
_SHARED_SCOPES = ("package", "module", "class")
#: The ``workerinput`` key of the groups file.
_KEY = "planner_xdist_groups"


def groups_of(items: list[pytest.Item]) -> dict[str, str]:
    """Node id -> group of the tests that share a module-, class- or package-scoped
    fixture of their module (union-find over tests and fixtures; the group is named
    after the first fixture of its component), or carry an ``xdist_group`` mark."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    marked: dict[str, str] = {}
    shared: dict[str, list[str]] = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None:
            marked[item.nodeid] = str(mark.args[0] if mark.args
                                      else mark.kwargs.get("name", "default"))
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        module = item.nodeid.split("::")[0]
        names = [f"{module}::{name}" for name, defs in info.name2fixturedefs.items()
                 if defs and defs[-1].scope in _SHARED_SCOPES]
        if names:
            shared[item.nodeid] = names
            for name in names:
                parent[find(name)] = find(item.nodeid)
    first: dict[str, str] = {}  # root -> the first fixture of its component, by name
    for names in shared.values():
        for name in names:
            root = find(name)
            first[root] = min(first.get(root, name), name)
    return {**{nodeid: first[find(nodeid)] for nodeid in shared}, **marked}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker under ``--dist loadgroup``: write the groups of ``items`` to the
    controller's file (atomically; every worker collects the same tests)."""
    path = getattr(config, "workerinput", {}).get(_KEY)
    if path is None:
        return
    tmp = Path(f"{path}.{os.getpid()}")
    tmp.write_text(json.dumps(groups_of(items)))
    os.replace(tmp, path)


def _loadgroup(config: pytest.Config) -> bool:
    return bool(config.getoption("numprocesses", None)) and \
        config.getoption("dist", None) == "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Controller: hand each worker the path of the groups file."""
    config = node.config
    if not _loadgroup(config):
        return
    if not hasattr(config, "_planner_groups_dir"):
        config._planner_groups_dir = tempfile.mkdtemp(prefix="pytest-xdist-groups-")
    node.workerinput[_KEY] = os.path.join(config._planner_groups_dir, "groups.json")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Controller: remove the groups file's directory."""
    path = getattr(config, "_planner_groups_dir", None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Controller under ``--dist loadgroup``: :func:`make_scheduler`."""
    if not _loadgroup(config):
        return None
    return make_scheduler(config, log)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's ``loadgroup`` scheduling, the groups read from the workers' file: a test
    not in a group is a unit of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class FixtureGroupScheduling(LoadScopeScheduling):
        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self._groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # called once every worker has collected
                path = Path(config._planner_groups_dir) / "groups.json"
                self._groups = json.loads(path.read_text()) if path.is_file() else {}
            group = self._groups.get(nodeid)
            return nodeid if group is None else f"group {group}"

    return FixtureGroupScheduling(config, log)
