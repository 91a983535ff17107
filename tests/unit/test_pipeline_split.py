"""The split DP (pipeline/costmodel/pipeline_split.py) against brute force over every
split, and by hand."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeline.costmodel.pipeline_split import best_split, pipeline_latency


def _splits(n_layers, stages):
    for cuts in itertools.combinations(range(1, n_layers), stages - 1):
        yield (0, *cuts, n_layers)


def _brute(n_layers, stages, m, stage_time, fits=None):
    best = None
    for b in _splits(n_layers, stages):
        sizes = [b[s + 1] - b[s] for s in range(stages)]
        if fits is not None and not all(fits(s, n) for s, n in enumerate(sizes)):
            continue
        times = [stage_time(n, s == 0, s == stages - 1) for s, n in enumerate(sizes)]
        lat = pipeline_latency(times, m)
        if best is None or lat < best:
            best = lat
    return best


def test_latency_by_hand():
    # three stages of 3, 5, 4 µs and 4 microbatches: 12 + 3 * 5 = 27
    assert pipeline_latency([3.0, 5.0, 4.0], 4) == 27.0


def test_equal_layers_split_evenly_by_hand():
    """1 µs per layer, the embedding 0.5 on the first stage, head and loss 2.5 on the
    last: 10 layers in 3 stages, m = 8. Stages (4, 4, 2): times 4.5, 4, 4.5, latency
    13 + 7 * 4.5 = 44.5; no split has a smaller maximum than 4.5 (10 + 3 = 13 µs over 3
    stages is at least 4.33, and the times are multiples of 0.5)."""
    def t(n, first, last):
        return n + (0.5 if first else 0.0) + (2.5 if last else 0.0)

    best = best_split(10, 3, 8, t)
    assert best.latency_us == 44.5
    assert max(best.times) == 4.5 and best.boundaries[-1] == 10


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n_layers, stages, m", [(8, 3, 4), (9, 4, 1), (7, 2, 16)])
def test_dp_equals_brute_force(seed, n_layers, stages, m):
    rng = np.random.default_rng(seed)
    per_layer = rng.uniform(0.5, 2.0)
    extra_first, extra_last = rng.uniform(0, 3, size=2)
    noise = rng.uniform(0.0, 0.4, size=(n_layers + 1, 2, 2))

    def t(n, first, last):
        return (n * per_layer + (extra_first if first else 0) + (extra_last if last else 0)
                + noise[n, int(first), int(last)])

    limit = rng.integers(2, n_layers)

    def fits(s, n):  # the first stage holds the most in flight: fewer layers allowed
        return n <= limit + s

    for f in (None, fits):
        brute = _brute(n_layers, stages, m, t, f)
        best = best_split(n_layers, stages, m, t, f)
        if brute is None:
            assert best is None
            continue
        assert best.latency_us == pytest.approx(brute, rel=1e-12)
        sizes = np.diff(best.boundaries)
        assert sizes.sum() == n_layers and (sizes >= 1).all() and len(sizes) == stages
        assert best.times == tuple(t(int(n), s == 0, s == stages - 1)
                                   for s, n in enumerate(sizes))


def test_nothing_fits_and_bad_input():
    assert best_split(4, 2, 2, lambda n, f, last: float(n), lambda s, n: False) is None
    with pytest.raises(ValueError):
        best_split(2, 3, 1, lambda n, f, last: 1.0)
