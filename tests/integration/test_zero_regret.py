"""Zero regret against the recipes (issue #24): the planner's plan has a simulated step
time no larger than that of any applicable recipe's run (``recipe=<name>``: same model,
mesh, hardware and costs), on the toy model at 2x2 (dp, tp), 2x2x2 (dp, cp, tp) and 2x4
(dp, tp); the run record says which candidate won and what became of every recipe
(pipeline/stages/solve/objective.py, pipeline/stages/topology/recipe_domains.py).

The planner runs with the default constraints (the parameter-memory budget shards every
parameter as far as it goes) and without the budget (``constraints.param_memory=null``,
where every recipe's own plan is a plan of the planner's problem). The recipe runs are
separate ``python -m pipeline`` runs of the shared toy pool."""

from __future__ import annotations

import pytest

from pipeline.core.recipes import RECIPES, check_recipe_model, recipe_dim_roles

MESHES = {"2x2": ("mesh=2x2", "mesh_names=[dp,tp]"),
          "2x2x2": ("mesh=2x2x2", "mesh_names=[dp,cp,tp]"),
          "2x4": ("mesh=2x4", "mesh_names=[dp,tp]")}
NO_BUDGET = ("constraints.param_memory=null",)


def applicable(mesh: str) -> list[str]:
    """The recipes that apply to the toy model on ``mesh`` (the recipes' own rules, as a
    recipe run's validation applies them)."""
    from pipeline.config import load_resolved

    cfg = load_resolved(["model=toy", *MESHES[mesh]])
    shape = [int(s) for s in cfg.mesh]
    names = [str(n) for n in cfg.mesh_names]
    out = []
    for name in RECIPES:
        try:
            recipe_dim_roles(name, names)
            check_recipe_model(name, shape, names, cfg.model)
        except ValueError:
            continue
        out.append(name)
    return out


def _runs() -> list[tuple[str, ...]]:
    out = []
    for mesh, base in MESHES.items():
        out += [base, (*base, *NO_BUDGET)]
        out += [(*base, f"recipe={r}") for r in applicable(mesh)]
    return out


def test_applicable_recipes_by_hand() -> None:
    """The recipes of each mesh, by hand: hsdp needs 2 dims, fsdp_tp a tp dim and a data
    dim, fsdp_tp_cp a cp and a tp dim and a data dim (the toy batch of 16 splits 2, 4 or
    8 ways; its 2048 positions split over tp and cp)."""
    assert applicable("2x2") == ["ddp", "fsdp", "hsdp", "fsdp_tp"]
    assert applicable("2x4") == ["ddp", "fsdp", "hsdp", "fsdp_tp"]
    assert applicable("2x2x2") == ["ddp", "fsdp", "hsdp", "fsdp_tp", "fsdp_tp_cp"]


@pytest.mark.toy_runs(*_runs())
@pytest.mark.parametrize("budget", ("default", "none"))
@pytest.mark.parametrize("mesh", tuple(MESHES))
def test_planner_has_no_regret(toy_results: object, mesh: str, budget: str) -> None:
    base = MESHES[mesh] + (NO_BUDGET if budget == "none" else ())
    planner = toy_results.run(*base).record  # type: ignore[attr-defined]
    search = planner["step_time_search"]
    recipes = applicable(mesh)
    # every recipe is accounted for: searched, or skipped with its one-line reason
    assert set(search["recipes"]) == set(RECIPES)
    for name in set(RECIPES) - set(recipes):
        assert search["recipes"][name]["skipped"].startswith(f"recipe={name}: ")
    # the winner is recorded: the candidate whose simulated step is the plan's
    chosen = [c for c in search["candidates"] if c["source"] == search["chosen"]]
    assert len(chosen) == 1 and chosen[0]["fits"]
    assert chosen[0]["step_time_us"] == planner["step_time_us"]
    assert planner["step_time_us"] == min(c["step_time_us"] for c in search["candidates"]
                                          if c["fits"])
    for name in recipes:
        run = toy_results.run(*MESHES[mesh], f"recipe={name}").record  # type: ignore
        assert run["recipe"] == name
        # zero regret: never slower than the recipe's own run (the simulation adds the
        # same numbers in the same order: 1e-9 relative)
        assert planner["step_time_us"] <= run["step_time_us"] * (1 + 1e-9), (
            name, planner["step_time_us"], run["step_time_us"], search["recipes"][name])
        entry = search["recipes"][name]
        if budget == "none":
            # without the budget the recipe's own plan is a plan of the planner's problem:
            # its domain was searched and found a plan no slower than the recipe's run
            assert "discarded" not in entry, entry
            assert entry["step_time_us"] <= run["step_time_us"] * (1 + 1e-9), (name, entry)
        elif "discarded" in entry:  # the default budget: parameters the recipe replicates
            assert "parameter-memory budget" in entry["discarded"]
            # the recipe's run pins every parameter, so its budget counts none of them
            assert run["param_memory"]["parameters"] == 0
