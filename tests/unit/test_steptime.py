"""Step-time simulation (pipeline/costmodel/steptime.py): hand-worked schedules on a graph built
by hand, and the bounds on the toy model's plans."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.costmodel.steptime import StepInputs, global_tokens, simulate


def _graph(gather_b: float = 6.0, reduce_dim: int = 1, rs: float = 8.0) -> StepInputs:
    """Two layers L0, L1 (one forward and one backward kernel each) and the gradient of
    L1's weight.

    node  name   phase layer  compute  inputs
    0     pA     fwd   L0     -        parameter of L0
    1     pB     fwd   L1     -        parameter of L1
    2     x      fwd   -      -        model input
    3     a0     fwd   L0     10       x, pA (all-gather on dim 0: 4 µs)
    4     a1     fwd   L1     10       a0 (all-reduce on ``reduce_dim``: 3 µs), pB
                                       (all-gather on dim 0: ``gather_b`` µs)
    5     b1     bwd   L1     20       a1
    6     gB     bwd   L1     5        a1 (the weight gradient of pB)
    7     b0     bwd   L0     20       b1
    8     sB     sink  (grad of pB)    gB (reduce-scatter on dim 0: ``rs`` µs)
    9     out    sink  (loss)          b0
    """
    names = ["pA", "pB", "x", "a0", "a1", "b1", "gB", "b0", "sB", "out"]
    phase = ["fwd"] * 5 + ["bwd"] * 5
    layer = ["L0", "L1", None, "L0", "L1", "L1", "L1", "L0", "L1", None]
    role = ["param", "param", "input", "activation", "activation", "activation",
            "activation", "activation", "grad", "loss"]
    placeholder = [True, True, True] + [False] * 7
    sink = [False] * 8 + [True, True]
    compute = [0, 0, 0, 10, 10, 20, 5, 20, 0, 0]
    edges = [(2, 3), (0, 3), (3, 4), (1, 4), (4, 5), (4, 6), (5, 7), (6, 8), (7, 9)]
    steps = [[], [(0, 4.0)], [(reduce_dim, 3.0)], [(0, gather_b)], [], [], [], [(0, rs)],
             []]
    return StepInputs(names=names, phase=phase, layer=layer, role=role,
                      placeholder=placeholder, sink=sink, weight_derived=[False] * 10,
                      compute_us=[float(c) for c in compute], edges=edges, steps=steps,
                      num_dims=2)


def test_hand_worked_overlap() -> None:
    """By hand: the first all-gather (pA, 0-4) is exposed; a0 runs 4-14; pB's gather is
    issued when the stream reaches a0 (at 0: prefetched one unit ahead) and queues
    behind pA's on dim 0: 4-10, hidden;
    the activation all-reduce a0 -> a1 is issued when the stream reaches a1 (14) and a1
    waits for it: 14-17, a1 17-27; b1 27-47, gB 47-52; gB's reduce-scatter runs 52-60
    on dim 0 while b0 runs 52-72. Step 72 µs: compute 65, comm 21 (additive 86),
    exposed 7 = the first gather (4) + the blocking all-reduce (3)."""
    sim = simulate(_graph())
    assert sim.step_time_us == 72.0
    assert sim.compute_us == 65.0
    assert sim.comm_us == 21.0
    assert sim.exposed_comm_us == 7.0
    assert sim.stream_busy_us == [18.0, 3.0]
    assert sim.comm_us_by_kind == {"weight": 10.0, "activation": 3.0, "gradient": 8.0}
    start = dict(zip(_graph().names, sim.node_start_us))
    assert (start["a0"], start["a1"], start["b1"], start["gB"], start["b0"]) == \
        (4.0, 17.0, 27.0, 47.0, 52.0)
    assert sim.node_end_us[8] == 60.0  # the reduced gradient arrives during b0


def test_hand_worked_no_overlap() -> None:
    """``hardware.overlap=false`` (CPU processes on gloo): every collective blocks the one
    stream, in graph order. By hand on the same graph: pA's gather 0-4, a0 4-14; a1
    waits for the all-reduce 14-17 and pB's gather 17-23 (edge order), runs 23-33; b1
    33-53, gB 53-58, b0 58-78; the sink sB waits for gB's reduce-scatter (8 µs): it
    comes after b0 in graph order, 78-86. Step 86 = compute 65 + comm 21 (the additive
    sum), exposed 21, where the overlapped schedule gives 72."""
    import dataclasses

    g = dataclasses.replace(_graph(), overlap=False)
    sim = simulate(g)
    assert sim.step_time_us == 86.0
    assert (sim.compute_us, sim.comm_us, sim.exposed_comm_us) == (65.0, 21.0, 21.0)
    assert sim.stream_busy_us == [18.0, 3.0]
    assert sim.comm_us_by_kind == {"weight": 10.0, "activation": 3.0, "gradient": 8.0}
    start = dict(zip(g.names, sim.node_start_us))
    assert (start["a0"], start["a1"], start["b1"], start["gB"], start["b0"]) == \
        (4.0, 23.0, 33.0, 53.0, 58.0)
    assert sim.node_end_us[8] == 86.0
    slow = simulate(dataclasses.replace(_graph(gather_b=16.0), overlap=False))
    assert slow.step_time_us == 96.0  # every µs of comm adds to the step


def test_prefetch_longer_than_the_layer() -> None:
    """pB's gather of 16 µs (4-20) outlasts a0 (4-14) and the all-reduce (14-17): a1
    starts at 20, the step is 75 µs (exposed 4 + 6)."""
    sim = simulate(_graph(gather_b=16.0))
    assert sim.step_time_us == 75.0
    assert sim.exposed_comm_us == 10.0


def test_one_stream_per_mesh_dim() -> None:
    """The same, with the all-reduce on dim 0: it is issued at 14 but queues behind
    pB's gather (4-20) on dim 0's stream, runs 20-23; a1 23-33, ... step 78 µs."""
    sim = simulate(_graph(gather_b=16.0, reduce_dim=0))
    assert sim.step_time_us == 78.0
    assert sim.stream_busy_us == [31.0, 0.0]


def test_gradient_reduction_past_the_backward() -> None:
    """A reduce-scatter longer than the rest of the backward ends the step: issued at 52,
    40 µs: the step ends at 92 > b0's end (72)."""
    sim = simulate(_graph(rs=40.0))
    assert sim.step_time_us == 92.0
    assert sim.exposed_comm_us == 92.0 - 65.0


def test_weight_cast_runs_ahead() -> None:
    """A weight-derived cast c of pB (2 µs, before its gather) is released with L1's unit
    when the stream reaches a0 (0) and runs 0-2 while a0 waits for pA's gather (0-4);
    c's gather (c -> a1, 6 µs) queues behind it on dim 0: 4-10. a0 4-14, all-reduce
    14-17, a1 17-27, ... b0 52-72: the step is still 72 µs (compute 67, exposed 5: the
    cast hides in the first gather's wait)."""
    g = _graph()
    g.names.insert(3, "c")
    # renumber: c is node 3, the others move up by one
    def sh(i: int) -> int:
        return i + 1 if i >= 3 else i
    edges = [(sh(u), sh(v)) for u, v in g.edges]
    steps = list(g.steps)
    k = edges.index((1, 5))
    edges[k] = (3, 5)  # a1 reads the cast
    edges.append((1, 3))
    steps.append([])
    order = sorted(range(len(edges)), key=lambda e: (edges[e][1], e))
    g.edges = [edges[e] for e in order]
    g.steps = [steps[e] for e in order]
    g.phase.insert(3, "fwd")
    g.layer.insert(3, "L1")
    g.role.insert(3, "activation")
    g.placeholder.insert(3, False)
    g.sink.insert(3, False)
    g.weight_derived = [False] * 3 + [True] + [False] * 7
    g.compute_us.insert(3, 2.0)
    sim = simulate(g)
    assert sim.step_time_us == 72.0
    assert sim.compute_us == 67.0
    assert sim.exposed_comm_us == 5.0
    assert dict(zip(g.names, sim.node_start_us))["c"] == 0.0


def test_global_tokens() -> None:
    assert global_tokens({"batch_size": 16, "seq_len": 2048}) == 32768
    assert global_tokens({"inputs": [{"name": "tokens", "shape": [8, 128]}]}) == 1024
    assert global_tokens({}) is None


TOY_RUNS = (("mesh=8", "lazy_costs=true", "costs.compile=true"),
            ("mesh=2x4", "mesh_names=[dp,tp]"), ("mesh=2x4x8",))


@pytest.mark.toy_runs(*TOY_RUNS)
@pytest.mark.parametrize("overrides", TOY_RUNS, ids=lambda o: o[0])
def test_toy_step_time_bounds(toy_results: object, overrides: tuple[str, ...]) -> None:
    """On the toy plans: max(compute, busiest stream) <= step time <= compute + comm <=
    objective; the record's parts are the objective's; tokens/s/device from batch 16 x
    2048 tokens over the mesh; runs.parquet-ready top-level fields."""
    run = toy_results.run(*overrides)  # type: ignore[attr-defined]
    rec = run.record
    st = rec["step_time"]
    # the compute stream runs the fused kernels: compute plus the fusion term (< 0 with
    # costs.compile=true, 0 for the eager default)
    assert st["compute_us"] == pytest.approx(rec["compute_us"] + rec["fusion_us"], rel=1e-12)
    assert (rec["fusion_us"] < 0) == ("costs.compile=true" in overrides)
    assert st["comm_us"] == pytest.approx(rec["comm_us"], rel=1e-12)
    busiest = max(st["stream_busy_us"].values())
    assert max(st["compute_us"], busiest) <= st["step_time_us"] + 1e-9
    assert st["step_time_us"] <= st["compute_us"] + st["comm_us"] + 1e-9
    assert st["step_time_us"] <= rec["objective"]
    assert st["step_time_us"] < rec["objective"] - 1.0  # some comm is hidden
    assert math.isclose(sum(st["stream_busy_us"].values()), st["comm_us"], rel_tol=1e-9)
    assert math.isclose(sum(st["comm_us_by_kind"].values()), st["comm_us"], rel_tol=1e-9)
    assert st["exposed_comm_us"] == pytest.approx(st["step_time_us"] - st["compute_us"])
    world = math.prod(int(m) for m in str(rec["mesh"]).split("x"))
    assert st["tokens_per_s_per_device"] == pytest.approx(
        16 * 2048 / world / (st["step_time_us"] * 1e-6))
    for key in ("step_time_us", "exposed_comm_us", "tokens_per_s_per_device"):
        assert rec[key] == st[key]
    assert json.loads(json.dumps(st)) == st


def test_multi_dim_steps_in_order() -> None:
    """pA's redistribution in two steps, dim 1 (2 µs) then dim 0 (4 µs). At 0 the first
    step starts on dim 1 (0-2) and pB's prefetched gather is issued on dim 0 (0-6) as
    the stream reaches a0; pA's second step is issued at 2 and queues behind it: 6-10.
    a0 10-20, all-reduce 20-23, a1 23-33, b1 33-53, gB 53-58 (its reduce-scatter 58-66),
    b0 58-78: step 78, exposed 13."""
    g = _graph()
    g.steps[1] = [(1, 2.0), (0, 4.0)]
    sim = simulate(g)
    assert sim.step_time_us == 78.0
    assert sim.exposed_comm_us == 13.0
    assert dict(zip(g.names, sim.node_start_us))["a0"] == 10.0
    assert sim.stream_busy_us == [18.0, 5.0]


def test_forbidden_edge_is_refused() -> None:
    g = _graph()
    g.steps[2] = [(1, math.inf)]
    with pytest.raises(ValueError, match="a0 -> a1"):
        simulate(g)
