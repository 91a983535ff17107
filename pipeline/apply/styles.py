"""Reading a plan as torch's own parallel styles: :func:`torch_styles` (FSDP2
``fully_shard`` mesh dims and tensor-parallel ``parallelize_module`` styles, when the
plan matches them, with the modules that do not).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.apply.step import run_graph
from pipeline.core.ir import load_nodes
from pipeline.dtensor.placements import format_placements
from pipeline.plan.format import Plan

__all__ = ["ModuleStyle", "TorchStyles", "backward_reads", "parameter_readings",
           "parameter_uses", "torch_styles"]

#: Ops a parameter passes through on its way to the op that computes with it (casts
#: and views): the *use* of the parameter is the placement the first of them expects.
_VIEW_OPS = frozenset({"aten._to_copy.default", "aten.detach.default", "aten.t.default",
                       "aten.view.default", "aten.transpose.int", "aten._unsafe_view.default",
                       "aten.permute.default", "aten.expand.default", "aten.clone.default"})
_TP_STYLES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel")


@dataclasses.dataclass
class ModuleStyle:
    """How one module's parameters are placed, in FSDP2 / tensor-parallel terms.

    Attributes:
        fsdp_dims: mesh dims ``fully_shard`` shards the module over (stored sharded,
            gathered before use, gradients reduce-scattered).
        shard_dims: ``{parameter: tensor dim}`` FSDP shards (0 unless FSDP2 needs a
            ``shard_placement_fn``).
        replicate_dims: mesh dims the parameters are replicated over (DDP, HSDP).
        tp_dim, tp_style: the mesh dim and ``parallelize_module`` style, or None.
    """

    fsdp_dims: tuple[str, ...] = ()
    shard_dims: dict[str, int] = dataclasses.field(default_factory=dict)
    replicate_dims: tuple[str, ...] = ()
    tp_dim: str | None = None
    tp_style: str | None = None


@dataclasses.dataclass
class TorchStyles:
    """A plan's parameter placements in terms of FSDP2 and tensor-parallel styles
    (:func:`torch_styles`).

    Attributes:
        modules: ``{module fqn: ModuleStyle}`` of every module whose parameters match.
        unmatched: ``{module fqn: reason}`` for modules whose placements are none of
            these styles (``""`` is the root module).
    """

    modules: dict[str, ModuleStyle]
    unmatched: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"modules": {k: dataclasses.asdict(v) for k, v in self.modules.items()},
                "unmatched": dict(self.unmatched)}

    def fully_shard_groups(self) -> dict[tuple[str, ...], list[str]]:
        """``{(replicate dims..., shard dims...): [modules]}``: call
        ``fully_shard(module, mesh=mesh[dims])`` for each (HSDP when a replicate dim
        comes first)."""
        out: dict[tuple[str, ...], list[str]] = {}
        for name, m in sorted(self.modules.items()):
            if m.fsdp_dims:
                out.setdefault(m.replicate_dims + m.fsdp_dims, []).append(name)
        return out

    def parallelize_plans(self) -> dict[str, dict[str, str]]:
        """``{tp mesh dim: {module fqn: style name}}`` for ``parallelize_module``."""
        out: dict[str, dict[str, str]] = {}
        for name, m in sorted(self.modules.items()):
            if m.tp_dim is not None and m.tp_style is not None:
                out.setdefault(m.tp_dim, {})[name] = m.tp_style
        return out

    def parallel_styles(self, tp_dim: str) -> dict[str, Any]:
        """The plan of ``tp_dim`` with torch style objects (``parallelize_module``)."""
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
        )

        make = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
                "SequenceParallel": SequenceParallel}
        return {k: make[v]() for k, v in self.parallelize_plans().get(tp_dim, {}).items()}



def parameter_readings(plan: Plan, nodes: Sequence[Any] | None = None
                       ) -> dict[str, list[str]]:
    """``{parameter fqn: [reading per mesh dim]}``: each reading is ``fsdp:<tensor dim>``,
    ``replicate``, ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel`` or
    ``other: <why>`` (the rules of :func:`torch_styles`).
    ``nodes``: the decoded graph IR; default the run's (:func:`run_graph`)."""
    if nodes is None:
        nodes = load_nodes(run_graph(plan))
    names = plan.mesh_names
    ndim = len(names)
    by_idx = {n.idx: n for n in nodes}
    users = _users(nodes)
    pnode = {n.name: n for n in plan.nodes}
    first_use = _first_use(plan, nodes, users)

    def compute_op(user: Any) -> tuple[Any, int | None]:
        """(the first op past casts and views, the position of the weight's branch among
        its tensor arguments)."""
        prev = None
        while user is not None and user.target in _VIEW_OPS:
            nxt = sorted((u[0] for u in users[user.idx] if u[0].phase == "fwd"),
                         key=lambda u: u.idx)
            prev, user = user, (nxt[0] if nxt else None)
        if user is None:
            return None, None
        pos = user.refs.index(prev.idx) if prev is not None and prev.idx in user.refs else None
        return user, pos

    def layouts_ok(style: str, op: Any, pos: int | None, d: int) -> str | None:
        """Why the activations of a matmul do not follow ``style`` on mesh dim ``d``, or
        None: ColwiseParallel takes a replicated input and gives an output sharded on its
        last dim; RowwiseParallel takes an input sharded on its last dim and gives a
        partial sum."""
        if op is None or pos is None or op.target != "aten.mm.default" or len(op.refs) != 2:
            return None
        act = format_placements((plan.placements(pnode[op.name].inputs[1 - pos])[d],))
        out = format_placements((plan.placements(pnode[op.name].output)[d],))
        if style == "ColwiseParallel" and (act != "R" or out != "S(1)"):
            return f"other: a column-sharded weight with input {act} and output {out}"
        if style == "RowwiseParallel" and (act != "S(1)" or out != "P"):
            return f"other: a row-sharded weight with input {act} and output {out}"
        return None

    out: dict[str, list[str]] = {}
    for p in plan.parameters:
        use = first_use(p.node)
        stored = plan.placements(p.placement)
        used = plan.placements(use[0]) if use else stored
        op, pos = compute_op(use[1]) if use else (None, None)
        readings = []
        for d in range(ndim):
            r = _reading(stored[d], used[d], list(p.shape), op)
            if r == "replicate" and len(p.shape) == 1 and op is not None and _seq_sharded(
                    op, d, pnode, by_idx, plan):
                r = "SequenceParallel"
            if r in ("ColwiseParallel", "RowwiseParallel"):
                r = layouts_ok(r, op, pos, d) or r
            readings.append(r)
        out[p.name] = readings
    return out


def parameter_uses(plan: Plan, nodes: Sequence[Any]) -> dict[str, str]:
    """``{parameter fqn: placement text it is used in}``: the placement its first forward
    consumer expects, past casts that keep the stored placement (its stored placement
    when nothing in forward reads it)."""
    first_use = _first_use(plan, nodes, _users(nodes))
    out = {}
    for p in plan.parameters:
        use = first_use(p.node)
        out[p.name] = use[0] if use else p.placement
    return out


def backward_reads(nodes: Sequence[Any]) -> set[str]:
    """The parameters (fqns) the traced backward reads: a backward node takes the
    parameter's placeholder or a forward copy computed from parameters alone (its cast,
    its transpose). FSDP2 re-gathers a unit before its backward only for these; an
    embedding table is not one (``embedding_dense_backward`` reads the output gradient
    and the indices, never the weight), as the cost model's re-gather rule
    (:meth:`pipeline.memory.graph.StepGraph.regather_edges`) has it."""
    sources: dict[int, set[str]] = {}
    for n in sorted(nodes, key=lambda n: n.idx):
        if n.kind == "placeholder" and n.role == "param" and n.fqn:
            sources[n.idx] = {n.fqn}
        elif n.phase == "fwd" and n.kind == "call_function" and n.refs and all(
                r in sources for r in n.refs):
            sources[n.idx] = set().union(*(sources[r] for r in n.refs))
    out: set[str] = set()
    for n in nodes:
        if n.phase == "bwd" and n.kind == "call_function":
            for r in n.refs:
                out |= sources.get(r, set())
    return out


def _users(nodes: Sequence[Any]) -> dict[int, list[tuple[Any, int]]]:
    """``{node idx: [(consumer node, argument position)]}``."""
    users: dict[int, list[tuple[Any, int]]] = collections.defaultdict(list)
    for n in nodes:
        for k, r in enumerate(n.refs):
            users[r].append((n, k))
    return users


def _first_use(plan: Plan, nodes: Sequence[Any], users: dict[int, list[tuple[Any, int]]]
               ) -> Any:
    """``first_use(node name) -> (placement its first forward consumer expects, that
    consumer) | None``, past ``_to_copy`` / ``detach`` that keep the placement."""
    idx_of = {n.name: n.idx for n in nodes}
    pnode = {n.name: n for n in plan.nodes}

    def first_use(name: str) -> tuple[str, Any] | None:
        fwd = sorted((u for u in users[idx_of[name]] if u[0].kind != "output"
                      and u[0].phase == "fwd"), key=lambda u: u[0].idx)
        if not fwd:
            return None
        user, k = fwd[0]
        text = pnode[user.name].inputs[k]
        if user.target in ("aten._to_copy.default", "aten.detach.default") \
                and text == pnode[name].output:
            return first_use(user.name) or (text, user)
        return text, user

    return first_use


def torch_styles(plan: Plan, nodes: Sequence[Any] | None = None) -> TorchStyles:
    """Express the plan's parameter placements as FSDP2 / tensor-parallel styles.

    For each parameter and mesh dim the storage placement is compared with the
    placement it is *used* in: the placement its first forward consumer expects, past
    casts that keep the storage placement (``_to_copy`` to the compute dtype). Readings:

    * stored ``S(k)``, used ``R``: FSDP over that dim (``fully_shard``; ``k != 0`` needs
      a ``shard_placement_fn``);
    * stored ``R``, used ``R``: replicated over that dim (DDP, HSDP's replicate dim); a
      1-d weight of a module whose activations are sequence-sharded (``S(1)``) there
      is ``SequenceParallel``;
    * stored = used ``S(d)``: tensor parallel: for a matrix ``[out, in]`` consumed by a
      matmul ``d = 0`` is ``ColwiseParallel``, ``d = 1`` ``RowwiseParallel``; for an
      embedding table (consumed by ``aten.embedding``) ``d = 0`` is ``RowwiseParallel``
      and ``d = 1`` ``ColwiseParallel``;
    * anything else (used sharded but stored otherwise, a sharded 1-d weight, ...) has
      no standard style.

    A module matches when all its parameters read the same on every mesh dim and at
    most one mesh dim is tensor parallel; otherwise it is listed in ``unmatched``.
    For a matmul weight the activations must follow the style too (ColwiseParallel:
    replicated input, output sharded on its last dim; RowwiseParallel: input sharded on
    its last dim, partial-sum output, which the consumer all-reduces or reduce-scatters).
    ``nodes``: the decoded graph IR; default the run's (:func:`run_graph`).
    """
    readings_of = parameter_readings(plan, nodes)
    names = plan.mesh_names
    per_module: dict[str, list[tuple[str, list[str]]]] = {}
    for p in plan.parameters:
        module = p.name.rsplit(".", 1)[0] if "." in p.name else ""
        per_module.setdefault(module, []).append((p.name, readings_of[p.name]))

    modules: dict[str, ModuleStyle] = {}
    unmatched: dict[str, str] = {}
    for module, entries in sorted(per_module.items()):
        label = module
        first = entries[0][1]
        kinds = [[_kind(r) for r in rs] for _, rs in entries]
        if any(k != kinds[0] for k in kinds):
            unmatched[label] = "its parameters are placed differently: " + "; ".join(
                f"{fqn}: " + ", ".join(f"{names[d]} {r}" for d, r in enumerate(rs))
                for fqn, rs in entries)
            continue
        other = [f"mesh dim {names[d]}: {r}" for d, r in enumerate(first)
                 if r.startswith("other")]
        tp = [d for d, r in enumerate(first) if r in _TP_STYLES]
        styles = {first[d] for d in tp} | {rs[d] for _, rs in entries for d in tp}
        if other:
            unmatched[label] = "; ".join(other)
            continue
        if len(tp) > 1:
            unmatched[label] = ("tensor parallel over more than one mesh dim ("
                                + ", ".join(names[d] for d in tp) + ")")
            continue
        if len(styles) > 1:
            unmatched[label] = "its parameters need different tensor-parallel styles: " + \
                ", ".join(sorted(styles))
            continue
        shard_dims = {fqn: int(rs_d.split(":")[1]) for fqn, rs in entries
                      for rs_d in rs if rs_d.startswith("fsdp:")}
        modules[label] = ModuleStyle(
            fsdp_dims=tuple(names[d] for d, r in enumerate(first) if r.startswith("fsdp")),
            shard_dims=shard_dims,
            replicate_dims=tuple(names[d] for d, r in enumerate(first) if r == "replicate"),
            tp_dim=names[tp[0]] if tp else None, tp_style=first[tp[0]] if tp else None)
    return TorchStyles(modules=modules, unmatched=unmatched)


def _kind(reading: str) -> str:
    return reading.split(":")[0]


def _reading(stored: Any, used: Any, shape: list[int], op: Any) -> str:
    """One parameter on one mesh dim: ``fsdp:<dim>``, ``replicate``, a TP style, or
    ``other: <why>``."""
    s, u = format_placements((stored,)), format_placements((used,))
    if s == "R" and u == "R":
        return "replicate"
    if stored.is_shard() and u == "R":
        return f"fsdp:{stored.dim % max(len(shape), 1)}"
    if s == u and stored.is_shard() and len(shape) == 2:
        d = stored.dim % 2
        if op is not None and op.target == "aten.embedding.default":
            return "RowwiseParallel" if d == 0 else "ColwiseParallel"
        if op is not None and op.target in ("aten.mm.default", "aten.addmm.default",
                                            "aten.bmm.default", "aten.linear.default"):
            return "ColwiseParallel" if d == 0 else "RowwiseParallel"
        return f"other: stored and used {s}, consumed by {getattr(op, 'target', None)}"
    return f"other: stored {s}, used {u}"


def _seq_sharded(op: Any, d: int, pnode: Mapping[str, Any], by_idx: Mapping[int, Any],
                 plan: Plan) -> bool:
    """Whether the 3-d activations ``op`` combines a 1-d weight with are sharded on the
    sequence dim (``S(1)``) on mesh dim ``d``."""
    expected = pnode[op.name].inputs
    for k, r in enumerate(op.refs):
        meta = by_idx[r].outputs[0] if by_idx[r].outputs else None
        if meta is not None and len(meta["shape"]) == 3 and k < len(expected):
            if format_placements((plan.placements(expected[k])[d],)) == "S(1)":
                return True
    return False
