"""Constraints that shape the plan: parameter-memory budget, pins, infeasibility.

Expected values are worked out by hand from the toy model's shapes
(conf/model/toy.yaml: dim 256, 2 layers, 8 heads, 4 KV heads -> head dim 32,
KV width 128, SwiGLU hidden 768, vocab 1024) and the budget formula of
pipeline/memory/budget.py. The costs stage builds the budget row into the MRF; with eager
costs it is stored in ``factors.npz`` and an infeasible budget stops the costs stage.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures import TOY_PARAMS, ToyResults

from pipeline.config import load_resolved, stage_dirs
from pipeline.solvers.lagrangian import repair, row_value, solve_with_row, tighten
from pipeline.solvers.mrf import MRF, LinearConstraint, PairwiseFactor

ROOT = Path(__file__).resolve().parents[2]

#: The two mesh-8 runs of ``dp8`` (default budget, no budget), from the shared results.
#: Without the budget the additive optimum is DDP-like (weights replicated: no gather
#: per use); that is a fact of the additive objective (``solver.objective=additive``).
#: The step-time run without the budget keeps the additive plan as its candidate 0 and
#: returns a plan no slower by the simulation (pipeline/stages/solve/objective.py).
NO_BUDGET = ("mesh=8", "lazy_costs=true", "constraints.param_memory=null")
NO_BUDGET_ADDITIVE = (*NO_BUDGET, "solver.objective=additive")
DP8_RUNS = (("mesh=8", "lazy_costs=true"), NO_BUDGET, NO_BUDGET_ADDITIVE)


def _run(tmp: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "model=toy", f"results_dir={tmp}", *overrides],
        cwd=tmp, capture_output=True, text=True, timeout=900,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp)})


def _outputs(tmp: Path, *overrides: str) -> tuple[dict, pd.DataFrame]:
    cfg = load_resolved(["model=toy", f"results_dir={tmp}", *overrides])
    solve = Path(stage_dirs(cfg).solve)
    return json.loads((solve / "run.json").read_text()), pd.read_parquet(
        solve / "solution.parquet")


@pytest.fixture(scope="module")
def dp8(toy_results: ToyResults) -> Path:
    """The shared results directory, with the toy mesh-8 runs with and without the
    parameter-memory budget made (read-only)."""
    for overrides in DP8_RUNS:
        toy_results.run(*overrides)
    return toy_results.root


def test_toy_param_count() -> None:
    assert len(TOY_PARAMS) == 21
    assert sum(TOY_PARAMS) == 2_098_432  # 8,393,728 bytes in float32


@pytest.mark.toy_runs(*DP8_RUNS)
def test_default_budget_shards_every_parameter(dp8: Path) -> None:
    rec, sol = _outputs(dp8, "mesh=8")
    params = sol[sol.role == "param"]
    assert len(params) == 21
    # high = 1/8: every parameter at its smallest ratio, i.e. sharded on dp.
    assert all(p.startswith("S(") for p in params.output_placement), params.output_placement
    # Hand computation: every toy dim is divisible by 8, so each ratio is exactly 1/8.
    pm = rec["param_memory"]
    assert pm["ratio_sum"] == pytest.approx(21 / 8, rel=1e-12)
    assert pm["high"] == pytest.approx(21 / 8, rel=1e-12)
    assert pm["full_bytes"] == 4 * sum(TOY_PARAMS)
    assert pm["bytes_per_device"] == pytest.approx(4 * sum(TOY_PARAMS) / 8, rel=1e-12)
    # Gradient sinks carry their parameter's placement (fwd/bwd tie).
    grads = sol[sol.role == "grad"].set_index("name")
    fqn_of = _fqns(dp8)
    for row in params.itertuples():
        fqn = fqn_of[row.name]
        assert grads.loc[f"output:grad:{fqn}", "output_placement"] == row.output_placement


@pytest.mark.toy_runs(*DP8_RUNS)
def test_no_budget_replicates_parameters(dp8: Path) -> None:
    rec, sol = _outputs(dp8, *NO_BUDGET_ADDITIVE)
    assert "param_memory" not in rec
    params = sol[sol.role == "param"]
    assert set(params.output_placement) == {"R"}
    budget_rec, _ = _outputs(dp8, "mesh=8")
    # The budget can only cost time: the unconstrained optimum is a lower bound of the
    # budgeted additive solve (candidate 0 of that run's step-time search).
    assert rec["objective"] <= budget_rec["additive_plan_us"] + 1e-9
    # the step-time run without the budget: its additive plan is this one, and the plan
    # it returns is no slower by the simulation
    step_rec, _ = _outputs(dp8, *NO_BUDGET)
    assert step_rec["additive_plan_us"] == pytest.approx(rec["objective"], rel=1e-9)
    assert step_rec["step_time_us"] <= rec["step_time_us"] * (1 + 1e-12)


# Ops that only relay a gradient between the op computing it (mm, the norm's or the
# embedding's backward) and its sink: the reduction may sit on any of their edges.
_RELAY_OPS = {"aten.t.default", "aten.view.default", "aten._unsafe_view.default",
              "aten._to_copy.default", "aten.transpose.int", "getitem", "output"}


def _gradient_collectives(tmp: Path, *overrides: str) -> dict[str, tuple[list[str], list]]:
    """Per parameter fqn: the collectives on the path from the op computing its
    gradient to the gradient sink, and the (shape, reduce dtype, bytes) of each reduced
    tensor."""
    cfg = load_resolved(["model=toy", f"results_dir={tmp}", *overrides])
    solve = Path(stage_dirs(cfg).solve)
    topo = Path(stage_dirs(cfg).topology)
    sol = pd.read_parquet(solve / "solution.parquet").set_index("node")
    edges = pd.read_parquet(topo / "edges.parquet")
    red = pd.read_parquet(solve / "redistributions.parquet")
    by_edge = {(r.producer, r.consumer): r for r in red.itertuples()}
    out = {}
    for sink in sol[sol.role == "grad"].itertuples():
        node, colls, tensors = sink.Index, [], []
        while True:
            (producer,) = edges[edges.consumer == node].producer.tolist()
            r = by_edge.get((producer, node))
            if r is not None:
                colls += list(r.collectives)
                tensors.append((tuple(r.shape), r.reduce_dtype, r.bytes))
            node = producer
            if sol.loc[node, "op"] not in _RELAY_OPS:
                break
        out[sink.name.removeprefix("output:grad:")] = (colls, tensors)
    return out


def _numel(shape: tuple) -> int:
    return math.prod(shape)


@pytest.mark.toy_runs(*DP8_RUNS)
def test_default_budget_is_fsdp_like(dp8: Path) -> None:
    """Every weight is stored sharded on dp, all-gathered for use (again for backward when
    the backward reads it: FSDP2's reshard_after_forward), and its gradient reaches it
    through one reduce-scatter on dp in float32, the model's reduce dtype (ZeRO-3 /
    FSDP2 with MixedPrecisionPolicy(reduce_dtype=float32))."""
    rec, sol = _outputs(dp8, "mesh=8")
    grads = _gradient_collectives(dp8, "mesh=8")
    assert len(grads) == 21
    reduced = []
    for fqn, (colls, tensors) in grads.items():
        assert colls == ["reduce_scatter(dp)"], (fqn, colls)
        (shape, dtype, nbytes), = tensors
        # reduce-scatter input: the full gradient, n * L = numel elements, in float32
        assert dtype == "float32", (fqn, tensors)
        assert nbytes == _numel(shape) * 4, (fqn, tensors)
        reduced.append(_numel(shape))
    assert sorted(reduced) == sorted(TOY_PARAMS)
    coll = rec["collectives"]
    # one all-gather per parameter (of its sharded storage) and one more for each of the
    # 20 weights whose forward copy the backward reads (all but the embedding table,
    # whose backward reads only the token ids), one reduce-scatter per gradient, and the
    # two 0-d loss reductions (loss, total weight: 4 bytes each; an all-reduce is a
    # reduce-scatter + an all-gather: 2 x 30 µs of latency, + 2 * 7/8 * 4 B / 390e9 B/s
    # = 1.8e-5 µs, each)
    assert coll["all_gather(dp)"]["count"] == 21 + 20
    assert coll["reduce_scatter(dp)"]["count"] == 21
    assert coll["all_reduce(dp)"] == {"count": 2, "bytes": 8, "us": pytest.approx(120.0, abs=1e-3)}
    assert set(coll) == {"all_gather(dp)", "reduce_scatter(dp)", "all_reduce(dp)"}


@pytest.mark.toy_runs(*DP8_RUNS)
def test_no_budget_is_ddp_like(dp8: Path) -> None:
    """Weights replicated, activations batch-sharded, every gradient all-reduced on dp in
    float32. A ring all-reduce costs exactly a reduce-scatter then an all-gather (one
    link model, pipeline/costmodel/comm.py), so the plan may run a gradient's all-reduce
    as that pair (listed from the sink back: all-gather, then reduce-scatter) at the
    same cost."""
    rec, sol = _outputs(dp8, *NO_BUDGET_ADDITIVE)
    grads = _gradient_collectives(dp8, *NO_BUDGET_ADDITIVE)
    reduced = []
    pairs = 0
    for fqn, (colls, tensors) in grads.items():
        assert colls in (["all_reduce(dp)"], ["all_gather(dp)", "reduce_scatter(dp)"]), \
            (fqn, colls)
        shape, dtype, nbytes = tensors[-1]  # the reduction (the first from the op)
        assert dtype == "float32" and nbytes == _numel(shape) * 4, (fqn, tensors)
        pairs += len(colls) == 2
        reduced.append(_numel(shape))
    assert sorted(reduced) == sorted(TOY_PARAMS)
    mm = sol[sol.op == "aten.mm.default"]
    # forward and activation-gradient matmuls run on batch shards
    assert (mm.output_placement == "S(0)").sum() >= 14, mm.output_placement.value_counts()
    assert rec["collectives"]["all_reduce(dp)"]["count"] == 21 - pairs + 2
    if pairs:
        assert rec["collectives"]["reduce_scatter(dp)"]["count"] == pairs
        assert rec["collectives"]["all_gather(dp)"]["count"] == pairs
    assert set(rec["collectives"]) <= {"all_reduce(dp)", "reduce_scatter(dp)", "all_gather(dp)"}


@pytest.mark.toy_runs(("mesh=8", "lazy_costs=false"), ("mesh=8", "lazy_costs=true"))
def test_eager_costs_store_the_budget_row(toy_results: ToyResults) -> None:
    from pipeline.stages.costs.factors_file import load_factors

    toy_results.run("mesh=8", "lazy_costs=false")
    toy_results.run("mesh=8", "lazy_costs=true")
    dp8 = toy_results.root
    rec, sol = _outputs(dp8, "mesh=8", "lazy_costs=false")
    lazy_rec, lazy_sol = _outputs(dp8, "mesh=8")
    costs_dir = Path(stage_dirs(load_resolved(["model=toy", f"results_dir={dp8}", "mesh=8",
                                               "lazy_costs=false"])).costs)
    (row,) = load_factors(costs_dir / "factors.npz").linear_constraints
    assert row.name == "param_memory"
    # high = low bound = 21 parameters at ratio 1/8 (every toy dim divides by 8)
    assert row.high == pytest.approx(21 / 8, rel=1e-12)
    assert row.low == pytest.approx(21 / 8, rel=1e-12)
    # 12 parameter groups: the 9 per-layer parameters of the 2 (tied) layers, the
    # embedding, the final norm and the output; each group's most sharded label has
    # ratio 1/8 per member parameter
    assert len(row.coef) == 12
    assert sum(float(c.min()) for c in row.coef.values()) == pytest.approx(21 / 8, rel=1e-12)
    facts = json.loads((costs_dir / "costs.json").read_text())["param_memory"]
    assert len(facts["params"]) == 21 and sum(facts["bytes"]) == 4 * sum(TOY_PARAMS)
    # the plan and its budget facts do not depend on the cost mode
    assert rec["placement_hash"] == lazy_rec["placement_hash"]
    assert rec["objective"] == lazy_rec["objective"]
    assert rec["param_memory"] == lazy_rec["param_memory"]


def test_infeasible_budget_stops_eager_costs(tmp_path: Path) -> None:
    dp8 = tmp_path  # a run of its own: it writes the pinned config's trace and topology
    pin = "constraints.nodes=[{match:'output:grad:layers.0.attention.wq.weight',placement:R}]"
    proc = _run(dp8, "mesh=8", "lazy_costs=false", pin)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "constraints.param_memory.high=0.125 (ratio-sum bound 2.625): infeasible" in (
        proc.stderr)
    dirs = stage_dirs(load_resolved(["model=toy", f"results_dir={dp8}", "mesh=8",
                                     "lazy_costs=false", pin]))
    assert (Path(dirs.topology) / "topology.json").exists()  # the stages before ran
    assert not Path(dirs.costs).exists()  # nothing of the costs stage is left


def _fqns(tmp: Path) -> dict[str, str]:
    """Node name -> fqn of the mesh-8 topology."""
    cfg = load_resolved(["model=toy", f"results_dir={tmp}", "mesh=8"])
    nodes = pd.read_parquet(Path(stage_dirs(cfg).topology) / "nodes.parquet")
    return dict(zip(nodes["name"], nodes["fqn"]))


@pytest.mark.parametrize("overrides,expected", [
    (["constraints.nodes=[{match:primals_1,placement:'S(5)'}]"],
     "constraints.nodes[match=primals_1]: placement=S(5) is not a strategy of node primals_1"),
    (["constraints.nodes=[{match:nosuch_node,placement:R}]"],
     "constraints.nodes[match=nosuch_node]: matches no node"),
    # A pin on the gradient keeps the (tied) parameter replicated, but the budget counts it.
    (["constraints.nodes=[{match:'output:grad:layers.0.attention.wq.weight',placement:R}]"],
     "constraints.param_memory.high=0.125 (ratio-sum bound 2.625): infeasible"),
    (["constraints.nodes=[{match:primals_1,placement:P}]"],
     "Partial"),
])
@pytest.mark.toy_runs(DP8_RUNS[0])
def test_infeasible_constraints_fail_with_one_line(toy_results: ToyResults, tmp_path: Path,
                                                   overrides: list[str],
                                                   expected: str) -> None:
    # A copy of the shared mesh-8 trace: it is reused, each case fails at its own stage.
    dp8 = tmp_path / "results"
    toy_results.copy_run(dp8, *DP8_RUNS[0], upto="trace")
    proc = _run(dp8, "mesh=8", *overrides)
    assert proc.returncode == 2, proc.stderr[-2000:]
    if "Partial" not in expected:  # refused at its stage: the copied trace was reused
        assert "trace: reusing" in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and " INFO" not in ln
             and "Warning" not in ln and "warn" not in ln.lower()]
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
    if "Partial" not in expected:  # a config error: nothing is resolved or written
        solve = Path(stage_dirs(load_resolved(["model=toy", f"results_dir={dp8}", "mesh=8",
                                               *overrides])).solve)
        assert not (solve / "run.json").exists() and not solve.exists()


PINNED = ("mesh=2x4", "constraints.outputs=S(0)S(2)", "constraints.param_memory=null")


@pytest.mark.toy_runs(PINNED)
def test_outputs_pin_logits(toy_results: ToyResults) -> None:
    sol = toy_results.run(*PINNED).solution()  # python -m pipeline exited 0
    logits = sol[(sol.op == "aten._unsafe_view.default") & (sol.layer.isna())]
    pinned = logits[logits.output_placement == "S(0)S(2)"]
    assert len(pinned) == 1, logits[["name", "output_placement"]]


# --------------------------------------------------------------------------- Lagrangian


def _chain(unary: list[list[float]], tables: list[np.ndarray]) -> MRF:
    factors = [PairwiseFactor(np.arange(t.shape[0], dtype=np.int32),
                              np.arange(t.shape[1], dtype=np.int32), t) for t in tables]
    return MRF(domain_sizes=np.array([len(u) for u in unary]),
               unary=[np.array(u, dtype=float) for u in unary],
               edges=np.array([[i, i + 1] for i in range(len(tables))]).reshape(-1, 2),
               factor=factors.__getitem__)


def _brute(mrf: MRF, row: LinearConstraint) -> float:
    import itertools

    best = math.inf
    for labels in itertools.product(*[range(k) for k in mrf.domain_sizes]):
        x = np.array(labels)
        if row.low - 1e-12 <= row_value(row, x) <= row.high + 1e-12:
            best = min(best, mrf.evaluate(x))
    return best


def test_lagrangian_matches_brute_force_and_bound_holds() -> None:
    from pipeline.solvers.trws import solve_trws

    rng = np.random.default_rng(0)
    for _ in range(20):
        n = 5
        unary = [list(rng.uniform(0, 10, 3)) for _ in range(n)]
        tables = [rng.uniform(0, 5, (3, 3)) for _ in range(n - 1)]
        mrf = _chain(unary, tables)
        coef = {g: np.array([1.0, 0.5, 0.25]) for g in range(n)}
        row = LinearConstraint("budget", coef, low=0.0, high=float(rng.uniform(1.25, 4.0)))
        res = solve_with_row(mrf, row, lambda m: solve_trws(m, max_iters=50),
                             bisect_steps=12)
        opt = _brute(mrf, row)
        assert row_value(row, res.labels) <= row.high + 1e-9
        assert res.objective >= opt - 1e-9
        assert res.lower_bound <= opt + 1e-9


def test_tight_row_is_an_exact_restriction() -> None:
    mrf = _chain([[0.0, 1.0], [0.0, 1.0]], [np.array([[0.0, 5.0], [5.0, 0.0]])])
    row = LinearConstraint("budget", {0: np.array([1.0, 0.5]), 1: np.array([1.0, 0.5])},
                           low=0.0, high=1.0)
    restricted, tight = tighten(mrf, row)
    assert tight
    assert np.isinf(restricted.unary[0][0]) and np.isinf(restricted.unary[1][0])


def test_repair_reaches_feasibility() -> None:
    mrf = _chain([[0.0, 3.0], [0.0, 1.0]], [np.zeros((2, 2))])
    row = LinearConstraint("budget", {0: np.array([1.0, 0.0]), 1: np.array([1.0, 0.0])},
                           low=0.0, high=1.0)
    labels = repair(mrf, row, np.array([0, 0]))
    # Moving group 1 costs 1.0 per unit of violation removed, group 0 costs 3.0.
    assert labels.tolist() == [0, 1]
