"""The graph interpreter: the traced training step run on DTensors as the plan says.

:func:`run_step` interprets the joint forward + loss + backward graph of the trace
stage (``graph.parquet``, decoded by :func:`pipeline.core.ir.load_nodes`) node by node
on a real process group:

1. placeholders: parameters, buffers and model inputs are DTensors in their planned
   storage placements (full tensors given on every rank are split locally, no
   communication); the tangent of the loss is a replicated one;
2. each call node: every tensor argument whose current placement differs from the
   placement the plan expects for it is redistributed (``DTensor.redistribute``; into
   a new Partial, which its public API refuses, by a local partition: one
   redistribution per graph edge, exactly the edges of ``redistributions.parquet``),
   the op is called on the DTensors, so DTensor's own sharding propagation picks the
   output placement, and that placement is compared with the plan's; a difference
   raises :class:`PlacementMismatchError` naming the node. A node the plan marks as
   *fallback* (no DTensor strategy, replicate-only) runs on the local (replicated)
   tensors and its outputs are wrapped as replicated DTensors;
3. the output node: the loss is redistributed to Replicate and every gradient to its
   parameter's placement (the reduce-scatter or all-reduce of the gradient sink).

An ``aten.view`` whose input the trace saw viewable but whose local tensor is not (a
CPU kernel or a collective laid it out otherwise than the meta kernel the trace ran)
runs on a contiguous copy of it: the same values and placements.

Non-tensor values are decoded from the IR: dtypes (optionally mapped to a
``compute_dtype``, so a bf16 plan can be executed in float32), devices (``meta`` ->
the mesh's device type), layouts, infinities. A plain tensor where the plan expects a
DTensor (an op's extra outputs without a sharding spec, such as the RNG state of
flash attention, or a factory op's result) is the same on every rank and is wrapped
in its planned placement locally.

:func:`run_graph` finds the graph IR of the run a plan file sits in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from pipeline.apply.counter import CollectiveCounter
from pipeline.core.artifacts import GRAPH_FILE
from pipeline.core.errors import PlanError
from pipeline.core.ir import read_graph
from pipeline.dtensor.placements import (
    NON_TENSOR,
    format_placements,
    parse_output,
    parse_placements,
)
from pipeline.dtensor.torch_compat import local_tensor
from pipeline.plan.format import Plan, check_graph, check_mesh, check_world_size

__all__ = ["PlacementMismatchError", "StepResult", "distribute_full", "resolve_target",
           "run_graph", "run_step"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
#: How aten (plain tensors) and DTensor (its view-op propagation) say a view is impossible.
_NOT_VIEWABLE = ("view size is not compatible", "Cannot view a tensor")


class PlacementMismatchError(PlanError):
    """DTensor chose another placement than the plan for a node, or could not run it."""



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
    from pipeline.core.ir import resolve_op

    parts = target.split(".")
    if parts[:2] == ["torch", "_ops"] and len(parts) >= 6:
        target = ".".join(parts[3:])
    return resolve_op(target, strict=False)


def _local(t: Any) -> torch.Tensor:
    """The local tensor of a DTensor (an async collective result waited for)."""
    local = local_tensor(t) if isinstance(t, DTensor) else t
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


def _redistribute(value: DTensor, mesh: Any, want: tuple) -> DTensor:
    """``value.redistribute(mesh, want)``, also into a Partial it is not in yet: DTensor's
    public ``redistribute`` refuses targets with a new Partial ("for internal use only"),
    which a plan chooses when a Replicate operand feeds an op whose other operand is a
    Partial (a bias added to a partial matmul). Those mesh dims are first made Replicate
    (with the usual collectives), then partitioned locally by the Partial placement's
    own ``_partition_value`` (a sum divided by the mesh dim's size; no communication),
    the conjugate of its reduction."""
    new_partial = [d for d, p in enumerate(want)
                   if p.is_partial() and value.placements[d] != p]
    if not new_partial:
        return value.redistribute(mesh, want)
    middle = tuple(Replicate() if d in new_partial else p for d, p in enumerate(want))
    if format_placements(middle) != format_placements(value.placements):
        value = value.redistribute(mesh, middle)
    local = _local(value)
    for d in new_partial:
        local = want[d]._partition_value(local, mesh, d)
    return DTensor.from_local(local, mesh, want, run_check=False, shape=value.shape,
                              stride=value.stride())


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
            :func:`pipeline.plan.format.check_graph`).
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
                return _redistribute(value, mesh, want)
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
    if op is torch.ops.aten.view.default:
        try:
            return op(*args, **kwargs)
        except RuntimeError as err:
            if not any(m in str(err) for m in _NOT_VIEWABLE):
                raise
        # the traced strides made this a view, the local tensor's (a kernel's or a
        # collective's layout) do not: the same values, made contiguous first
        src = args[0]
        if isinstance(src, DTensor):
            src = DTensor.from_local(_local(src).contiguous(), src.device_mesh,
                                     src.placements, run_check=False, shape=src.shape,
                                     stride=src.stride())
        else:
            src = src.contiguous()
        return op(src, *args[1:], **kwargs)
    return op(*args, **kwargs)


def run_graph(plan: Plan) -> Any:
    """The graph IR table of the run a plan file sits in (``graph.parquet`` in a parent
    directory of the plan, the run's trace directory), checked against the plan's
    trace hash.

    Raises:
        PlanError: no ``graph.parquet`` above the plan, or one of another trace.
    """
    for parent in Path(plan.path).resolve().parents:
        if (parent / GRAPH_FILE).exists():
            table, _ = read_graph(parent)
            check_graph(plan, table)
            return table
    raise PlanError(f"plan={plan.path}: no {GRAPH_FILE} in a parent directory; pass the "
                    "graph IR of the run's trace stage")
