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
from pathlib import Path
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
    from pipeline.ir import resolve_op

    parts = target.split(".")
    if parts[:2] == ["torch", "_ops"] and len(parts) >= 6:
        target = ".".join(parts[3:])
    return resolve_op(target, strict=False)


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
    import torch.distributed as dist

    from pipeline.plan import check_mesh, check_world_size

    check_mesh(plan, mesh)
    if dist.is_initialized():
        check_world_size(plan, dist.get_world_size())
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
    input_position = {n.idx: k for k, n in enumerate(
        m for m in graph if m.kind == "placeholder" and m.role == "input")}

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
        if n.role == "param":
            src = params.get(n.fqn)
        elif n.role == "buffer":
            src = buffers.get(n.fqn)
        elif n.role == "input":
            k = input_position[n.idx]
            src = inputs[k] if k < len(inputs) else None
        else:  # the tangent of the loss: d loss / d loss = 1
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


def run_graph(plan: Plan) -> Any:
    """The graph IR table of the run a plan file sits in (``graph.parquet`` in a parent
    directory of the plan, the run's trace directory), checked against the plan's
    trace hash.

    Raises:
        PlanError: no ``graph.parquet`` above the plan, or one of another trace.
    """
    from pipeline.plan import check_graph
    from pipeline.trace import GRAPH_FILE, read_graph

    for parent in Path(plan.path).resolve().parents:
        if (parent / GRAPH_FILE).exists():
            table, _ = read_graph(parent)
            check_graph(plan, table)
            return table
    raise PlanError(f"plan={plan.path}: no {GRAPH_FILE} in a parent directory; pass the "
                    "graph IR of the run's trace stage")


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
    if nodes is None:
        from pipeline.topology import load_nodes

        nodes = load_nodes(run_graph(plan))
    names = plan.mesh_names
    ndim = len(names)
    idx_of = {n.name: n.idx for n in nodes}
    by_idx = {n.idx: n for n in nodes}
    users: dict[int, list[tuple[Any, int]]] = collections.defaultdict(list)
    for n in nodes:
        for k, r in enumerate(n.refs):
            users[r].append((n, k))
    pnode = {n.name: n for n in plan.nodes}

    def first_use(name: str) -> tuple[str, Any] | None:
        """(placement the first forward consumer expects, that consumer)."""
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

    per_module: dict[str, list[tuple[str, list[str]]]] = {}
    for p in plan.parameters:
        module = p.name.rsplit(".", 1)[0] if "." in p.name else ""
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
        per_module.setdefault(module, []).append((p.name, readings))

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


__all__ = ["COLLECTIVE_KINDS", "CollectiveCounter", "ModuleStyle", "PlacementMismatchError",
           "StepResult", "TorchStyles", "distribute_full", "distribute_state_dict",
           "resolve_target", "run_graph", "run_step", "state_dict_layout", "torch_styles"]
