"""The per-layer profile's segments, the stage costs, the in-flight count per stage and
the DP split of the pipeline search, hand-worked (docs/pipelining.md, "Pipelined runs",
"Search")."""

from __future__ import annotations

import numpy as np

from pipeline.config import load_resolved
from pipeline.costmodel.steptime import StepInputs
from pipeline.stages.solve.pipeline_search import search_pipeline, stage_in_flight
from pipeline.stages.solve.pipelined import stage_costs, stage_modules
from pipeline.stages.solve.profile import layer_profile, segments

# name, phase, layer, role, placeholder, sink, compute
NODES = [
    ("p_emb", "fwd", None, "param", True, False, 0.0),
    ("emb", "fwd", None, "activation", False, False, 2.0),
    ("p_l0", "fwd", "layers.0", "param", True, False, 0.0),
    ("l0", "fwd", "layers.0", "activation", False, False, 10.0),
    ("head", "fwd", None, "activation", False, False, 4.0),
    ("loss", "fwd", None, "loss", False, False, 1.0),
    ("head_b", "bwd", None, "activation", False, False, 8.0),
    ("l0_b", "bwd", "layers.0", "activation", False, False, 20.0),
    ("emb_b", "bwd", None, "grad", False, False, 3.0),
    ("g_emb", "bwd", None, "grad", False, True, 0.0),
]
EDGES = [(0, 1), (1, 3), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9)]


def _inputs() -> StepInputs:
    steps = [[] for _ in EDGES]
    steps[EDGES.index((2, 3))] = [(0, 5.0)]  # the layer's weight all-gather
    steps[EDGES.index((1, 3))] = [(0, 3.0)]  # an activation redistribution into the layer
    steps[EDGES.index((8, 9))] = [(0, 7.0)]  # the embedding gradient's reduction
    return StepInputs(
        names=[n[0] for n in NODES], phase=[n[1] for n in NODES],
        layer=[n[2] for n in NODES], role=[n[3] for n in NODES],
        placeholder=[n[4] for n in NODES], sink=[n[5] for n in NODES],
        weight_derived=[False] * len(NODES), compute_us=[n[6] for n in NODES],
        edges=EDGES, steps=steps, num_dims=1)


def test_segments_by_hand():
    """Forward before the layers and backward after them: first; the head, the loss and
    their backward: last; a parameter takes its consumer's, a gradient sink its
    producer's."""
    assert segments(_inputs()) == ["first", "first", "layers.0", "layers.0", "last", "last",
                                   "last", "layers.0", "first", "first"]


def test_layer_profile_by_hand():
    class Terms:
        terms = {"parameters": [(0, np.array([100.0])), (2, np.array([40.0]))],
                 "saved_activations": [(3, np.array([9.0]))]}

    # the gathered bytes: the input of the one weight edge (p_l0 -> l0), 64 bytes
    edge_bytes = [64.0 if e == (2, 3) else 1.0 for e in EDGES]
    # live bytes per node: runs of one node rise 0; the forward run of the head and the
    # loss (live 10, 30) rises 30 - 10 = 20
    live = [0, 1, 0, 6, 10, 30, 12, 14, 14, 0]
    prof = layer_profile(_inputs(), Terms(), np.zeros(len(NODES), dtype=np.int64), 11.0,
                         edge_bytes, live)
    assert prof["layers"] == ["layers.0"]
    assert prof["first"] == {"fwd_us": 2.0, "bwd_us": 3.0, "gather_us": 0.0,
                             "reduce_us": 7.0, "bytes": {"parameters": 100.0},
                             "gathered_bytes": 0.0, "transient_bytes": 0.0}
    assert prof["last"] == {"fwd_us": 5.0, "bwd_us": 8.0, "gather_us": 0.0,
                            "reduce_us": 0.0, "bytes": {}, "gathered_bytes": 0.0,
                            "transient_bytes": 20.0}
    assert prof["per_layer"] == {"fwd_us": [13.0], "bwd_us": [20.0], "gather_us": [5.0],
                                 "reduce_us": [0.0], "gathered_bytes": [64.0],
                                 "transient_bytes": [0.0],
                                 "bytes": [{"parameters": 40.0, "saved_activations": 9.0}]}
    assert prof["transient_bytes"] == 11.0


def _profile(layers: int, t_fwd: float, t_bwd: float, first: float, last: float,
             act: float = 1.0, gathered: float = 0.0) -> dict:
    seg = {"gather_us": 0.0, "reduce_us": 0.0, "bytes": {}, "gathered_bytes": 0.0,
           "transient_bytes": 0.0}
    return {"layers": [f"layers.{i}" for i in range(layers)],
            "first": {**seg, "fwd_us": first, "bwd_us": 0.0},
            "last": {**seg, "fwd_us": last, "bwd_us": 0.0},
            "per_layer": {"fwd_us": [t_fwd] * layers, "bwd_us": [t_bwd] * layers,
                          "gather_us": [0.0] * layers, "reduce_us": [0.0] * layers,
                          "gathered_bytes": [gathered] * layers,
                          "transient_bytes": [0.0] * layers,
                          "bytes": [{"parameters": 10.0, "saved_activations": act}] * layers},
            "transient_bytes": 0.0}


def test_stage_costs_and_modules():
    prof = _profile(4, 4.0, 6.0, 15.0, 2.0, gathered=8.0)
    costs = stage_costs(prof, [0, 1, 4], "bfloat16", "float32")
    assert [(c.fwd_us, c.bwd_us) for c in costs] == [(19.0, 6.0), (14.0, 18.0)]
    assert [c.state_bytes for c in costs] == [10.0, 30.0]
    assert [c.activation_bytes for c in costs] == [1.0, 3.0]
    # gathered parameters (bf16) and the gradient accumulated unsharded in float32
    assert [c.unsharded_param_bytes for c in costs] == [8.0, 24.0]
    assert [c.unsharded_grad_bytes for c in costs] == [16.0, 48.0]
    assert stage_modules(prof, [0, 1, 4]) == [
        ["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]]


def test_stage_in_flight():
    assert stage_in_flight("1f1b", 4, 8, 1) == [4, 3, 2, 1]
    assert stage_in_flight("gpipe", 2, 5, 1) == [5, 5]
    # interleaved p=2, m=2, v=2: rank 0 runs F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1
    # (docs/pipelining.md): stages 0 and 2 both hold 2
    assert stage_in_flight("interleaved_1f1b", 2, 2, 2)[0::2] == [2, 2]


def test_search_split_by_hand():
    """4 layers of 10 µs (fwd 4 + bwd 6), an embedding of 15 µs, p = 2, m = 4. Alpa's
    latency sum + 3 max: [0,1,4]: 25 + 30 -> 55 + 90 = 145; [0,2,4]: 35 + 20 -> 55 + 105
    = 160; [0,3,4]: 45 + 10 -> 55 + 135 = 190: the DP takes [0, 1, 4]."""
    cfg = load_resolved(["model=toy", "mesh=2", "mesh_names=[pp]", "pipeline.microbatches=4",
                         "pipeline.schedule=gpipe"])
    record = {"layer_profile": _profile(4, 4.0, 6.0, 15.0, 0.0), "mesh": "1",
              "mesh_names": ["dp"], "solve_dir": "x", "step_time_us": 0.0}
    rows = search_pipeline(cfg, record, 4, [("gpipe", 1), ("interleaved_1f1b", 2)])
    by = {r["schedule"]: r for r in rows}
    assert by["gpipe"]["split"] == [0, 1, 4] and by["gpipe"]["fits"]
    assert by["gpipe"]["record"]["pipeline"]["split"] == [0, 1, 4]
    inter = by["interleaved_1f1b"]
    assert inter["fits"]
    assert len(inter["split"]) == 5
    # a device too small for one layer: nothing fits
    tiny = load_resolved(["model=toy", "mesh=2", "mesh_names=[pp]", "pipeline.microbatches=4",
                          "pipeline.schedule=gpipe", "constraints.device_memory=10",
                          "memory.reserve_fraction=0"])
    rows = search_pipeline(tiny, record, 4, [("gpipe", 1)])
    assert rows[0]["why"] == "no split fits the device memory"
    assert rows[0]["record"] is None and not rows[0]["fits"]


def test_shapes_table_pipeline_columns(tmp_path):
    """The shapes table gives a pipelined run's degree, microbatches, schedule, virtual
    stages and bubble (``pp`` 1 and the rest empty for an SPMD run)."""
    import json

    import pandas as pd

    from pipeline.tools.shapes import shape_table

    base = {"objective": 5.0, "step_time_us": 10.0, "memory": {"peak_bytes": 2.0**30},
            "status": "Heuristic", "gap": 0.1}
    runs = {"a": {**base, "mesh": "4", "mesh_names": ["dp"], "step_time_us": 12.0},
            "b": {**base, "mesh": "2x2", "mesh_names": ["pp", "dp"],
                  "pipeline": {"degree": 2, "microbatches": 8, "schedule": "1f1b",
                               "virtual_stages": 1, "bubble_fraction": 0.25}}}
    for name, rec in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps(rec))
    table = shape_table([tmp_path / "a", tmp_path / "b"])
    first, second = table.iloc[0], table.iloc[1]
    assert (first["mesh"], first["pp"], first["microbatches"], first["schedule"],
            first["virtual_stages"], first["bubble_fraction"]) == ("2x2", 2, 8, "1f1b", 1, 0.25)
    assert (second["mesh"], second["pp"]) == ("4", 1)
    assert all(pd.isna(second[c]) for c in ("microbatches", "schedule", "bubble_fraction"))
