"""Pins: the placement constraints of the config, applied to the problem's domains.

Keys of ``constraints`` read here (docs/config.md):

* ``inputs``: placement of the plain model inputs (the token batch); default
  Shard(0) on the first mesh dim and Replicate on the others;
* ``outputs``: placement of the model output before the loss (the logits);
* ``nodes``: a list of ``{match, placement}``; ``match`` is a node name, a
  parameter FQN or a tied alias of it (glob; the graph has one placeholder per
  parameter tensor, so ``lm_head.weight`` pins ``transformer.wte.weight``), or an op
  name (``aten.mm``). Partial is refused for parameters, inputs and gradients.

A pin restricts a whole group to the labels where the pinned member has the
placement, so every member keeps the same label indexing and ties survive.

Recipes (config ``recipe``): the standard hand-written plans, expressed as pins so that
any run can be compared with them under the same cost model: the parameters and the
residual stream here (:func:`pipeline.stages.topology.recipe_pins.recipe_requests`), every
other node the plan fixes on each mesh dim after (``recipe_pins.dim_pins``). Recipes may
pin Partial placements (a row-parallel matmul's output); users may not.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from pipeline.core.ir import IRNode, graph_outputs, is_tensor_ref
from pipeline.core.recipes import recipe_dim_roles, tp_roles
from pipeline.dtensor.placements import format_placements, parse_placements
from pipeline.stages.topology.candidates import StrategyList
from pipeline.stages.topology.groups import Grouping
from pipeline.stages.topology.problem import (
    ProblemNode,
    StrategyTable,
    TopologyError,
    problem_id_of,
)
from pipeline.stages.topology.recipe_pins import PinRequest, RecipeContext, recipe_requests

#: Roles that never take a Partial placement (a user-visible tensor is never a pending sum).
_NO_PARTIAL_ROLES = frozenset({"param", "buffer", "input", "tangent", "grad"})


@dataclass(frozen=True)
class PinSpec:
    """The pins of ``constraints``, parsed (placements as tuples)."""

    inputs: tuple
    outputs: tuple | None
    outputs_text: str | None
    nodes: list[tuple[str, tuple, str]]  # (match, placement, placement text)
    recipe: RecipeContext | None = None


def recipe_of(cfg: Any) -> dict[str, Any] | None:
    """The ``recipe`` entry the topology stage adds to the constraints it reads
    (``{name, mesh_names, modules}``: ``modules`` the model family's module roles,
    :func:`pipeline.core.recipes.tp_roles`, ``{}`` without), or None without a recipe."""
    name = cfg.get("recipe")
    if name is None:
        return None
    roles = tp_roles(cfg.model)
    return {"name": str(name), "mesh_names": [str(n) for n in cfg.mesh_names],
            "modules": roles.as_dict() if roles is not None else {}}


def parse_pins(constraints: dict[str, Any], ndim: int) -> PinSpec:
    """Parse the placement texts of ``constraints`` for an ``ndim``-d mesh (and its
    ``recipe`` entry, :func:`recipe_of`: the recipe's inputs placement replaces the
    default one).

    Raises ValueError (one line) for a placement text that does not parse or a recipe
    that does not apply to the mesh.
    """
    from torch.distributed.tensor import Replicate, Shard

    recipe = constraints.get("recipe") or None
    roles: tuple[str, ...] = ()
    if recipe is not None:
        roles = recipe_dim_roles(recipe["name"], recipe["mesh_names"])
    inputs_text = constraints.get("inputs")
    if inputs_text:
        inputs = parse_placements(inputs_text, ndim)
    elif roles:
        inputs = tuple(Replicate() if r == "tp" else Shard(1 if r == "cp" else 0)
                       for r in roles)
    else:
        inputs = (Shard(0),) + (Replicate(),) * (ndim - 1)
    outputs_text = constraints.get("outputs") or None
    outputs = parse_placements(outputs_text, ndim) if outputs_text else None
    nodes = [(entry["match"], parse_placements(entry["placement"], ndim), entry["placement"])
             for entry in constraints.get("nodes") or []]
    ctx = None if recipe is None else RecipeContext(recipe["name"], roles,
                                                    dict(recipe.get("modules") or {}))
    return PinSpec(inputs, outputs, outputs_text, nodes, ctx)


def pin_requests(spec: PinSpec, nodes: list[IRNode], problem: list[ProblemNode],
                 tied_params: dict[str, str] | None = None) -> list[PinRequest]:
    """The pins on problem nodes, in the order they apply: inputs, output, node pins.
    ``tied_params``: ``{alias: parameter}`` of tied parameters (graph metadata).

    Raises TopologyError for an output pin without a model output, a node pin that
    matches nothing, or a Partial pin on a parameter, input or gradient.
    """
    from torch.distributed.tensor import Partial

    id_of = problem_id_of(problem)
    requests = [PinRequest(id_of[n.idx], spec.inputs, "constraints.inputs",
                           format_placements(spec.inputs))
                for n in nodes if n.kind == "placeholder" and n.role == "input"]
    if spec.outputs is not None:
        logits = find_logits(nodes)
        if logits is None:
            raise TopologyError(f"constraints.outputs={spec.outputs_text}: no model output "
                                "found before the loss")
        requests.append(PinRequest(id_of[logits], spec.outputs,
                                   "constraints.outputs", spec.outputs_text))
    aliases: dict[str, list[str]] = {}
    for alias, fqn in (tied_params or {}).items():
        aliases.setdefault(fqn, []).append(alias)
    for match, want, text in spec.nodes:
        hits = [m for m in problem if _matches(m, match, aliases)]
        if any(isinstance(p, Partial) for p in want) \
                and {m.role for m in hits} & _NO_PARTIAL_ROLES:
            raise TopologyError(
                f"constraints.nodes[match={match}]: placement={text} is Partial, "
                "not allowed for parameters, inputs or gradients")
        if not hits:
            raise TopologyError(f"constraints.nodes[match={match}]: matches no node")
        requests.extend(PinRequest(m.id, want, f"constraints.nodes[match={match}]", text)
                        for m in hits)
    if spec.recipe is not None:
        requests.extend(recipe_requests(spec.recipe, problem))
    return requests


def apply_pins(requests: list[PinRequest], problem: list[ProblemNode], table: StrategyTable,
               grouping: Grouping) -> dict[str, str]:
    """Restrict each pinned node's group to the pinned placement (module docstring).

    Returns the applied pins ``{node name: placement text}``. Raises TopologyError
    when the placement is not a strategy of the node.
    """
    pins: dict[str, str] = {}
    for request in requests:
        pinned = problem[request.node]
        strategies = table[pinned.strategy_list]
        keep = [k for k, o in enumerate(strategies.outputs) if o == request.placement]
        if not keep:
            raise TopologyError(f"{request.key}: placement={request.text} is not a strategy "
                                f"of node {pinned.name} (or of the nodes tied to it)")
        if len(keep) < len(strategies):
            restricted: dict[int, int] = {}
            for member in grouping.groups[grouping.group_of[request.node]]:
                old = problem[member].strategy_list
                if old not in restricted:
                    src = table[old]
                    restricted[old] = table.intern(StrategyList(
                        tuple(src.outputs[k] for k in keep), tuple(src.inputs[k] for k in keep),
                        src.fallback))
                problem[member].strategy_list = restricted[old]
        pins[pinned.name] = request.text
    return pins


def find_logits(nodes: list[IRNode]) -> int | None:
    """The model's output before the loss: walking back from the loss value through
    forward ops outside any module (the loss function), the first node produced inside
    a module (for LLaMA the lm-head projection, ``[batch, seq, vocab]``)."""
    loss = next((ref["node"] for ref, desc in graph_outputs(nodes)
                 if is_tensor_ref(ref) and desc.get("kind") == "loss"), None)
    if loss is None:
        return None
    frontier, seen = [loss], set()
    while frontier:
        i = frontier.pop(0)
        if i in seen:
            continue
        seen.add(i)
        n = nodes[i]
        if n.kind == "call_function" and n.module_path and n.phase == "fwd":
            return i
        frontier.extend(r for r in n.refs if nodes[r].role == "activation")
    return None


def _matches(m: ProblemNode, pattern: str, aliases: dict[str, list[str]] | None = None
             ) -> bool:
    """A pin matches a node name, a parameter FQN or a tied alias of it (glob), or an op
    name (``aten.mm``)."""
    if fnmatch.fnmatchcase(m.name, pattern):
        return True
    if m.fqn and m.role in ("param", "buffer") and any(
            fnmatch.fnmatchcase(name, pattern)
            for name in (m.fqn, *(aliases or {}).get(m.fqn, ()))):
        return True
    return m.target == pattern or m.target.rsplit(".", 1)[0] == pattern
