"""Loading the eager factors (``pipeline.stages.costs.stage.load_factors``) keeps each
array of ``factors.npz`` once, not once per factor, on a synthetic chain and on the
shared 2x4 eager toy run's archive. While it does not, the eager 2x4x8 run is not made
(tests/support/toy_plans.py: it would be OOM-killed) and this test fails."""

from __future__ import annotations

import pytest
from fixtures import ToyResults
from toy_plans import get_run, load_factors_overhead, probe_load_factors, toy_overrides


@pytest.mark.toy_runs(toy_overrides("2x4", "eager"))
def test_eager_factors_load_once(toy_results: ToyResults) -> None:
    """Loading the eager factors keeps each array of ``factors.npz`` once, not once per
    factor: the arrays of the loaded MRF keep alive no byte beyond their own (views of
    one buffer per archive array, or copies of their own slices), on the synthetic
    chain of the probe and on the 2x4 run's archive that the eager solve loads."""
    synthetic = probe_load_factors()
    assert synthetic <= 1.0 + 1e-9, \
        f"load_factors keeps {synthetic:.2f}x the synthetic factors' own bytes"
    run = get_run(toy_results, "2x4", "eager")
    assert run.record["cost_mode"] == "eager"
    overhead = load_factors_overhead(run.dirs.costs / "factors.npz")
    assert overhead <= 1.0 + 1e-9, f"load_factors keeps {overhead:.2f}x the factors' own bytes"
