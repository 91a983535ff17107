"""The approx path never imports PuLP: a fresh process runs the whole pipeline of the
toy at mesh 2x4 with lazy and with eager costs (report included) and lists the
``pulp`` modules in ``sys.modules`` after each."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from fixtures import SEED, Jobs

_NO_PULP_SCRIPT = textwrap.dedent("""
    import json, sys
    from pipeline.config import load_resolved
    from pipeline.__main__ import run_pipeline
    results_dir = sys.argv[1]
    seen = {}
    for lazy in ("true", "false"):
        run_pipeline(load_resolved(["model=toy", "mesh=2x4", f"lazy_costs={lazy}",
                                    f"results_dir={results_dir}"]))
        seen[lazy] = sorted(m for m in sys.modules if m == "pulp" or m.startswith("pulp."))
    print("PULP_MODULES " + json.dumps(seen))
""")

#: This file's own subprocess (fixtures.queue_own_jobs): key -> the tests that read it.
OWN_JOBS: dict[str, tuple[str, ...]] = {
    "nopulp": ("test_approx_path_never_imports_pulp",),
}


def own_job_argv(key: str, base: Path) -> tuple[list[str], str]:
    """(argv, PYTHONHASHSEED) of own job ``key``, writing under ``base``."""
    assert key == "nopulp", key
    return [sys.executable, "-c", _NO_PULP_SCRIPT, str(base / key)], SEED


def test_approx_path_never_imports_pulp(jobs: Jobs) -> None:
    seen = jobs.result("nopulp").tagged("PULP_MODULES")
    assert seen == {"true": [], "false": []}, seen
