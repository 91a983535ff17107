"""Recipe pins: every node a standard plan fixes, from the model family's module roles.

A recipe (config ``recipe``; the mesh dim roles in :mod:`pipeline.core.recipes`) is a
textbook plan. Its pins come in two parts:

1. **Full pins** (:func:`recipe_requests`, applied with the user's pins): every
   parameter (``R`` on ``replicate``; ``S(0)`` on ``shard`` and ``cp``; on ``tp`` by its
   module role: column-parallel weights and biases shard their output features, the
   ``S(0)`` of an ``nn.Linear`` weight ``[out, in]`` or the ``S(1)`` of a ``Conv1D``
   weight ``[in, out]``, found by walking the weight to its matmul through transposes;
   row-parallel weights shard their input features; the embedding and head shard the
   vocabulary, ``S(0)``; norm weights and row-parallel biases ``R``), and the residual
   stream (the ``add.Tensor`` a row-parallel output reaches through views): ``S(0)`` on
   the data dims, ``S(1)`` (the sequence) on ``tp`` and ``cp``.

2. **Per-dim pins** (:func:`dim_pins`): the placement on one mesh dim of every other node
   the plan fixes, by propagation in graph order. On a mesh dim, a node whose
   producers' placements there are known keeps the strategies that take exactly those
   placements (no collective on that dim); when they give one output placement, that
   is the node's. Where the textbook plan communicates, an *anchor* fixes the node
   instead of propagation:

   * ``tp`` (Megatron-LM tensor parallelism with sequence parallelism, Korthikanti et
     al. 2022, sec. 4.2.2; torchtitan ``apply_tp``): the residual stream ``S(1)``
     (fixed by part 1, so the ``Partial`` output of a row-parallel matmul is
     reduce-scattered into it); a norm's forward output, the tensor its consumers
     outside the norm read, ``R`` (the all-gather of the sequence before the
     column-parallel matmuls: one per norm, however many linears read it, as
     torchtitan's ``PrepareModuleInput``); the backward of a norm reads its activation
     inputs (2-D and up, more than one position) ``S(1)`` (the reduce-scatter of the
     column-parallel input gradients, ``Partial``, into the sequence shard; a reduced
     weight gradient, one position long, is not); the backward of a row-parallel
     linear reads its output gradient from outside the module ``R`` (the all-gather of
     the sequence); the embedding's output enters the residual stream ``S(1)`` (its
     ``Partial`` reduce-scattered). Everything between follows by propagation:
     column-parallel outputs shard their features, attention shards its heads, a
     row-parallel matmul outputs ``Partial``, and in backward the column-parallel input
     gradients are ``Partial`` and summed as such. Per layer that is, forward, 2
     all-gathers and 2 reduce-scatters on ``tp``, and the same in backward (Korthikanti
     et al. 2022, sec. 4.2.2: "four all-gathers and four reduce-scatters" per layer in
     forward and backward), plus the all-reduce of each norm weight's gradient over
     ``tp`` (its input is sequence-sharded; Megatron-LM all-reduces the layernorm
     gradients over the tensor-parallel group with sequence parallelism).
   * data dims (``replicate``, ``shard``): the inputs ``S(0)``; parameters and the ops
     computed from parameters only (their casts and transposes) are free here (FSDP
     gathers them where the cost model finds cheapest; part 1 fixed the parameters), so
     a producer of that kind constrains nothing: activations follow the batch, weight
     gradients are ``Partial`` (reduced into their parameter's placement).
   * ``cp``: only part 1 (the attention's exchange over ``cp`` is the solver's choice
     among the context-parallel strategies).

   A node whose producers are not all known, or that has no zero-communication
   strategy and no anchor (the loss, the embedding's backward), is left to the solver.
   The cost model pays a redistribution per edge, so a ``Partial`` tensor read by two
   nodes that both anchor ``S(1)`` is reduce-scattered twice: none in the ``llama``
   family; in Hugging Face LLaMA-style models, whose decomposed norm backward reads the
   gradient twice and whose embedding output feeds the first norm and the first
   residual add, 2 reduce-scatters per norm backward and one more in the first layer.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, NamedTuple

from pipeline.core.ir import IRNode
from pipeline.dtensor.placements import format_placements, format_strategy_output
from pipeline.stages.topology.problem import ProblemNode, StrategyTable, TopologyError

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
_UNKNOWN = object()  # a producer whose placement on the dim is not fixed
_FREE = object()  # a producer that constrains nothing on the dim (weights on data dims)


class PinRequest(NamedTuple):
    """One pin on one node: the placement its output must have."""

    node: int
    placement: tuple
    key: str  # the config key, for error messages
    text: str


@dataclass(frozen=True)
class RecipeContext:
    """What the recipe's pins are computed from."""

    recipe: str
    roles: tuple[str, ...]  # per mesh dim (recipe_dim_roles)
    modules: dict[str, list[str]]  # TpRoles.as_dict(), or {} without tp


def module_role(path: str, layer: str | None, modules: dict[str, list[str]]) -> str | None:
    """The role (``column``, ``row``, ``norm``, ``embedding``, ``head``) of a module path,
    relative to its layer when it is in one, else None."""
    if not path:
        return None
    rel = path[len(layer) + 1:] if layer and path.startswith(layer + ".") else path
    for role, patterns in modules.items():
        if any(fnmatch.fnmatchcase(rel, p) for p in patterns):
            return role
    return None


def _consumers(problem: list[ProblemNode]) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = {}
    for m in problem:
        for a, (u, _) in enumerate(m.producers):
            out.setdefault(u, []).append((m.id, a))
    return out


def _has_sequence(meta: Any) -> bool:
    """Whether a tensor is an activation with a sequence dim (``[batch, seq, ...]``, more
    than one position), what a norm's backward reads on the sequence shard."""
    shape = (meta or {}).get("shape", ()) if isinstance(meta, dict) else ()
    return len(shape) >= 2 and shape[1] > 1


def _ndim(meta: Any) -> int:
    return len((meta or {}).get("shape", ())) if isinstance(meta, dict) else 0


def param_tp_dims(problem: list[ProblemNode], modules: dict[str, list[str]]
                  ) -> tuple[dict[int, tuple[str, int | None]], list[int]]:
    """Each parameter's module role and the tensor dim it shards on ``tp`` (None:
    replicated), and the residual adds the row-parallel matmuls reach.

    Raises TopologyError for a matrix parameter of a layer whose module has no role.
    """
    consumers = _consumers(problem)

    def fwd_uses(v: int) -> list[tuple[int, int]]:
        return [(c, a) for c, a in consumers.get(v, []) if problem[c].phase == "fwd"]

    def residual_add(v: int) -> int | None:
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

    def matmul_of(p: ProblemNode) -> tuple[int, int] | None:
        """(matmul node, output-features dim of the weight) of a 2-D weight."""
        stack, seen = [(p.id, 0)], set()
        while stack:
            x, flips = stack.pop(0)
            for c, a in fwd_uses(x):
                if (c, flips) in seen:
                    continue
                seen.add((c, flips))
                t = problem[c].target
                if _MATMULS.get(t) == a:
                    return c, 0 if (flips + (t == "aten.linear.default")) % 2 else 1
                if t in _WEIGHT_PATH_OPS:
                    stack.append((c, flips + (t in _TRANSPOSES)))
        return None

    out: dict[int, tuple[str, int | None]] = {}
    adds: list[int] = []
    for p in problem:
        if p.role != "param" or p.target != "placeholder":
            continue
        fqn = p.fqn or ""
        module, leaf = fqn.rsplit(".", 1) if "." in fqn else ("", fqn)
        role = module_role(module, p.layer, modules)
        ndim = _ndim(p.out_metas[0] if p.out_metas else None)
        if role in ("embedding",) and ndim == 2:
            out[p.id] = (role, 0)
        elif role in ("column", "row", "head") and ndim == 2:
            found = matmul_of(p)
            if found is None:
                raise TopologyError(f"recipe: parameter {fqn} of a {role}-parallel module "
                                    "reaches no matmul")
            mm, out_dim = found
            if role == "row":
                out[p.id] = (role, 1 - out_dim)
                add = residual_add(mm)
                if add is not None:
                    adds.append(add)
            else:
                out[p.id] = (role, out_dim)
        elif role in ("column", "head") and ndim == 1 and leaf == "bias":
            out[p.id] = (role, 0)
        elif ndim >= 2 and p.layer is not None and role is None:
            raise TopologyError(f"recipe: parameter {fqn} has no tensor-parallel module "
                                f"role (pipeline/core/recipes.py TP_ROLE_TABLES)")
        else:
            out[p.id] = (role or "replicated", None)
    return out, sorted(set(adds))


def recipe_requests(ctx: RecipeContext, problem: list[ProblemNode]) -> list[PinRequest]:
    """The full pins of the recipe (module docstring, part 1): every parameter and the
    residual adds (the inputs are ``PinSpec.inputs``)."""
    from torch.distributed.tensor import Replicate, Shard

    key = f"recipe={ctx.recipe}"
    # a model without module roles (only data-parallel recipes apply) pins no residual
    # adds here: the per-dim pins place its activations
    tp_dims, adds = param_tp_dims(problem, ctx.modules) if ctx.modules else ({}, [])
    out = []
    for p in problem:
        if p.role != "param" or p.target != "placeholder":
            continue
        ndim = _ndim(p.out_metas[0] if p.out_metas else None)
        tp_dim = tp_dims.get(p.id, ("", None))[1] if "tp" in ctx.roles else None
        tp_at = ctx.roles.index("tp") if "tp" in ctx.roles else len(ctx.roles)
        want = []
        for d, r in enumerate(ctx.roles):
            if r == "replicate" or ndim == 0:
                want.append(Replicate())
            elif r in ("shard", "cp"):
                # FSDP2 on top of TP shards the TP-local tensor's dim 0 (a strided shard,
                # outside the enumerated placements); on a mesh dim before tp, S(0) would
                # nest outside tp's S(0) and its all-gather would involve tp: FSDP takes
                # the other dim of a matrix there (the same bytes per rank, a gather over
                # the data dims only) and leaves a tp-sharded vector replicated
                if tp_dim == 0 and d < tp_at:
                    want.append(Shard(1) if ndim >= 2 else Replicate())
                else:
                    want.append(Shard(0))
            else:
                want.append(Replicate() if tp_dim is None else Shard(tp_dim))
        out.append(PinRequest(p.id, tuple(want), key, format_placements(tuple(want))))
    for a in adds:
        if _ndim(problem[a].out_metas[0]) < 2:
            continue
        want = tuple(Shard(1) if r in ("tp", "cp") else Shard(0) for r in ctx.roles)
        out.append(PinRequest(a, want, key, format_placements(want)))
    return out



# --------------------------------------------------------------------------- per dim


def _proj(placement: Any, d: int) -> Any:
    """The placement on mesh dim ``d`` of an output or input placement (a tuple output:
    one entry per element, None for a non-tensor element)."""
    if placement is None:
        return None
    if len(placement) and (placement[0] is None or isinstance(placement[0], tuple)):
        return tuple(None if el is None else el[d] for el in placement)
    return placement[d]


def weight_derived(problem: list[ProblemNode]) -> list[bool]:
    """Per node, whether it is computed from parameters only (a cast, a transpose)."""
    out = [False] * len(problem)
    for m in problem:
        if m.target in ("placeholder", "output") or not m.producers:
            continue
        out[m.id] = all(problem[u].role == "param" and problem[u].target == "placeholder"
                        or out[u] for u, _ in m.producers)
    return out


@dataclass
class DimPins:
    """Per-dim pins of a recipe: per node, the strategy indices it keeps (of its list
    before any pin), and the text of what is pinned (``*S(1)``: a placement per mesh
    dim, ``*`` where free)."""

    keep: dict[int, set[int]]
    text: dict[int, dict[int, str]]  # node -> {mesh dim: placement text}


def dim_pins(ctx: RecipeContext, problem: list[ProblemNode], table: StrategyTable,
             nodes: list[IRNode], inputs: tuple) -> DimPins:
    """The per-dim pins of the recipe on every mesh dim it fixes (module docstring,
    part 2). ``inputs``: the placement of the model inputs."""
    pins = DimPins({}, {})
    paths = {m.id: nodes[m.graph_idx].module_path if m.graph_idx is not None else ""
             for m in problem}
    derived = weight_derived(problem)
    tp_dims = param_tp_dims(problem, ctx.modules)[0] if "tp" in ctx.roles else {}
    adds = set(param_tp_dims(problem, ctx.modules)[1]) if "tp" in ctx.roles else set()
    for d, role in enumerate(ctx.roles):
        if role == "cp":
            continue
        _propagate(d, role == "tp", ctx, problem, table, paths, derived, tp_dims, adds,
                   inputs, pins)
    return pins


def _propagate(d: int, tp: bool, ctx: RecipeContext, problem: list[ProblemNode],
               table: StrategyTable, paths: dict[int, str], derived: list[bool],
               tp_dims: dict[int, tuple[str, int | None]], adds: set[int], inputs: tuple,
               pins: DimPins) -> None:
    """Propagate the placements on mesh dim ``d`` (``tp``: Megatron-SP anchors, else a
    data dim) and record the pins in ``pins``."""
    from torch.distributed.tensor import Replicate, Shard

    consumers = _consumers(problem)
    role_of = {m.id: module_role(paths[m.id], m.layer, ctx.modules) for m in problem}
    state: dict[int, Any] = {}
    # the copies of a repeated layer share their strategy lists and see the same
    # placements: each selection is made once per (list, what is asked)
    memo: dict[tuple, list[int]] = {}

    def outputs_at(strategies: Any, want: Any) -> list[int]:
        key = (id(strategies), "out", want)
        if key not in memo:
            memo[key] = [k for k, o in enumerate(strategies.outputs) if _proj(o, d) == want]
        return memo[key]

    def matching(strategies: Any, want: list[Any]) -> list[int]:
        key = (id(strategies), "in", tuple(want))
        if key not in memo:
            memo[key] = _matching(strategies, want, d)
        return memo[key]

    def keep(m: ProblemNode, ks: list[int], shown: Any) -> None:
        previous = pins.keep.get(m.id)
        pins.keep[m.id] = set(ks) if previous is None else previous & set(ks)
        pins.text.setdefault(m.id, {})[d] = shown

    for m in problem:
        strategies = table[m.strategy_list]
        if m.target == "output":
            continue
        if m.target == "placeholder":
            if m.role == "param":
                if tp:
                    dim = tp_dims.get(m.id, ("", None))[1]
                    state[m.id] = Replicate() if dim is None else Shard(dim)
                else:
                    state[m.id] = _FREE
                continue
            want = inputs[d] if m.role == "input" else Replicate()
            state[m.id] = want
            keep(m, [k for k, o in enumerate(strategies.outputs) if o[d] == want],
                 format_placements((want,)))
            continue
        if derived[m.id] and not tp:
            state[m.id] = _FREE
            continue
        got = [_FREE if derived[u] and not tp else state.get(u, _UNKNOWN)
               for u, _ in m.producers]
        got = [g if g is _FREE or g is _UNKNOWN or el < 0 or not isinstance(g, tuple)
               else g[el] for g, (_, el) in zip(got, m.producers, strict=True)]
        # a 0-d tensor (a random-number state, a scalar) is whole on every rank
        got = [_FREE if g is _UNKNOWN and _ndim(meta) == 0 else g
               for g, meta in zip(got, m.in_metas, strict=True)]
        role = role_of[m.id]
        ks: list[int] | None = None
        if tp and (m.id in adds or (m.phase == "fwd" and role != "embedding" and any(
                role_of[u] == "embedding" for u, _ in m.producers))):
            # the residual stream, and the embedding's output entering it: S(1)
            ks = outputs_at(strategies, Shard(1))
        elif tp and role == "row" and m.phase == "bwd" and any(
                role_of[u] != "row" and not derived[u] for u, _ in m.producers):
            # a row-parallel linear's output gradient, all-gathered over the sequence
            ks = outputs_at(strategies, Replicate())
        elif tp and role == "norm" and m.phase == "fwd" and any(
                role_of[c] != "norm" and problem[c].phase == "fwd"
                for c, _ in consumers.get(m.id, [])):
            ks = outputs_at(strategies, Replicate())
        elif tp and role == "norm" and m.phase == "bwd":
            want = [Shard(1) if _has_sequence(meta) else (_FREE if g is _UNKNOWN else g)
                    for meta, g in zip(m.in_metas, got, strict=True)]
            ks = matching(strategies, want)
        elif all(g is not _UNKNOWN for g in got):
            ks = matching(strategies, got) or None
        if ks is None:
            continue
        if not ks:
            raise TopologyError(f"recipe={ctx.recipe}: node {m.name} has no strategy with "
                                f"the placement the recipe gives it on mesh dim {d}")
        outs = {_proj(strategies.outputs[k], d) for k in ks}
        state[m.id] = next(iter(outs)) if len(outs) == 1 else _UNKNOWN
        keep(m, ks, "|".join(sorted(_shown(o) for o in outs)))


def _matching(strategies: Any, want: list[Any], d: int) -> list[int]:
    """The strategies whose inputs on mesh dim ``d`` are ``want`` (``_FREE``: any); when
    there is none, those that reach them locally: Replicate to a Partial (DTensor's
    local ``Replicate -> Partial``, as the vocabulary-parallel embedding's indices)."""
    for local in (False, True):
        out = [k for k, ins in enumerate(strategies.inputs) if len(ins) == len(want) and all(
            w is _FREE or (i is not None and _reaches(w, i[d], local))
            for i, w in zip(ins, want, strict=True))]
        if out:
            return out
    return []


def _reaches(have: Any, want: Any, local: bool) -> bool:
    return have == want or (local and have is not None and have.is_replicate()
                            and want.is_partial())


def _shown(p: Any) -> str:
    if isinstance(p, tuple):
        return format_strategy_output(tuple(None if x is None else (x,) for x in p))
    return format_placements((p,))


def apply_dim_pins(pins: DimPins, problem: list[ProblemNode], table: StrategyTable,
                   grouping: Any, ndim: int) -> dict[str, str]:
    """Restrict each pinned node's group to the strategies every pinned member keeps (the
    indices are those of the lists the pins were computed on; a group's members share
    their labels' indexing). Returns ``{node name: text}`` (``*`` on the free mesh dims).

    Raises TopologyError when the members' pins leave a group no strategy.
    """
    from pipeline.stages.topology.candidates import StrategyList

    by_group: dict[int, set[int]] = {}
    for node, ks in pins.keep.items():
        g = grouping.group_of[node]
        by_group[g] = set(ks) if g not in by_group else by_group[g] & ks
    for g, ks in sorted(by_group.items()):
        members = grouping.groups[g]
        if not ks:
            raise TopologyError(f"node {problem[members[0]].name}: the recipe's pins on its "
                                "mesh dims leave no strategy")
        order = sorted(ks)
        restricted: dict[int, int] = {}
        for member in members:
            old = problem[member].strategy_list
            if len(order) == len(table[old]):
                continue
            if old not in restricted:
                src = table[old]
                restricted[old] = table.intern(StrategyList(
                    tuple(src.outputs[k] for k in order), tuple(src.inputs[k] for k in order),
                    src.fallback))
            problem[member].strategy_list = restricted[old]
    return {problem[node].name: "".join(pins.text[node].get(d, "*") for d in range(ndim))
            for node in sorted(pins.keep)}
