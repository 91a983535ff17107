"""Executing a plan: the traced training step run on DTensors as the plan says.

:func:`run_step` interprets the joint forward + loss + backward graph of the trace
stage (``graph.parquet``, decoded by :func:`pipeline.topology.load_nodes`) node by node
on a real process group:

1. placeholders: parameters, buffers and model inputs are DTensors in their planned
   storage placements (full tensors given on every rank are split locally, no
   communication); the tangent of the loss is a replicated one;
2. each call node: every tensor argument whose current placement differs from the
   placement the plan expects for it is redistributed (``DTensor.redistribute``: one
   redistribution per graph edge, exactly the edges of ``redistributions.parquet``),
   the op is called on the DTensors, so DTensor's own sharding propagation picks the
   output placement, and that placement is compared with the plan's; a difference
   raises :class:`PlacementMismatchError` naming the node. A node the plan marks as
   *fallback* (no DTensor strategy, replicate-only) runs on the local (replicated)
   tensors and its outputs are wrapped as replicated DTensors;
3. the output node: the loss is redistributed to Replicate and every gradient to its
   parameter's placement (the reduce-scatter or all-reduce of the gradient sink).

Non-tensor values are decoded from the IR: dtypes (optionally mapped to a
``compute_dtype``, so a bf16 plan can be executed in float32), devices (``meta`` ->
the mesh's device type), layouts, infinities. A plain tensor where the plan expects a
DTensor (an op's extra outputs without a sharding spec, such as the RNG state of
flash attention, or a factory op's result) is the same on every rank and is wrapped
in its planned placement locally.

Collectives are counted by :class:`CollectiveCounter`, a
``torch.distributed.tensor.debug.CommDebugMode`` that also reads the process group of
each functional collective and maps it to the mesh dim it belongs to; one call of a
functional collective on one mesh dim's group is one collective. On CPU, DTensor runs
an all-to-all as an all-gather plus a local chunk (gloo has no all-to-all,
``_collective_utils.shard_dim_alltoall``); such a gather is counted as the
``all_to_all`` DTensor issued.

The module also exports a plan for training code: :func:`state_dict_layout` (the
placement of every state-dict entry, tied names included), :func:`distribute_state_dict`
(DTensors in those placements, e.g. for ``torch.distributed.checkpoint.load``) and
:func:`torch_styles` (FSDP2 ``fully_shard`` mesh dims and tensor-parallel
``parallelize_module`` styles, when the plan matches them, with the modules that do not).
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode

from pipeline.errors import PlanError
from pipeline.placements import NON_TENSOR, format_placements, parse_output, parse_placements
from pipeline.plan import Plan

#: Functional collectives (their op names) -> the collective kind of the cost model.
COLLECTIVE_KINDS: dict[str, str] = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
    "broadcast": "broadcast",
}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class PlacementMismatchError(PlanError):
    """DTensor chose another placement than the plan for a node, or could not run it."""


# --------------------------------------------------------------------------- counting


class CollectiveCounter(CommDebugMode):
    """``CommDebugMode`` that also counts collectives per ``kind(mesh dim name)``.

    ``counts`` maps e.g. ``"all_gather(dp)"`` to the number of functional collective
    calls of that kind on that mesh dim's process group (see the module docstring for
    the CPU all-to-all). ``get_comm_counts()`` keeps CommDebugMode's own per-op totals
    (every collective still goes through ``CommDebugMode.__torch_dispatch__``); other
    ops skip its per-op tracing tables.
    """

    def __init__(self, mesh: Any):
        super().__init__()
        names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
        self.group_dims = {mesh.get_group(d).group_name: names[d] for d in range(mesh.ndim)}
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives
        packet = func._overloadpacket
        if packet not in self.comm_registry:
            # Not a collective: skip CommDebugMode's per-op bookkeeping (its operation
            # lists cost more than the op on these small tensors).
            return func(*args, **(kwargs or {}))
        name = packet._qualified_op_name.split("::")[-1]
        kind = COLLECTIVE_KINDS.get(name, name)
        if kind == "all_gather" and _inside_cpu_alltoall():
            kind = "all_to_all"
        group = _group_name(func, args, kwargs or {})
        self.counts[f"{kind}({self.group_dims.get(group, group)})"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _group_name(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "group_name":
            value = kwargs.get("group_name", args[i] if i < len(args) else None)
            return str(value)
    return "?"


def _inside_cpu_alltoall() -> bool:
    """Whether DTensor's CPU all-to-all (all-gather + chunk) is on the call stack."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "shard_dim_alltoall" and code.co_filename.endswith(
                "_collective_utils.py"):
            return True
        frame = frame.f_back
    return False


# --------------------------------------------------------------------------- the step


@dataclasses.dataclass
class StepResult:
    """What :func:`run_step` returns (per rank).

    Attributes:
        loss: the 0-d loss, a replicated DTensor.
        grads: ``{fqn: gradient DTensor}`` in each parameter's planned placement.
        nodes_checked: graph nodes whose output placement was compared with the plan.
        redistributions: explicit ``redistribute`` calls (graph edges whose placements
            differ, sinks included).
        collectives: ``{kind(mesh dim): count}`` counted while the step ran (when a
            :class:`CollectiveCounter` was given).
        op_collectives: ``{node name: count}`` of collectives DTensor ran *inside* an op
            (it redistributed on its own: the planned inputs were not its strategy);
            empty for a plan DTensor follows.
        peak_local_bytes: peak bytes of live local tensors on this rank (distinct
            storages of parameters, buffers, inputs and every live intermediate).
    """

    loss: Any
    grads: dict[str, Any]
    nodes_checked: int
    redistributions: int
    collectives: dict[str, int]
    op_collectives: dict[str, int]
    peak_local_bytes: int


def resolve_target(target: str) -> Any:
    """The op of a graph IR ``target``: ``aten.mm.default``, ``<ns>.<op>.<overload>`` for
    a custom op (also in the ``torch._ops.<ns>.<ns>.<op>.<overload>`` spelling older
    traces wrote), or None."""
    parts = target.split(".")
    if parts[:2] == ["torch", "_ops"] and len(parts) >= 6:
        parts = parts[3:]
    if len(parts) != 3:
        return None
    ns, op, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        return None


def _local(t: Any) -> torch.Tensor:
    """The local tensor of a DTensor (an async collective result waited for)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    wait = getattr(local, "trigger_wait", None)
    return wait() if wait is not None else local


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _live_bytes(values: Mapping[int, Any]) -> int:
    seen: dict[int, int] = {}
    for value in values.values():
        for t in _tensors(value):
            local = _local(t)
            try:
                storage = local.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


class _Decoder:
    """Decode IR argument values (see the module docstring)."""

    def __init__(self, device_type: str, compute_dtype: torch.dtype | None):
        self.device = torch.device(device_type)
        self.compute_dtype = compute_dtype

    def dtype(self, name: str) -> torch.dtype:
        dt = getattr(torch, name)
        if self.compute_dtype is not None and dt in _LOW_PRECISION:
            return self.compute_dtype
        return dt

    def __call__(self, obj: Any, tensors: list[Any], node: str) -> Any:
        if isinstance(obj, list):
            return [self(v, tensors, node) for v in obj]
        if isinstance(obj, dict):
            if set(obj) == {"node"}:
                return tensors.pop(0)
            if set(obj) == {"dtype"}:
                return self.dtype(obj["dtype"])
            if set(obj) == {"enum"}:
                text = obj["enum"]
                if text.startswith("torch."):
                    return getattr(torch, text.split(".", 1)[1])
                return self.device if torch.device(text).type == "meta" else torch.device(text)
            if set(obj) == {"float"}:
                return float(obj["float"])
            if set(obj) == {"repr"}:
                raise PlacementMismatchError(
                    f"node {node}: argument {obj['repr']} cannot be rebuilt from the graph IR")
            return {k: self(v, tensors, node) for k, v in obj.items()}
        return obj


def _fmt(value: Any) -> str:
    if isinstance(value, DTensor):
        return format_placements(value.placements)
    if isinstance(value, torch.Tensor):
        return "plain tensor"
    return type(value).__name__


def _as_dtensor(t: torch.Tensor, mesh: Any, placements: tuple) -> DTensor:
    """A tensor that is the same on every rank, as a DTensor in ``placements`` (local)."""
    from torch.distributed.tensor import distribute_tensor

    if all(isinstance(p, Replicate) for p in placements):
        return DTensor.from_local(t, mesh, placements, run_check=False)
    if any(p.is_partial() for p in placements):
        rep = DTensor.from_local(t, mesh, (Replicate(),) * mesh.ndim, run_check=False)
        return rep.redistribute(mesh, placements)
    return distribute_tensor(t, mesh, placements, src_data_rank=None)


def distribute_full(t: torch.Tensor, mesh: Any, placement: str) -> DTensor:
    """Split a full tensor held identically by every rank into ``placement`` locally
    (no communication): each rank keeps its shard."""
    return _as_dtensor(t, mesh, parse_placements(placement, mesh.ndim))


def run_step(nodes: Sequence[Any], plan: Plan, mesh: Any, *, params: Mapping[str, Any],
             buffers: Mapping[str, Any], inputs: Sequence[Any],
             compute_dtype: torch.dtype | None = None,
             counter: CollectiveCounter | None = None, track_memory: bool = True,
             on_node: Callable[[str, Any], None] | None = None) -> StepResult:
    """Run the traced training step as ``plan`` says (see the module docstring).

    Args:
        nodes: the decoded graph IR the plan was made from (check with
            :func:`pipeline.plan.check_graph`).
        plan: a loaded plan; ``mesh`` a ``DeviceMesh`` of the plan's shape and names on
            the current process group.
        params, buffers: ``{fqn: tensor}``; a plain tensor is the full value (the same on
            every rank) and is split locally; a DTensor must already be in its planned
            placement.
        inputs: the model inputs in order (plain full tensors or DTensors).
        compute_dtype: when given, bf16/fp16 dtypes in the graph become this dtype.
        counter: an entered :class:`CollectiveCounter`: its counts over the step are
            returned (and ``op_collectives`` attributed per node).
        track_memory: compute ``peak_local_bytes`` (a walk over live values per node).
        on_node: called with each node's name and value after its check (tests, tools).

    Raises:
        PlacementMismatchError: DTensor gave a node another output placement than the
            plan, could not run a node, or a given DTensor is not in its planned
            placement.
    """
    from pipeline.plan import check_mesh

    check_mesh(plan, mesh)
    ndim = mesh.ndim
    decode = _Decoder(mesh.device_type, compute_dtype)
    by_name = {n.name: n for n in plan.nodes}
    graph = [n for n in nodes if n.kind != "output"]
    out_node = next(n for n in nodes if n.kind == "output")
    last_use: dict[int, int] = {}
    for n in nodes:
        for r in n.refs:
            last_use[r] = n.idx
    persistent: set[int] = set()
    values: dict[int, Any] = {}
    before = dict(counter.counts) if counter is not None else {}
    op_collectives: dict[str, int] = {}
    redistributions = 0
    peak = 0
    checked = 0
    tangent_seen = False

    def comm_total() -> int:
        return sum(counter.counts.values()) if counter is not None else 0

    def to_planned(value: Any, text: str, where: str) -> Any:
        nonlocal redistributions
        if text == NON_TENSOR:
            return value
        want = parse_placements(text, ndim)
        if isinstance(value, DTensor):
            if format_placements(value.placements) == format_placements(want):
                return value
            redistributions += 1
            try:
                return value.redistribute(mesh, want)
            except (RuntimeError, ValueError, NotImplementedError, AssertionError) as err:
                raise PlacementMismatchError(
                    f"{where}: DTensor cannot redistribute {_fmt(value)} -> {text}: "
                    f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        if isinstance(value, torch.Tensor):
            return _as_dtensor(value, mesh, want)
        return value

    def placeholder(n: Any, pn: Any) -> Any:
        nonlocal tangent_seen
        if n.role == "param":
            src = params.get(n.fqn)
        elif n.role == "buffer":
            src = buffers.get(n.fqn)
        elif n.role == "input":
            k = sum(1 for m in graph[: graph.index(n)] if m.kind == "placeholder"
                    and m.role == "input")
            src = inputs[k] if k < len(inputs) else None
        else:  # the tangent of the loss: d loss / d loss = 1
            tangent_seen = True
            meta = n.outputs[0]
            src = torch.ones(meta["shape"], dtype=decode.dtype(meta["dtype"]))
        if src is None:
            raise PlacementMismatchError(
                f"node {n.name}: no value given for {n.role} {n.fqn or n.name}")
        if isinstance(src, DTensor):
            if format_placements(src.placements) != pn.output:
                raise PlacementMismatchError(
                    f"node {n.name} ({n.role} {n.fqn or n.name}): given as {_fmt(src)}, "
                    f"plan says {pn.output}")
            return src
        if compute_dtype is not None and src.dtype in _LOW_PRECISION:
            src = src.to(compute_dtype)
        return _as_dtensor(src, mesh, parse_placements(pn.output, ndim))

    def check(n: Any, pn: Any, value: Any) -> Any:
        planned = parse_output(pn.output, ndim)
        elems = list(value) if n.tuple_output and isinstance(value, (list, tuple)) else [value]
        fixed = list(elems)
        for k, want in enumerate(planned):
            if want is None or k >= len(elems):
                continue
            v = elems[k]
            if isinstance(v, DTensor):
                got = format_placements(v.placements)
                if got != format_placements(want):
                    raise PlacementMismatchError(
                        f"node {n.name} ({n.target}"
                        + (f", {n.module_path}" if n.module_path else "")
                        + f"): DTensor produced {got}"
                        + (f" for output {k}" if n.tuple_output else "")
                        + f", the plan says {format_placements(want)} (inputs "
                        + ", ".join(pn.inputs) + ")")
            elif isinstance(v, torch.Tensor):
                fixed[k] = _as_dtensor(v, mesh, want)
        if n.tuple_output and isinstance(value, (list, tuple)):
            return type(value)(fixed) if isinstance(value, tuple) else fixed
        return fixed[0]

    for n in graph:
        pn = by_name.get(n.name)
        if pn is None:
            raise PlacementMismatchError(f"node {n.name}: not in the plan (another trace?)")
        if n.kind == "placeholder":
            value = placeholder(n, pn)
            persistent.add(n.idx)
        elif n.target == "getitem":
            element = n.args[1]
            src = values[n.refs[0]][element]
            value = to_planned(src, pn.inputs[0], f"node {n.name} (getitem {element})")
        else:
            op = resolve_target(n.target)
            if op is None:
                raise PlacementMismatchError(f"node {n.name}: op {n.target} is not a torch op "
                                             "this torch knows")
            if len(pn.inputs) != len(n.refs):
                raise PlacementMismatchError(
                    f"node {n.name}: the plan gives {len(pn.inputs)} input placements for "
                    f"{len(n.refs)} tensor arguments")
            args = [to_planned(values[r], text, f"node {n.name} argument {k}")
                    for k, (r, text) in enumerate(zip(n.refs, pn.inputs))]
            start = comm_total()
            if pn.fallback:
                local = [_local(a) for a in args]
                value = _call(op, decode, n, local)
            else:
                try:
                    value = _call(op, decode, n, args)
                except PlanError:
                    raise
                except Exception as err:  # noqa: BLE001 - reported with the node's name
                    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    raise PlacementMismatchError(
                        f"node {n.name} ({n.target}): DTensor could not run it with inputs "
                        + ", ".join(pn.inputs) + f": {type(err).__name__}: {first}") from None
            inside = comm_total() - start
            if inside:
                op_collectives[n.name] = inside
        value = check(n, pn, value)
        checked += 1
        values[n.idx] = value
        if on_node is not None:
            on_node(n.name, value)
        if track_memory:
            peak = max(peak, _live_bytes(values))
        for r in set(n.refs):
            if last_use.get(r) == n.idx and r not in persistent:
                values.pop(r, None)
        if n.idx not in last_use and n.idx not in persistent:
            values.pop(n.idx, None)

    sinks = {int(o["index"]): o for o in plan.outputs}
    flat = out_node.args[0] if out_node.args else []
    loss = None
    grads: dict[str, Any] = {}
    for k, ref in enumerate(flat):
        if not (isinstance(ref, dict) and "node" in ref) or k not in sinks:
            continue
        sink = sinks[k]
        value = to_planned(values[ref["node"]], str(sink["placement"]), f"output {sink['node']}")
        if sink["kind"] == "grad":
            grads[str(sink["grad_of"])] = value
        else:
            loss = value
    if loss is None:
        raise PlacementMismatchError("the graph output holds no loss")
    del tangent_seen
    counts = {}
    if counter is not None:
        counts = {k: v - before.get(k, 0) for k, v in sorted(counter.counts.items())
                  if v - before.get(k, 0)}
    return StepResult(loss=loss, grads=grads, nodes_checked=checked,
                      redistributions=redistributions, collectives=counts,
                      op_collectives=op_collectives, peak_local_bytes=peak)


def _call(op: Any, decode: _Decoder, n: Any, tensors: list[Any]) -> Any:
    """Call ``op`` with node ``n``'s arguments, its tensor arguments taken from ``tensors``
    (in flattened args-then-kwargs order)."""
    pending = list(tensors)
    args = decode(n.args, pending, n.name)
    kwargs = {k: decode(v, pending, n.name) for k, v in n.kwargs.items()}
    return op(*args, **kwargs)


def _refs_in(obj: Any) -> list[int]:
    if isinstance(obj, dict):
        if set(obj) == {"node"}:
            return [obj["node"]]
        return [r for v in obj.values() for r in _refs_in(v)]
    if isinstance(obj, list):
        return [r for v in obj for r in _refs_in(v)]
    return []


# --------------------------------------------------------------------------- export


def state_dict_layout(plan: Plan, model: Any = None) -> dict[str, tuple]:
    """``{state-dict key: DTensor placements}`` of every parameter and buffer.

    With ``model`` (an ``nn.Module``), tied names (``lm_head.weight`` when it *is*
    ``wte.weight``) get the placement of the tensor they share, and only the model's
    own state-dict keys are listed (non-persistent buffers are not state).
    """
    layout = {t.name: plan.placements(t.placement) for t in plan.parameters + plan.buffers}
    if model is None:
        return layout
    first_name: dict[int, str] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        first_name.setdefault(id(t), name)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    out = {}
    for key in model.state_dict(keep_vars=True):
        t = tensors.get(key)
        src = first_name.get(id(t), key) if t is not None else key
        if src in layout:
            out[key] = layout[src]
    return out


def distribute_state_dict(state_dict: Mapping[str, Any], mesh: Any, plan: Plan,
                          model: Any = None, src_data_rank: int | None = 0
                          ) -> dict[str, DTensor]:
    """The entries of ``state_dict`` as DTensors in their planned placements.

    ``src_data_rank=0`` scatters rank 0's values (``distribute_tensor``); ``None`` splits
    the full tensor every rank holds locally. A meta tensor gives an empty DTensor to
    load into (``torch.distributed.checkpoint.load``).
    """
    from torch.distributed.tensor import distribute_tensor

    layout = state_dict_layout(plan, model)
    out = {}
    for key, value in state_dict.items():
        if key not in layout:
            raise PlanError(f"state_dict[{key}]: not a parameter or buffer of the plan "
                            f"(plan={plan.path})")
        placements = layout[key]
        if value.device.type == "meta":
            from pipeline.placements import local_shape

            local = torch.empty(local_shape(value.shape, placements, plan.mesh_shape),
                                dtype=value.dtype, device=mesh.device_type)
            out[key] = DTensor.from_local(local, mesh, placements, run_check=False,
                                          shape=value.shape, stride=value.stride())
        else:
            out[key] = distribute_tensor(value.detach(), mesh, placements,
                                         src_data_rank=src_data_rank)
    return out


@dataclasses.dataclass
class TorchStyles:
    """A plan in terms of FSDP2 and tensor-parallel styles (:func:`torch_styles`).

    Attributes:
        fsdp_dims: mesh dim names ``fully_shard`` shards over (parameters stored Shard(0)
            and gathered for use), () when the plan stores no parameter that way.
        replicate_dims: mesh dim names parameters are replicated over (DDP / HSDP's
            replicate dim).
        tp_dim: the mesh dim of tensor parallelism, or None.
        fully_shard: modules to wrap with ``fully_shard(module, mesh=mesh[fsdp_dims])``.
        parallelize_plan: ``{module fqn: style name}`` (``ColwiseParallel``,
            ``RowwiseParallel``, ``SequenceParallel``) for ``parallelize_module``.
        unmatched: ``{module fqn: reason}`` for modules whose placements are none of these.
    """

    fsdp_dims: tuple[str, ...]
    replicate_dims: tuple[str, ...]
    tp_dim: str | None
    fully_shard: list[str]
    parallelize_plan: dict[str, str]
    unmatched: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def parallel_styles(self) -> dict[str, Any]:
        """``parallelize_plan`` with torch style objects (for ``parallelize_module``)."""
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
        )

        make = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
                "SequenceParallel": SequenceParallel}
        return {k: make[v]() for k, v in self.parallelize_plan.items()}


def torch_styles(plan: Plan, nodes: Sequence[Any]) -> TorchStyles:
    """Express the plan's parameter placements as FSDP2 / tensor-parallel styles.

    Per parameter and mesh dim, the storage placement is compared with the placement
    its first forward consumer expects (through casts to the compute dtype):

    * stored ``S(0)``, used ``R``: ``fully_shard`` over that dim (gathered before use,
      gradient reduce-scattered);
    * stored ``R``, used ``R``: replicated over that dim (DDP, or HSDP's replicate dim);
    * stored = used = ``S(0)`` of a 2-d weight ``[out, in]`` (or ``S(1)`` of an embedding
      table): ``ColwiseParallel``; ``S(1)`` (or ``S(0)`` of an embedding table):
      ``RowwiseParallel``; a 1-d weight stored and used ``R`` next to sequence-sharded
      (``S(1)``) activations: ``SequenceParallel``.

    A module matches when every one of its parameters gets the same reading and all
    modules agree on which mesh dims are FSDP, replicate and TP dims; every other module
    is listed in ``unmatched`` with the reason.
    """
    ndim = len(plan.mesh_shape)
    names = plan.mesh_names
    graph = {n.name: n for n in nodes}
    users: dict[int, list[Any]] = collections.defaultdict(list)
    for n in nodes:
        for k, r in enumerate(n.refs):
            users[r].append((n, k))
    pnode = {n.name: n for n in plan.nodes}
    idx_of = {n.name: n.idx for n in nodes}

    def use_of(name: str) -> tuple[str, Any] | None:
        """(placement the first forward compute consumer expects, that consumer)."""
        frontier = [(name, None)]
        while frontier:
            cur, _ = frontier.pop(0)
            for user, k in sorted(users[idx_of[cur]], key=lambda u: u[0].idx):
                if user.kind == "output" or user.phase != "fwd":
                    continue
                text = pnode[user.name].inputs[k]
                if user.target in ("aten._to_copy.default", "aten.detach.default") \
                        and text == pnode[cur].output:
                    return use_of(user.name) or (text, user)
                return text, user
        return None

    per_module: dict[str, list[tuple[str, str, tuple, tuple, list[int]]]] = {}
    for p in plan.parameters:
        module = p.name.rsplit(".", 1)[0] if "." in p.name else ""
        use = use_of(p.node)
        stored = plan.placements(p.placement)
        used = plan.placements(use[0]) if use else stored
        per_module.setdefault(module, []).append((p.name, p.placement, stored, used,
                                                  list(p.shape)))
    del graph
    readings: dict[str, list[str] | str] = {}
    for module, entries in per_module.items():
        per_dim: list[set[str]] = [set() for _ in range(ndim)]
        for _fqn, _text, stored, used, shape in entries:
            for d in range(ndim):
                per_dim[d].add(_reading(stored[d], used[d], shape, module))
        if any(len(s) != 1 for s in per_dim):
            readings[module] = "parameters of the module are placed differently: " + "; ".join(
                f"{e[0]} stored {e[1]}" for e in entries)
            continue
        readings[module] = [next(iter(s)) for s in per_dim]
    dim_roles: list[set[str]] = [set() for _ in range(ndim)]
    for r in readings.values():
        if isinstance(r, list):
            for d, x in enumerate(r):
                dim_roles[d].add(_role(x))
    role_of = []
    for d in range(ndim):
        roles = dim_roles[d] - {"replicate"} or dim_roles[d]
        role_of.append(next(iter(roles)) if len(roles) == 1 else "mixed")
    fsdp = tuple(names[d] for d in range(ndim) if role_of[d] == "fsdp")
    rep = tuple(names[d] for d in range(ndim) if role_of[d] == "replicate")
    tp = [names[d] for d in range(ndim) if role_of[d] == "tp"]
    tp_dim = tp[0] if len(tp) == 1 else None
    fully, styles, unmatched = [], {}, {}
    for module, r in sorted(readings.items()):
        label = module or "<root>"
        if isinstance(r, str):
            unmatched[label] = r
            continue
        bad = [f"mesh dim {names[d]}: {x}" for d, x in enumerate(r)
               if _role(x) not in (role_of[d], "replicate") or x.startswith("other")]
        if len(tp) > 1:
            bad.append("tensor parallelism over more than one mesh dim (" + ",".join(tp) + ")")
        if bad:
            unmatched[label] = "; ".join(bad)
            continue
        if any(_role(x) == "fsdp" for x in r):
            fully.append(label)
        for x in r:
            if _role(x) == "tp":
                styles[label] = x
    return TorchStyles(fsdp_dims=fsdp, replicate_dims=rep, tp_dim=tp_dim, fully_shard=fully,
                       parallelize_plan=styles, unmatched=unmatched)


def _role(reading: str) -> str:
    if reading in ("ColwiseParallel", "RowwiseParallel", "SequenceParallel"):
        return "tp"
    return reading.split(":")[0]


def _reading(stored: Any, used: Any, shape: list[int], module: str) -> str:
    """One parameter on one mesh dim: fsdp | replicate | a TP style | other: why."""
    s, u = format_placements((stored,)), format_placements((used,))
    if s == "R" and u == "R":
        return "replicate"
    if stored.is_shard() and u == "R":
        if stored.dim % max(len(shape), 1) == 0:
            return "fsdp"
        return f"other: stored {s} and gathered for use (FSDP2 shards dim 0)"
    if s == u and stored.is_shard():
        d = stored.dim % max(len(shape), 1)
        is_embedding = module.endswith(("embeddings", "embed_tokens", "wte", "wpe", "embed"))
        if len(shape) == 2:
            if is_embedding:
                return "RowwiseParallel" if d == 0 else "ColwiseParallel"
            return "ColwiseParallel" if d == 0 else "RowwiseParallel"
        if len(shape) == 1:
            return "ColwiseParallel"
    return f"other: stored {s}, used {u}"


__all__ = ["COLLECTIVE_KINDS", "CollectiveCounter", "PlacementMismatchError", "StepResult",
           "TorchStyles", "distribute_full", "distribute_state_dict", "resolve_target",
           "run_step", "state_dict_layout", "torch_styles"]
