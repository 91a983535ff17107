"""Lazy and eager costs give the same plan: the same objective and placement hash at
meshes 8, 2x4 and (slow) 2x4x8 through ``python -m pipeline``'s stages, and lazy
materialises fewer pairwise factors; ``factor_build`` is timed alike in both modes.
The runs are the session's shared toy runs (tests/support/toy_plans.py)."""

from __future__ import annotations

import json
import math

import pytest
from fixtures import ToyResults
from toy_plans import ALL_MESHES, REL, get_run, rel_close, run_marks


@pytest.mark.parametrize("mesh", [pytest.param(m, marks=run_marks((m, "lazy"), (m, "eager")))
                                  for m in ALL_MESHES])
def test_lazy_and_eager_agree(toy_results: ToyResults, mesh: str) -> None:
    lazy, eager = get_run(toy_results, mesh, "lazy"), get_run(toy_results, mesh, "eager")
    lr, er = lazy.record, eager.record
    assert (lr["cost_mode"], er["cost_mode"]) == ("lazy", "eager")
    assert rel_close(lr["objective"], er["objective"]), (lr["objective"], er["objective"])
    assert lr["placement_hash"] == er["placement_hash"]
    assert [(r["output_placement"], r["input_placements"]) for r in lazy.plan] == \
        [(r["output_placement"], r["input_placements"]) for r in eager.plan]
    lt = lr["counts"]["factors_materialised"]["total"]
    et = er["counts"]["factors_materialised"]["total"]
    assert 0 < lt < et, f"lazy materialised {lt} factors, eager {et}"
    for rec in (lr, er):
        assert math.isfinite(rec["objective"])
        assert rec["lower_bound"] <= rec["objective"] * (1 + REL) + 1e-9
        assert rec["status"] in ("Optimal", "Heuristic")
    # factor_build is the building of the pairwise group factors in both modes: eager,
    # every one of them in the costs stage (the solve stage builds none); lazy, the
    # ones the solver asked for
    costs = json.loads((eager.dirs.costs / "costs.json").read_text())
    assert costs["counts"]["group_factors"] == er["counts"]["group_edges"]
    assert costs["phase_seconds"]["factor_build"] > 0
    assert er["phases"]["factor_build"] == costs["phase_seconds"]["factor_build"]
    assert er["phases"]["cost_build"] > costs["phase_seconds"]["cost_build"] > 0
    assert 0 < lr["counts"]["factors_materialised"]["group_factors"] <= lr["counts"]["group_edges"]
    assert lr["phases"]["factor_build"] > 0
