"""Recipes (config ``recipe``, pipeline/stages/topology/pins.py): each pins the placements it
promises on the toy model, costs no less than the free planner under the same cost
model, and a bad or inapplicable recipe fails in one line before anything is written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from plan_facts import weight_derived

from pipeline.core.recipes import RECIPES, recipe_dim_roles

MESH = ("mesh=2x4", "mesh_names=[dp,tp]")
FREE = (*MESH, "constraints.param_memory=null")  # recipes with the default inputs S(0)R
# ddp, fsdp, hsdp put the batch on both mesh dims (inputs S(0)S(0)): their plans are plans
# of the free problem with those inputs
FREE_DATA = (*FREE, "constraints.inputs=S(0)S(0)")
RECIPE_RUNS = tuple((*MESH, f"recipe={r}") for r in ("ddp", "fsdp", "hsdp", "fsdp_tp"))
CP_RUN = ("mesh=2x2x2", "recipe=fsdp_tp_cp")  # dp, cp, tp

# The toy model's parameters by their name within a layer (or at the top level) and
# what Megatron does with each on tp: column-parallel (output features, S(0) of an
# nn.Linear weight [out, in]), row-parallel (input features, S(1)), vocabulary-parallel
# embedding (S(0)), replicated norm weights.
COLUMN = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
          "feed_forward.w1.weight", "feed_forward.w3.weight", "output.weight")
ROW = ("attention.wo.weight", "feed_forward.w2.weight")
NORMS = ("attention_norm.weight", "ffn_norm.weight", "norm.weight")
EMBEDDING = ("tok_embeddings.weight",)


def _short(fqn: str) -> str:
    return fqn.split(".", 2)[2] if fqn.startswith("layers.") else fqn


def _promised(recipe: str) -> tuple[dict[str, str], str, str | None]:
    """(placement per parameter, inputs placement, residual-add placement) on (dp, tp)
    [(dp, cp, tp) for fsdp_tp_cp], written out by hand from the recipe's definition.
    With tp, a matrix sharded on dim 0 over tp is sharded on dim 1 over the data dims
    before it (FSDP2 shards the TP-local tensor: the same bytes per rank, gathered over
    the data dims only; S(0) on dp would nest outside tp's S(0))."""
    every = COLUMN + ROW + NORMS + EMBEDDING
    if recipe == "ddp":
        return {p: "RR" for p in every}, "S(0)S(0)", "S(0)S(0)"
    if recipe == "fsdp":
        return {p: "S(0)S(0)" for p in every}, "S(0)S(0)", "S(0)S(0)"
    if recipe == "hsdp":
        return {p: "RS(0)" for p in every}, "S(0)S(0)", "S(0)S(0)"
    if recipe == "fsdp_tp":
        return ({**{p: "S(1)S(0)" for p in COLUMN + EMBEDDING}, **{p: "S(0)S(1)" for p in ROW},
                 **{p: "S(0)R" for p in NORMS}}, "S(0)R", "S(0)S(1)")
    assert recipe == "fsdp_tp_cp"
    return ({**{p: "S(1)S(1)S(0)" for p in COLUMN + EMBEDDING},
             **{p: "S(0)S(0)S(1)" for p in ROW}, **{p: "S(0)S(0)R" for p in NORMS}},
            "S(0)S(1)R", "S(0)S(1)S(1)")


def test_dim_roles() -> None:
    assert recipe_dim_roles("ddp", ["dp", "tp"]) == ("replicate", "replicate")
    assert recipe_dim_roles("hsdp", ["dp", "cp", "tp"]) == ("replicate", "shard", "shard")
    assert recipe_dim_roles("fsdp_tp", ["dp", "cp", "tp"]) == ("shard", "shard", "tp")
    assert recipe_dim_roles("fsdp_tp_cp", ["dp", "cp", "tp"]) == ("shard", "cp", "tp")
    for recipe, names in (("hsdp", ["dp"]), ("fsdp_tp", ["tp"]), ("fsdp_tp", ["dp", "cp"]),
                          ("fsdp_tp_cp", ["dp", "tp"]), ("fsdp_tp_cp", ["cp", "tp"])):
        with pytest.raises(ValueError, match=rf"^recipe={recipe}: .*mesh_names=\["):
            recipe_dim_roles(recipe, names)


@pytest.mark.toy_runs(*RECIPE_RUNS, CP_RUN, FREE, FREE_DATA)
@pytest.mark.parametrize("overrides", (*RECIPE_RUNS, CP_RUN),
                         ids=lambda o: o[-1].split("=")[1])
def test_recipe_placements(toy_results: object, overrides: tuple[str, ...]) -> None:
    """solution.parquet holds the promised placements: every parameter and its gradient,
    the inputs, the residual stream (the 2 residual adds of each of the 2 layers); the
    objective is no less than the free planner's lower bound (the recipe's plan is a
    plan of that problem: same topology strategies and inputs, same cost model, no
    budget)."""
    recipe = overrides[-1].split("=")[1]
    run = toy_results.run(*overrides)  # type: ignore[attr-defined]
    params, inputs, residual = _promised(recipe)
    nodes = pq.read_table(Path(run.dirs.topology) / "nodes.parquet").to_pylist()
    got: dict[str, set[str]] = {}
    grads: dict[str, set[str]] = {}
    for row, node in zip(run.plan, nodes):
        if row["role"] == "param":
            got.setdefault(_short(node["fqn"]), set()).add(row["output_placement"])
        elif row["role"] == "grad":
            grads.setdefault(_short(node["fqn"]), set()).add(row["output_placement"])
        elif row["role"] == "input":
            assert row["output_placement"] == inputs, row["name"]
    assert got == {p: {want} for p, want in params.items()}
    assert grads == got
    pins = json.loads((Path(run.dirs.topology) / "topology.json").read_text())["pins"]
    module = dict(zip(*pq.read_table(Path(run.dirs.trace) / "graph.parquet",
                                     columns=["name", "module_path"]).to_pydict().values()))
    adds = [r for r in run.plan if r["op"] == "aten.add.Tensor" and r["phase"] == "fwd"
            and r["layer"] is not None and module[r["name"]] == r["layer"]]  # the skips
    assert len(adds) == 4
    assert {r["output_placement"] for r in adds} == {pins[r["name"]] for r in adds} == {residual}
    assert run.record["recipe"] == recipe
    if overrides[0] == "mesh=2x4":
        free_run = FREE if inputs == "S(0)R" else FREE_DATA
        free = toy_results.run(*free_run).record  # type: ignore[attr-defined]
        additive = free["step_time_search"]["candidates"][0]["additive_us"]  # its plan
        assert run.record["objective"] >= free["lower_bound"] - 1e-6
        assert run.record["objective"] >= additive - 1e-6  # the certified additive optimum
        assert free["additive_status"] == "Optimal"
        assert abs(additive - free["lower_bound"]) <= 1e-9 * additive
        # the recipe's plan is one of the free problem's: no plan steps below its bound
        assert run.record["step_time_us"] >= free["step_time_lower_bound_us"] * (1 - 1e-9)


@pytest.mark.toy_runs(*RECIPE_RUNS, FREE, MESH)
def test_recipes_report(toy_results: object, tmp_path: Path) -> None:
    """recipes.parquet pairs every recipe run with each planner run of the same cost
    model (here the default budget and no budget), with the ratios of their objectives
    and step times."""
    from pipeline.stages.report.stage import run_report

    runs = [toy_results.run(*o) for o in (*RECIPE_RUNS, FREE, MESH)]  # type: ignore
    root = Path(toy_results.root)  # type: ignore[attr-defined]
    run_report_dir = tmp_path / "results"
    for run in runs:  # copy the solve directories: the report trusts a run record whose
        # placement hash matches its solution.parquet
        rel = Path(run.dirs.solve).relative_to(root)
        dest = run_report_dir / rel
        dest.mkdir(parents=True)
        for name in ("run.json", "solution.parquet", "redistributions.parquet"):
            (dest / name).write_bytes((Path(run.dirs.solve) / name).read_bytes())
    run_report(run_report_dir)
    table = pq.read_table(run_report_dir / "report" / "recipes.parquet").to_pylist()
    assert len(table) == 4 * 2
    by_id = {r.record["run_id"]: r.record for r in runs}
    for row in table:
        rec, plan = by_id[row["recipe_run_id"]], by_id[row["planner_run_id"]]
        assert rec["recipe"] == row["recipe"] and "recipe" not in plan
        assert row["objective_ratio"] == rec["objective"] / plan["objective"]
        assert row["step_time_ratio"] == rec["step_time_us"] / plan["step_time_us"]
        assert row["recipe_tokens_per_s_per_device"] == rec["tokens_per_s_per_device"]
        assert row["recipe_step_time_gap"] == rec["step_time_gap"]
        # the verdict by step time, ties within 2 % (the default uncertainty)
        a, b = rec["step_time_us"], plan["step_time_us"]
        assert row["step_time_uncertainty"] == 0.02
        want = "tie" if abs(a - b) <= 0.02 * min(a, b) else (
            "planner faster" if b < a else "recipe faster")
        assert row["verdict"] == want
    assert {r["recipe"] for r in table} == {"ddp", "fsdp", "hsdp", "fsdp_tp"}


@pytest.mark.parametrize(("args", "message"), [
    (("recipe=foo",), "recipe=foo: allowed ddp, fsdp, hsdp, fsdp_tp, fsdp_tp_cp, null"),
    (("recipe=fsdp_tp_cp",), "recipe=fsdp_tp_cp: needs mesh dims named cp and tp and at "
     "least one data dim; got mesh_names=[dp,tp]"),
    (("recipe=fsdp", "constraints.inputs=S(0)R"), "constraints.inputs=S(0)R: recipe=fsdp "
     "places the inputs itself; allowed null with a recipe"),
])
def test_bad_recipe(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    """One line naming the recipe (and the mesh names), exit 2, nothing written."""
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "model=toy", *MESH, *args,
                           f"results_dir={out}"], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == message
    assert not out.exists()


def test_recipe_names() -> None:
    assert RECIPES == ("ddp", "fsdp", "hsdp", "fsdp_tp", "fsdp_tp_cp")


def test_recipe_is_a_topology_key() -> None:
    """A recipe changes the topology directory (its pins) and everything below, not the
    trace; without one the directories are those of before the key existed."""
    from pipeline.config import load_resolved, stage_dirs, stage_keys

    plain = load_resolved(["model=toy", *MESH])
    pinned = load_resolved(["model=toy", *MESH, "recipe=fsdp"])
    a, b = stage_dirs(plain), stage_dirs(pinned)
    assert a.trace == b.trace and a.topology != b.topology
    assert "recipe" not in stage_keys(plain, "topology")
    assert stage_keys(pinned, "topology")["recipe"] == "fsdp"
    assert stage_keys(pinned, "trace") == stage_keys(plain, "trace")


def test_plans_table() -> None:
    """The paper's plans table: a recipe's ratios are to the planner run of the same cost
    model with the same constraints (else the first planner run); another model's run
    is not compared."""
    import pandas as pd

    from pipeline.tools.paper.tables import plans_markdown, plans_table

    def cfg(model: str, budget: object) -> str:
        return json.dumps({"model": {"name": model}, "mesh": [2, 4], "hardware": {"n": 1},
                           "constraints": {"param_memory": budget}})

    runs = pd.DataFrame([
        {"run_id": "p1", "model": "toy", "mesh": "2x4", "recipe": None, "objective": 100.0,
         "step_time_us": 80.0, "config_json": cfg("toy", {"high": 0.125})},
        {"run_id": "p2", "model": "toy", "mesh": "2x4", "recipe": None, "objective": 90.0,
         "step_time_us": 70.0, "config_json": cfg("toy", None)},
        {"run_id": "r1", "model": "toy", "mesh": "2x4", "recipe": "ddp", "objective": 95.0,
         "step_time_us": 60.0, "config_json": cfg("toy", None)},
        {"run_id": "r2", "model": "big", "mesh": "2x4", "recipe": "fsdp", "objective": 5.0,
         "step_time_us": 4.0, "config_json": cfg("big", None)},
    ])
    t = plans_table(runs).set_index("run_id")
    assert t.loc["r1", "planner_run_id"] == "p2"
    assert t.loc["r1", "objective_ratio"] == 95.0 / 90.0
    assert t.loc["r1", "step_time_ratio"] == 60.0 / 70.0
    assert t.loc["p1", "objective_ratio"] == 1.0 and t.loc["r1", "plan"] == "ddp"
    assert pd.isna(t.loc["r2", "planner_run_id"]) and math.isnan(t.loc["r2", "objective_ratio"])
    md = plans_markdown(plans_table(runs), "Plans", "footer")
    assert "| toy | 2x4 | ddp | 1 | 60.0 | n/a | 95.0 |" in md
    # ranked by step time within a cost model (toy: r1 60, p2 70, p1 80; big: r2 alone).
    # 10 %: 70 > 60 + 6 and 80 > 70 + 7, no tie; 15 %: 70 > 60 + 9 leads a class that 80
    # joins (<= 70 + 10.5); 20 %: 70 <= 60 + 12 joins r1's class, 80 > 72 leads its own
    t = plans_table(runs)
    assert list(t["run_id"]) == ["r1", "p2", "p1", "r2"]
    assert list(t["rank"]) == ["1", "2", "3", "1"]
    assert list(plans_table(runs, 0.1)["rank"]) == ["1", "2", "3", "1"]
    assert list(plans_table(runs, 0.15)["rank"]) == ["1", "2 (tie)", "2 (tie)", "1"]
    assert list(plans_table(runs, 0.2)["rank"]) == ["1 (tie)", "1 (tie)", "3", "1"]


TP_RUNS = (("mesh=2x2", "mesh_names=[dp,tp]", "recipe=fsdp_tp"),
           ("mesh=2x2x2", "mesh_names=[dp,cp,tp]", "recipe=fsdp_tp"))
#: Megatron-LM tensor parallelism with sequence parallelism, per transformer layer and
#: direction, on the tp group (Korthikanti et al. 2022, "Reducing Activation Recomputation
#: in Large Transformer Models", sec. 4.2.2 and Fig. 5: g / g-bar are an all-gather before
#: the attention and the MLP and a reduce-scatter after each; backward swaps them, "four
#: all-gathers and four reduce-scatters" per layer in all).
MEGATRON_SP = {"fwd": {"all_gather": 2, "reduce_scatter": 2},
               "bwd": {"all_gather": 2, "reduce_scatter": 2}}


@pytest.mark.toy_runs(*TP_RUNS)
@pytest.mark.parametrize("overrides", TP_RUNS, ids=lambda o: o[0].split("=")[1])
def test_fsdp_tp_is_megatron_sp(toy_results: object, overrides: tuple[str, ...]) -> None:
    """recipe=fsdp_tp on toy: counted from redistributions.parquet, the collectives over
    tp (alone or in a flattened group) per layer and direction are Megatron-SP's; the
    only other ones on tp in a layer are the all-reduces of the two norm weights'
    gradients (their inputs are sequence-sharded); no all-to-all on tp anywhere; no
    weight is all-gathered over tp (tensor-parallel weights stay sharded in compute)."""
    run = toy_results.run(*overrides)  # type: ignore[attr-defined]
    nodes = pq.read_table(Path(run.dirs.topology) / "nodes.parquet").to_pylist()
    layer = {n["name"]: n["layer"] for n in nodes}
    phase = {n["name"]: n["phase"] for n in nodes}
    weights = weight_derived(nodes)
    rows = pq.read_table(Path(run.dirs.solve) / "redistributions.parquet").to_pylist()
    per_layer: dict[tuple[str, str], dict[str, int]] = {}
    norm_grads: dict[str, int] = {}
    for row in rows:
        for coll in row["collectives"]:
            kind, group = coll.rstrip(")").split("(")
            if "tp" not in group.split("+"):
                continue
            assert kind != "all_to_all", row
            assert not (kind == "all_gather" and row["producer_name"] in weights), row
            where = layer[row["consumer_name"]]
            if where is None:
                continue
            if row["consumer_name"].startswith("output:grad:"):
                assert kind == "all_reduce" and "norm" in row["consumer_name"], row
                norm_grads[where] = norm_grads.get(where, 0) + 1
                continue
            counts = per_layer.setdefault((where, phase[row["consumer_name"]]), {})
            counts[kind] = counts.get(kind, 0) + 1
    assert per_layer == {(f"layers.{i}", d): MEGATRON_SP[d] for i in (0, 1)
                         for d in ("fwd", "bwd")}
    assert norm_grads == {"layers.0": 2, "layers.1": 2}
