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

Recipes (config ``recipe``): the standard hand-written plans, torchtitan-style
(``torchtitan/models/llama3/infra/parallelize.py``: ``apply_fsdp``, ``apply_tp``),
expressed as pins so that any run can be compared with them under the same cost model.
Each mesh dim gets a role, ``replicate``, ``shard``, ``tp`` or ``cp``
(:func:`pipeline.core.recipes.recipe_dim_roles`, which has the table of the recipes).

Pinned (every output placement below is one token per mesh dim):

* every parameter: ``R`` on ``replicate``, ``S(0)`` on ``shard`` and ``cp``; on ``tp``
  by its Megatron role, found from the graph: a 2-D weight reaching a matmul is
  *row-parallel* when the matmul's output (through views) is added to the residual
  stream (``add.Tensor``: attention out / FFN down projections), else *column-parallel*;
  column-parallel shards the weight's output-features dim (``S(0)`` of an ``nn.Linear``
  weight ``[out, in]`` read through a transpose, ``S(1)`` of a ``Conv1D`` weight
  ``[in, out]``), row-parallel its input-features dim; an embedding weight is
  ``S(0)`` (vocabulary-parallel, torchtitan's ``RowwiseParallel`` embedding); every other
  parameter (norm weights, biases) ``R``;
* the model inputs (token batch, labels): ``S(0)`` on the data dims, ``S(1)`` on
  ``cp``, ``R`` on ``tp``;
* the residual stream (those residual adds): ``S(0)`` on the data dims, ``S(1)``
  (the sequence) on ``tp`` (sequence parallelism) and on ``cp``.

Everything else (norms, attention, the gathers before a column-parallel matmul and the
reductions after a row-parallel one) is left to the solver, which finds the cheapest
way between the pinned tensors under the same cost model. Gradients follow their
parameters (``fwd_bwd_consistency``), and pinned parameters are outside the parameter
budget, as every pin.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, NamedTuple

from pipeline.core.ir import IRNode, graph_outputs, is_tensor_ref
from pipeline.core.recipes import recipe_dim_roles
from pipeline.dtensor.placements import format_placements, parse_placements
from pipeline.stages.topology.candidates import StrategyList
from pipeline.stages.topology.groups import Grouping
from pipeline.stages.topology.problem import (
    ProblemNode,
    StrategyTable,
    TopologyError,
    problem_id_of,
)

#: Ops a weight passes through on its way to the op that computes with it.
_WEIGHT_PATH_OPS = frozenset({
    "aten._to_copy.default", "aten.detach.default", "aten.alias.default", "aten.t.default",
    "aten.transpose.int", "aten.permute.default", "aten.view.default",
    "aten._unsafe_view.default", "aten.reshape.default", "aten.clone.default",
    "aten.contiguous.default", "aten.expand.default"})
_TRANSPOSES = frozenset({"aten.t.default", "aten.transpose.int", "aten.permute.default"})
_MATMULS = {"aten.mm.default": 1, "aten.addmm.default": 2, "aten.linear.default": 1}
_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
                    "aten.alias.default", "aten.clone.default", "aten.contiguous.default"})

#: Roles that never take a Partial placement (a user-visible tensor is never a pending sum).
_NO_PARTIAL_ROLES = frozenset({"param", "buffer", "input", "tangent", "grad"})


@dataclass(frozen=True)
class PinSpec:
    """The pins of ``constraints``, parsed (placements as tuples)."""

    inputs: tuple
    outputs: tuple | None
    outputs_text: str | None
    nodes: list[tuple[str, tuple, str]]  # (match, placement, placement text)
    recipe: str | None = None
    recipe_roles: tuple[str, ...] = ()  # per mesh dim (recipe_dim_roles)


class PinRequest(NamedTuple):
    """One pin on one node: the placement its output must have."""

    node: int
    placement: tuple
    key: str  # the config key, for error messages
    text: str


def recipe_of(cfg: Any) -> dict[str, Any] | None:
    """The ``recipe`` entry the topology stage adds to the constraints it reads
    (``{name, mesh_names}``), or None without a recipe."""
    name = cfg.get("recipe")
    return None if name is None else {"name": str(name),
                                      "mesh_names": [str(n) for n in cfg.mesh_names]}


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
    return PinSpec(inputs, outputs, outputs_text, nodes,
                   recipe["name"] if recipe else None, roles)


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
        requests.extend(recipe_requests(spec.recipe, spec.recipe_roles, problem))
    return requests


def megatron_roles(problem: list[ProblemNode]) -> tuple[dict[int, tuple[str, int]], list[int]]:
    """The Megatron roles of the parameters and the residual adds (module docstring).

    Returns ``({parameter id: (role, tensor dim sharded on tp)}, [residual add ids])``
    with role ``column``, ``row`` or ``embedding``; parameters absent have no rule.
    """
    consumers: dict[int, list[tuple[int, int]]] = {}
    for m in problem:
        for a, (u, _) in enumerate(m.producers):
            consumers.setdefault(u, []).append((m.id, a))

    def fwd_uses(v: int) -> list[tuple[int, int]]:
        return [(c, a) for c, a in consumers.get(v, []) if problem[c].phase == "fwd"]

    def residual_add(v: int) -> int | None:
        """The add.Tensor ``v``'s output reaches through views, else None."""
        stack, seen = [v], set()
        while stack:
            x = stack.pop()
            for c, _ in fwd_uses(x):
                if c in seen:
                    continue
                seen.add(c)
                if problem[c].target == "aten.add.Tensor":
                    return c
                if problem[c].target in _VIEWS:
                    stack.append(c)
        return None

    roles: dict[int, tuple[str, int]] = {}
    adds: list[int] = []
    for p in problem:
        if p.role != "param" or p.target != "placeholder":
            continue
        ndim = len((p.out_metas[0] or {}).get("shape", ()))
        if ndim != 2:
            continue
        stack, seen = [(p.id, 0)], set()
        while stack:
            x, flips = stack.pop(0)
            for c, a in fwd_uses(x):
                if (c, flips) in seen:
                    continue
                seen.add((c, flips))
                t = problem[c].target
                if t == "aten.embedding.default" and a == 0:
                    roles.setdefault(p.id, ("embedding", 0))
                elif _MATMULS.get(t) == a:
                    out_dim = 0 if (flips + (t == "aten.linear.default")) % 2 else 1
                    add = residual_add(c)
                    if add is not None:
                        roles.setdefault(p.id, ("row", 1 - out_dim))
                        adds.append(add)
                    else:
                        roles.setdefault(p.id, ("column", out_dim))
                elif t in _WEIGHT_PATH_OPS:
                    stack.append((c, flips + (t in _TRANSPOSES)))
    return roles, sorted(set(adds))


def recipe_requests(recipe: str, roles: tuple[str, ...], problem: list[ProblemNode]
                    ) -> list[PinRequest]:
    """The pins of ``recipe`` with mesh-dim ``roles`` (module docstring): every
    parameter and the residual adds (the inputs are ``spec.inputs``)."""
    from torch.distributed.tensor import Replicate, Shard

    key = f"recipe={recipe}"
    megatron, adds = megatron_roles(problem)
    out: list[PinRequest] = []
    for p in problem:
        if p.role != "param" or p.target != "placeholder":
            continue
        ndim = len((p.out_metas[0] or {}).get("shape", ()))
        want = []
        for r in roles:
            if r == "replicate" or ndim == 0:
                want.append(Replicate())
            elif r in ("shard", "cp"):
                want.append(Shard(0))
            else:  # tp
                rule = megatron.get(p.id)
                want.append(Replicate() if rule is None else Shard(rule[1]))
        out.append(PinRequest(p.id, tuple(want), key, format_placements(tuple(want))))
    for a in adds:
        ndim = len((problem[a].out_metas[0] or {}).get("shape", ()))
        if ndim < 2:
            continue
        want = tuple(Shard(1) if r in ("tp", "cp") else Shard(0) for r in roles)
        out.append(PinRequest(a, want, key, format_placements(want)))
    return out


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
