"""constraints.model_parallel=intra_node (pipeline/costmodel/model_parallel.py): activation
collectives only on mesh dims whose groups stay inside one node."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from plan_facts import weight_derived

from pipeline.costmodel.model_parallel import blocked_pairs, cross_node_dims
from pipeline.dtensor.placements import parse_placements

# 4 x 2 GPUs, 2 per node: dp's groups span 4 nodes, tp's stay in one
RUN = ("mesh=4x2", "mesh_names=[dp,tp]", "hardware.gpus_per_node=2",
       "constraints.model_parallel=intra_node")


def test_cross_node_dims() -> None:
    """Ranks row-major, packed 8 per node: on 8x8 the first dim's groups take one rank of
    each of 8 nodes, the second dim's are one node; on 2x4x8 both leading dims cross."""
    assert cross_node_dims((8, 8), 8) == {0}
    assert cross_node_dims((2, 4, 8), 8) == {0, 1}
    assert cross_node_dims((2, 4), 8) == frozenset()  # one node
    assert cross_node_dims((4, 2), 2) == {0}
    assert cross_node_dims((1, 16), 8) == {1}  # a dim of size 1 runs nothing


def test_blocked_pairs() -> None:
    """A pair is blocked when the placement on a cross-node dim changes from anything but
    Replicate (Replicate -> Shard / Partial is a local slice)."""
    p = [parse_placements(t, 2) for t in ("S(0)R", "S(0)S(1)", "RR", "PR")]
    got = blocked_pairs(p, p, frozenset({0}))
    want = [[s[0] != t[0] and not s[0].is_replicate() for t in p] for s in p]
    assert got.tolist() == want
    assert got[0, 2] and got[3, 0] and not got[0, 1] and not got[2, 0]
    assert not blocked_pairs(p, p, frozenset()).any()


@pytest.mark.toy_runs(RUN)
def test_intra_node_tables_and_plan(toy_results: object) -> None:
    """The cost model with intra_node: an edge between activations (into a forward add of
    two activations) is +inf exactly for the pairs whose dp placement changes from
    non-Replicate, and as without the constraint otherwise; an edge out of a parameter
    (an FSDP gather) is never +inf. The solved plan's collectives over dp are weight
    gathers, reductions in the backward (gradients), into the output sinks or of scalars
    only."""
    from pipeline.config import load_resolved
    from pipeline.costmodel.model import CostModel
    from pipeline.stages.topology.artifacts import read_topology

    run = toy_results.run(*RUN)  # type: ignore[attr-defined]
    cfg = load_resolved(["model=toy", *RUN])
    topo = read_topology(Path(run.dirs.topology))
    rows = pq.read_table(Path(run.dirs.topology) / "nodes.parquet").to_pylist()
    weights = weight_derived(rows)
    free = CostModel(topo, cfg.hardware, memoise=False)
    held = CostModel(topo, cfg.hardware, memoise=False, model_parallel="intra_node")
    assert held.blocked_dims == {0}
    checked = {"activation": 0, "weight": 0}
    for e, (u, el, v, a) in enumerate(held.edges):
        if rows[u]["role"] == "param" and rows[u]["target"] == "placeholder":
            kind = "weight"
        elif rows[v]["target"] == "aten.add.Tensor" and rows[v]["phase"] == "fwd" \
                and rows[u]["name"] not in weights and len(held.in_metas[v][a]["shape"]) >= 2:
            kind = "activation"
        else:
            continue
        _, srcs = held.out_classes(u, el)
        _, dsts = held.in_classes(v, a)
        got, base = held.edge_table(e)[2], free.edge_table(e)[2]
        for i, s in enumerate(srcs):
            for j, t in enumerate(dsts):
                blocked = kind == "activation" and s[0] != t[0] and not s[0].is_replicate()
                assert got[i, j] == (math.inf if blocked else base[i, j])
        checked[kind] += 1
    assert checked["activation"] > 0 and checked["weight"] > 0
    phase = {r["name"]: r["phase"] for r in rows}
    for row in pq.read_table(Path(run.dirs.solve) / "redistributions.parquet").to_pylist():
        kinds = {c.split("(")[0] for c in row["collectives"]
                 if "dp" in c.rstrip(")").split("(")[1].split("+")}
        if not kinds or row["consumer_name"].startswith("output:") or not row["shape"]:
            continue  # none on dp, into a sink, or a scalar (the loss)
        if kinds == {"all_gather"}:
            assert row["producer_name"] in weights, row
        else:
            assert kinds <= {"reduce_scatter", "all_reduce"}, row
            assert phase[row["consumer_name"]] == "bwd", row
    assert math.isfinite(run.record["objective"])
