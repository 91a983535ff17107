"""Recipe domains: each standard plan as a restriction of the planner's own domains.

A planner run (config ``recipe`` null) hands the solve stage, besides its problem, every
recipe's pins (:mod:`pipeline.core.recipes`, :mod:`pipeline.stages.topology.recipe_pins`)
as *domain restrictions of the same problem*: per group, the labels (indices into the
group's strategy list of the planner's topology) that the recipe's run would keep. The
solve stage solves each restricted problem and adds its plans to the step-time search's
candidates (pipeline/stages/solve/objective.py), so the planner's plan is never slower,
by the simulation, than a recipe's plan it could run.

How (no second trace, no second enumeration): the strategy lists as enumerated, before
any pin, are copied; on the copy the recipe's run's pins are applied exactly as a
``recipe=<name>`` run applies them (the user's node and output pins, the recipe's
inputs, parameters and residual stream, then its per-mesh-dim pins); a planner label of
a node is kept when its strategy (its output and inputs placements, the same objects:
pins select entries of the unpinned list) is one the recipe's run keeps, and a group
keeps the labels every member keeps.

The token batch (the model inputs) stays at the run's own placement (``constraints.inputs``
or its default), not the recipe's: the planner's problem pins it. A recipe that places
the batch differently (``fsdp_tp`` on ``dp, cp, tp`` shards it over ``cp`` too) then
starts with a local slice of the batch to the recipe's placement, no communication
(``Replicate -> Shard`` is a local chunk in DTensor); the recipe's run differs from the
candidate only by that edge. ``inputs_moved`` records it.

A recipe that does not apply (its mesh dim names, the model's module roles, the batch or
sequence its dims split: :func:`pipeline.core.recipes.check_recipe_model`; tensor or
context parallelism on a cross-node dim under ``constraints.model_parallel=intra_node``),
or whose pins conflict with the run's pins, is skipped with the reason (one line).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipeline.core.ir import IRNode
from pipeline.core.recipes import RECIPES, check_recipe_model, recipe_dim_roles, tp_roles
from pipeline.stages.topology.groups import Grouping
from pipeline.stages.topology.problem import ProblemNode, StrategyTable, TopologyError

__all__ = ["RecipeDomain", "recipe_contexts", "recipe_domains"]


@dataclass
class RecipeDomain:
    """One recipe as a domain restriction (``labels``: group -> kept labels, only the
    groups it restricts), or skipped (``skipped``: the one-line reason)."""

    recipe: str
    labels: dict[int, list[int]] | None = None
    skipped: str | None = None
    inputs_moved: bool = False

    def to_record(self) -> dict[str, Any]:
        """Plain data for ``topology.json`` (group keys as text)."""
        if self.skipped is not None:
            return {"skipped": self.skipped}
        assert self.labels is not None
        return {"inputs_moved": self.inputs_moved,
                "labels": {str(g): ks for g, ks in sorted(self.labels.items())}}


def recipe_contexts(cfg: Any) -> list[dict[str, Any]]:
    """Every recipe of :data:`pipeline.core.recipes.RECIPES` for a planner run of
    ``cfg``: ``{name, mesh_names, modules}`` (as :func:`~pipeline.stages.topology.pins.
    recipe_of`) when it applies to the mesh and the model, else ``{name, skipped}``. None
    for a run that is itself a recipe's. (``constraints.model_parallel=intra_node``
    depends on the hardware, not a topology key: the solve stage skips there.)"""
    if cfg.get("recipe") is not None:
        return []
    names = [str(n) for n in cfg.mesh_names]
    mesh = [int(m) for m in cfg.mesh]
    roles_of_model = tp_roles(cfg.model)
    out: list[dict[str, Any]] = []
    for name in RECIPES:
        try:
            recipe_dim_roles(name, names)
            check_recipe_model(name, mesh, names, cfg.model)
        except ValueError as err:
            out.append({"name": name, "skipped": str(err)})
            continue
        out.append({"name": name, "mesh_names": names,
                    "modules": roles_of_model.as_dict() if roles_of_model is not None else {}})
    return out


def recipe_domains(contexts: list[dict[str, Any]], constraints: dict[str, Any],
                   nodes: list[IRNode], problem: list[ProblemNode], table: StrategyTable,
                   before: list[int], grouping: Grouping, ndim: int,
                   tied_params: dict[str, str] | None) -> list[RecipeDomain]:
    """Each recipe of ``contexts`` (:func:`recipe_contexts`) as a domain restriction of
    ``problem`` (module docstring). ``before``: each node's strategy list before any pin;
    ``problem`` and ``table``: the planner's, after its pins (neither is changed)."""
    out = []
    for ctx in contexts:
        name = str(ctx["name"])
        if "skipped" in ctx:
            out.append(RecipeDomain(name, skipped=str(ctx["skipped"])))
            continue
        try:
            out.append(_domain(ctx, constraints, nodes, problem, table, before, grouping,
                               ndim, tied_params))
        except (TopologyError, ValueError) as err:
            out.append(RecipeDomain(name, skipped=f"recipe={name}: {str(err).splitlines()[0]}"))
    return out


def _domain(ctx: dict[str, Any], constraints: dict[str, Any], nodes: list[IRNode],
            problem: list[ProblemNode], table: StrategyTable, before: list[int],
            grouping: Grouping, ndim: int, tied_params: dict[str, str] | None
            ) -> RecipeDomain:
    from pipeline.stages.topology.pins import apply_pins, parse_pins, pin_requests
    from pipeline.stages.topology.recipe_pins import apply_dim_pins, dim_pins

    name = str(ctx["name"])
    # the recipe's run: the user's pins but the recipe's inputs (constraints.inputs is
    # refused with a recipe), then the recipe's pins, on a copy of the unpinned problem
    spec = parse_pins({**constraints, "inputs": None, "recipe": ctx}, ndim)
    scratch = table.copy()
    copy = [dataclasses.replace(m, strategy_list=s) for m, s in zip(problem, before)]
    apply_pins(pin_requests(spec, nodes, copy, tied_params), copy, scratch, grouping)
    per_dim = dim_pins(spec.recipe, copy, scratch, nodes, spec.inputs)
    apply_dim_pins(per_dim, copy, scratch, grouping, ndim)

    inputs = {m.id for m in problem if m.role == "input" and m.target == "placeholder"}
    labels: dict[int, list[int]] = {}
    moved = False
    kept: dict[tuple[int, int], frozenset[int]] = {}

    def kept_of(ours: int, theirs: int) -> frozenset[int]:
        # both lists select from the node's list before any pin, entries kept as the same
        # objects (pins.apply_pins, recipe_pins.apply_dim_pins): matched by identity
        hit = kept.get((ours, theirs))
        if hit is None:
            a, b = table[ours], scratch[theirs]
            allowed = {(id(o), id(i)) for o, i in zip(b.outputs, b.inputs)}
            hit = kept[(ours, theirs)] = frozenset(
                k for k in range(len(a)) if (id(a.outputs[k]), id(a.inputs[k])) in allowed)
        return hit

    for g, members in enumerate(grouping.groups):
        mine = table[problem[members[0]].strategy_list]
        keep = set(range(len(mine)))
        for member in members:
            ours, theirs = problem[member].strategy_list, copy[member].strategy_list
            if ours != theirs:  # the same list: restricted by neither beyond the run's pins
                keep &= kept_of(ours, theirs)
        if not keep:
            if set(members) <= inputs:
                moved = True  # the batch stays at the run's placement (module docstring)
                continue
            raise TopologyError(f"its pins leave node {problem[members[0]].name} no strategy "
                                "of the run's (the run's pins conflict with the recipe's)")
        if len(keep) < len(mine):
            labels[g] = sorted(keep)
    return RecipeDomain(name, labels, inputs_moved=moved)
