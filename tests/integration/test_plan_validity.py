"""The plan is valid: DTensor's own sharding propagation accepts every chosen (output,
inputs) strategy (tests/support/dtensor_checker.py), and a sample of every distinct
strategy list the topology enumerated; ties and constraints hold (groups, repeated
layers, gradient sinks, placeholders, inputs, the loss, the parameter-memory budget); no
chosen edge is a forbidden redistribution (tests/support/cost_evaluator.py). On the
session's shared lazy toy runs at mesh 2x4 and (slow) 2x4x8."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
from cost_evaluator import local_shape
from dtensor_checker import DTensorChecker
from fixtures import ToyResults
from toy_plans import (
    MESHES_2X4X8,
    evaluation_of,
    get_run,
    rel_close,
    run_marks,
    topology_of,
    toy_overrides,
)

#: The meshes of the plan checks: the lazy run at each.
VALIDITY_MESHES = [pytest.param(m, marks=run_marks((m, "lazy")))
                   for m in ["2x4", *MESHES_2X4X8]]


@pytest.mark.parametrize("mesh", VALIDITY_MESHES)
def test_plan_accepted_by_dtensor(toy_results: ToyResults, mesh: str) -> None:
    """Every chosen (output, inputs) strategy of an aten node is one DTensor accepts."""
    run = get_run(toy_results, mesh, "lazy")
    tt = topology_of(run)
    checker = DTensorChecker(tt)
    results: dict[str, list] = defaultdict(list)
    for v, row in enumerate(run.plan):
        if not row["op"].startswith("aten."):
            continue
        status, detail = checker.check(v, row["output_placement"], row["input_placements"])
        results[status].append((row["name"], row["op"], row["output_placement"],
                                row["input_placements"], detail))
    total = sum(len(x) for x in results.values())
    assert total > 400, total
    assert not results["bad"], (f"{len(results['bad'])} of {total} chosen strategies are not "
                                f"accepted by DTensor: {results['bad'][:10]}")
    skipped = results["skip"]
    assert len(skipped) < 0.05 * total, (f"{len(skipped)} of {total} nodes could not be "
                                         f"checked: {skipped}")


@pytest.mark.parametrize("mesh", VALIDITY_MESHES)
def test_plan_ties_and_constraints(toy_results: ToyResults, mesh: str) -> None:
    """Groups and repeated layers are tied, gradient sinks carry their parameter's
    placement, inputs and the loss are placed as configured, the parameter-memory budget
    holds, and no chosen edge is a forbidden redistribution."""
    from pipeline.dtensor.placements import parse_output, parse_placements

    run = get_run(toy_results, mesh, "lazy")
    tt = topology_of(run)
    plan = run.plan
    nd = len(run.cfg.mesh)
    rep = "R" * nd

    # the groups are the topology's, and every member of a group takes the same label
    assert [r["group"] for r in plan] == tt.nodes["group"]
    by_group: dict[int, set] = defaultdict(set)
    for r in plan:
        by_group[r["group"]].add((r["strategy"], r["output_placement"]))
    split = {g: s for g, s in by_group.items() if len(s) > 1}
    assert not split, f"groups with more than one choice: {dict(list(split.items())[:5])}"
    # repeated layers are really tied: layers.1 copies layers.0 node for node
    layer_groups = defaultdict(set)
    for r in plan:
        if r["layer"] is not None:
            layer_groups[r["layer"]].add(r["group"])
    assert layer_groups["layers.1"] == layer_groups["layers.0"]

    # gradient sinks carry their parameter's placement
    param_of = {fqn: v for v, (fqn, role) in enumerate(zip(tt.nodes["fqn"], tt.nodes["role"]))
                if role == "param"}
    sinks = [r for r in plan if r["name"].startswith("output:grad:")]
    assert len(sinks) == len(param_of) > 0
    for r in sinks:
        p = plan[param_of[r["name"][len("output:grad:"):]]]
        assert r["output_placement"] == p["output_placement"], (r["name"], p["name"])
        assert r["input_placements"] == [p["output_placement"]], r["name"]

    # no Partial on placeholders or gradient outputs
    for r in plan:
        if r["op"] == "placeholder" or r["role"] == "grad":
            assert not any(p.is_partial() for p in parse_placements(r["output_placement"], nd)), \
                (r["name"], r["output_placement"])

    # model inputs: Shard(0) on the first mesh dim, Replicate elsewhere
    inputs = [r for r in plan if r["role"] == "input"]
    assert inputs
    for r in inputs:
        assert r["output_placement"] == "S(0)" + "R" * (nd - 1), (r["name"], r["output_placement"])

    # the loss (the value behind the non-gradient output) is Replicate
    e = tt.edges
    loss_sinks = [v for v, r in enumerate(plan) if r["op"] == "output" and r["role"] != "grad"]
    assert len(loss_sinks) == 1
    loss = [u for u, v in zip(e["producer"], e["consumer"]) if v == loss_sinks[0]]
    assert len(loss) == 1
    assert plan[loss[0]]["output_placement"] == rep, plan[loss[0]]
    assert plan[loss_sinks[0]]["output_placement"] == rep
    assert math.prod(json.loads(tt.nodes["out_metas"][loss[0]])[0]["shape"]) == 1

    # the parameter-memory budget (constraints.param_memory, parameter-count weighted):
    # sum_p r_p(x_p) <= sum_p max(min_r_p, high), r_p = local / full elements
    pm = run.cfg.constraints.param_memory
    if pm is not None:
        mesh_shape = tuple(int(m) for m in run.cfg.mesh)

        def ratio(v: int, text: str) -> float:
            shape = json.loads(tt.nodes["out_metas"][v])[0]["shape"]
            local = local_shape(shape, parse_placements(text, nd), mesh_shape)
            return math.prod(local) / math.prod(shape)

        params = [v for v, r in enumerate(plan) if r["role"] == "param"]
        used = math.fsum(ratio(v, plan[v]["output_placement"]) for v in params)
        min_r = {v: min(ratio(v, t) for t in tt.slist_outputs[tt.nodes["slist"][v]])
                 for v in params}
        high = math.fsum(max(min_r[v], float(pm.high)) for v in params)
        low = math.fsum(max(min_r[v], float(pm.low)) for v in params)
        assert low * (1 - 1e-9) <= used <= high * (1 + 1e-9), (low, used, high)
        assert rel_close(run.record["param_memory"]["ratio_sum"], used), \
            (run.record["param_memory"], used)

    # every chosen edge is a legal redistribution
    ev = evaluation_of(run)
    inf = [(plan[u]["name"], plan[v]["name"], src, dst)
           for (u, v), c, (src, dst) in zip(zip(e["producer"], e["consumer"]), ev.edge_comm,
                                            ev.edge_text) if not math.isfinite(c)]
    assert not inf, f"forbidden redistributions in the plan: {inf[:10]}"
    # every chosen placement parses (tuple outputs too)
    for r in plan:
        parse_output(r["output_placement"], nd)


@pytest.mark.toy_runs(toy_overrides("2x4", "lazy"))
def test_enumerated_strategies_sample_accepted_by_dtensor(toy_results: ToyResults) -> None:
    """Beyond the plan: a sample of every distinct strategy list of the 2x4 topology."""
    run = get_run(toy_results, "2x4", "lazy")
    tt = topology_of(run)
    checker = DTensorChecker(tt)
    per_list = 6
    seen: set[int] = set()
    results: dict[str, list] = defaultdict(list)
    for v, target in enumerate(tt.nodes["target"]):
        s = tt.nodes["slist"][v]
        if not target.startswith("aten.") or s in seen:
            continue
        seen.add(s)
        outs, ins = tt.slist_outputs[s], tt.slist_inputs[s]
        k_all = len(outs)
        picks = sorted({round(j * (k_all - 1) / (per_list - 1)) for j in range(per_list)}) \
            if k_all > per_list else range(k_all)
        for k in picks:
            status, detail = checker.check(v, outs[k], ins[k])
            results[status].append((target, k, outs[k], ins[k], detail))
    total = sum(len(x) for x in results.values())
    assert total > 300, total
    assert not results["bad"], (f"{len(results['bad'])} of {total} enumerated strategies "
                                f"are not accepted by DTensor: {results['bad'][:10]}")
    assert len(results["skip"]) < 0.05 * total, results["skip"]
