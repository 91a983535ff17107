"""The objective of a run, recomputed independently: the evaluator of
tests/support/cost_evaluator.py recomputes E(x) = sum of compute + sum over graph edges
of (redistribution + transition + pointwise fusion) + the all-reduces inside
vocab-parallel softmaxes from ``solution.parquet`` and the topology artifacts alone, and
must match ``run.json`` (objective and its four parts) for lazy and eager costs at meshes
8, 2x4 and (slow) 2x4x8. On a mismatch the failure names the first nodes whose parts
differ from the solver's own per-node columns."""

from __future__ import annotations

from collections import defaultdict

import pytest
from fixtures import ToyResults
from toy_plans import ALL_MESHES, MODES, evaluation_of, get_run, rel_close, run_marks, topology_of


@pytest.mark.parametrize(("mesh", "mode"), [
    pytest.param(m, md, marks=run_marks((m, md)), id=f"{m}-{md}")
    for m in ALL_MESHES for md in MODES])
def test_independent_evaluator_matches_run_record(toy_results: ToyResults, mesh: str,
                                                  mode: str) -> None:
    run = get_run(toy_results, mesh, mode)
    tt = topology_of(run)
    assert len(run.plan) == len(tt.nodes["id"]) == run.record["counts"]["nodes"]
    assert len(tt.edges["producer"]) == run.record["counts"]["edges"]
    ev = evaluation_of(run)
    rec = run.record
    got = {"objective": ev.objective, "compute_us": ev.compute_us, "comm_us": ev.comm_us,
           "transition_us": ev.transition_us, "fusion_us": ev.fusion_us}
    bad = {k: (v, rec[k]) for k, v in got.items() if not rel_close(v, rec[k])}
    if bad:
        # locate the nodes whose parts differ from the solver's own per-node columns
        comm_in, trans_in, fusion_in = defaultdict(float), defaultdict(float), defaultdict(float)
        for v, c in enumerate(ev.op_comm or []):
            comm_in[v] += c
        for v, c, t, f in zip(tt.edges["consumer"], ev.edge_comm, ev.edge_transition,
                              ev.edge_fusion):
            comm_in[v] += c
            trans_in[v] += t
            fusion_in[v] += f
        diffs = [(r["name"], r["op"], (r["compute_us"], ev.compute[v]),
                  (r["comm_us"], comm_in[v]), (r["transition_us"], trans_in[v]),
                  (r["fusion_us"], fusion_in[v]))
                 for v, r in enumerate(run.plan)
                 if not (rel_close(r["compute_us"], ev.compute[v])
                         and rel_close(r["comm_us"], comm_in[v], 1e-6)
                         and r["transition_us"] == trans_in[v]
                         and rel_close(r["fusion_us"], fusion_in[v], 1e-6))]
        pytest.fail(f"(mine, run.json): {bad}; first differing nodes "
                    f"(name, op, (solver, mine) compute/comm/transition/fusion): {diffs[:10]}")
