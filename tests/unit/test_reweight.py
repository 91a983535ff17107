"""Re-weighted objectives over the toy step's groups (pipeline/costmodel/reweight.py),
checked against the plan breakdown (pipeline/costmodel/breakdown.py), which prices each
edge of a plan on its own: the surrogate with weights ``w`` is the additive energy less
``(1 - w_e)`` of each redistribution, and the stream objective is ``theta`` times the
compute (with fusion) plus ``c`` times the redistributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fixtures import traced_topology
from test_fusion import HW, MESH, TOY

from pipeline.costmodel.breakdown import plan_breakdown
from pipeline.costmodel.factors import group_structure
from pipeline.costmodel.reweight import StreamObjective, surrogate_mrf
from pipeline.stages.costs.stage import build_mrf


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory):
    return traced_topology(tmp_path_factory.mktemp("toy_reweight"), TOY, MESH, ("dp", "tp"))


def _plans(mrf, domain, rng, count=3):
    """Random finite labellings: random moves from all-zero labels (DTensor's replicate
    rules first), each kept only when the energy stays finite."""
    labels = np.zeros(len(domain), dtype=np.int64)
    for _ in range(count):
        for g in rng.permutation(len(labels))[:200]:
            old = labels[g]
            labels[g] = rng.integers(domain[g])
            if not math.isfinite(mrf.evaluate(labels)):
                labels[g] = old
        yield labels.copy()


def _edge_comm(cm, strategy) -> np.ndarray:
    """Per graph edge, its redistribution's µs under ``strategy`` (breakdown rows)."""
    parts = plan_breakdown(cm, strategy)
    index = {(u, el, v, a): e for e, (u, el, v, a) in enumerate(cm.edges)}
    out = np.zeros(len(cm.edges))
    for r in parts.redistributions:
        out[index[(r["producer"], r["element"], r["consumer"], r["arg"])]] = r["comm_us"]
    return out


@pytest.mark.parametrize("lazy", [True, False])
def test_surrogate_is_the_energy_less_the_hidden_comm(toy, lazy):
    costs = build_mrf(toy, HW, lazy=lazy, fuse_pointwise=True)
    gs = group_structure(toy)
    cm = costs.cost_model()
    rng = np.random.default_rng(3)
    weight = rng.choice([0.0, 0.25, 1.0], size=gs.num_graph_edges)
    ones = surrogate_mrf(costs.mrf, cm, gs, np.ones(gs.num_graph_edges))
    some = surrogate_mrf(costs.mrf, cm, gs, weight)
    for labels in _plans(costs.mrf, gs.domain, rng, count=2):
        base = costs.mrf.evaluate(labels)
        assert ones.evaluate(labels) == pytest.approx(base, rel=1e-12)
        comm = _edge_comm(cm, labels[gs.group_of])
        assert comm.sum() > 0
        assert some.evaluate(labels) == pytest.approx(
            base - float(((1.0 - weight) * comm).sum()), rel=1e-9)


def test_stream_objective_is_compute_and_comm(toy):
    costs = build_mrf(toy, HW, lazy=True, fuse_pointwise=True)
    gs = group_structure(toy)
    cm = costs.cost_model()
    streams = StreamObjective(costs.mrf, cm, gs)
    compute_only = streams.mrf(1.0, 0.0)
    assert compute_only.num_edges < costs.mrf.num_edges  # only the fusion edges
    mixed = streams.mrf(0.3, 0.7)
    for labels in _plans(costs.mrf, gs.domain, np.random.default_rng(5)):
        parts = plan_breakdown(cm, labels[gs.group_of])
        c = float(parts.compute_us.sum() + parts.fusion_us.sum())
        m = float(sum(r["comm_us"] for r in parts.redistributions))
        assert parts.fusion_us.sum() < 0 and m > 0
        assert compute_only.evaluate(labels) == pytest.approx(c, rel=1e-9)
        assert mixed.evaluate(labels) == pytest.approx(0.3 * c + 0.7 * m, rel=1e-9)


def test_search_keeps_the_fastest_and_stops_at_a_fixed_point(toy):
    """The step-time search (pipeline/stages/solve/objective.py) on the toy: with a
    solver that keeps returning the additive plan, the damped weights converge to its
    exposed shares and the search stops at a fixed point within 10 re-solves (each
    halves the distance, 0.5 ** 10 < 1e-3); with TRW-S, the plan returned is the
    candidate with the smallest step time, simulated again here, and no candidate is
    faster than the bound."""
    from omegaconf import OmegaConf

    from pipeline.config.schema import SolverConfig
    from pipeline.costmodel.steptime import plan_step_inputs, simulate
    from pipeline.memory.graph import step_graph
    from pipeline.solvers.registry import get_solver
    from pipeline.stages.solve.objective import step_time_search

    costs = build_mrf(toy, HW, lazy=True, fuse_pointwise=True)
    gs = group_structure(toy)
    approx = get_solver("approx")

    def config(rounds: int):
        return OmegaConf.create({"solver": OmegaConf.structured(
            SolverConfig(step_time_rounds=rounds)), "mesh_names": ["dp", "tp"]})

    options = approx.options(config(1).solver)
    first = approx.solve(costs.mrf, options)
    derived = list(step_graph(toy).weight_derived)
    same = step_time_search(config(20), costs, costs.mrf, first, lambda m: first, derived)
    assert same.record["stop"] == "fixed point" and 2 <= same.record["solves"] <= 10
    assert [c["source"] for c in same.record["candidates"]] == ["additive"]
    assert np.array_equal(same.result.labels, first.labels)

    out = step_time_search(config(3), costs, costs.mrf, first,
                           lambda m: approx.solve(m, options), derived)
    cands = out.record["candidates"]
    assert cands[0]["source"] == "additive" and 1 <= out.record["solves"] <= 3
    assert cands[0]["additive_us"] == pytest.approx(first.objective, rel=1e-12)
    best = min(c["step_time_us"] for c in cands)
    strategy = np.asarray(out.result.labels)[gs.group_of]
    cm = costs.cost_model()
    parts = plan_breakdown(cm, strategy)
    again = simulate(plan_step_inputs(toy, cm, strategy, parts, derived)).step_time_us
    assert again == best
    assert out.result.objective == pytest.approx(costs.mrf.evaluate(out.result.labels),
                                                 rel=1e-12)
    assert 0 < out.lower_bound_us <= best


def test_held_caches_are_released_and_give_the_same_surrogate(toy):
    """``FactorProvider.hold_caches`` (set by the solve stage for the step-time search):
    once every group factor exists the redistribution planner's caches stay until
    ``release_caches``, which drops them (without the hold they go when the last factor
    is built); a surrogate built with the held caches equals, entry for entry, one built
    after they were dropped (the caches change no value)."""
    from pipeline.costmodel.redistribute import DEFAULT_INTERNER
    from pipeline.costmodel.reweight import Surrogate

    def cached() -> int:  # pair records per (mesh, tensor rank): none after a clear
        return len(DEFAULT_INTERNER.table_contexts)

    plain = build_mrf(toy, HW, lazy=True, fuse_pointwise=True)
    for ge in range(plain.mrf.num_edges):
        plain.factor_provider.factor(ge)
    assert cached() == 0
    costs = build_mrf(toy, HW, lazy=True, fuse_pointwise=True)
    provider = costs.factor_provider
    provider.hold_caches = True
    for ge in range(costs.mrf.num_edges):
        provider.factor(ge)
    assert cached() > 0
    gs = group_structure(toy)
    weight = np.random.default_rng(3).random(gs.num_graph_edges)
    held = Surrogate(costs.mrf, costs.cost_model(), gs).mrf(weight)
    provider.release_caches()
    assert cached() == 0 and not provider.hold_caches
    cold = Surrogate(costs.mrf, costs.cost_model(), gs).mrf(weight)
    assert cached() > 0  # the cold surrogate planned its pairs again
    for ge in range(costs.mrf.num_edges):
        a, b = held.factor(ge), cold.factor(ge)
        assert np.array_equal(a.row_cls, b.row_cls) and np.array_equal(a.table, b.table)
    assert all(np.array_equal(a, b) for a, b in zip(held.unary, cold.unary))
